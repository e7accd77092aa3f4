"""Exact target distributions and the chi-square test that sampling-losslessness tests share."""

from __future__ import annotations

import itertools

import torch
from transformers import AutoModelForCausalLM

from specserve import SamplingParams
from specserve.sampling import logits_to_probs


def exact_marginals(model_dir, prompt: list[int], params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """P(2nd emitted token) and P(3rd emitted token) after `prompt` under the processed target
    distribution (temperature/top-k/top-p/min-p), from transformers' logits. float64 [vocab] each."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size

    def dist(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor(prefixes)).logits[:, -1]
        m = len(prefixes)
        return logits_to_probs(logits, torch.full((m,), params.temperature), torch.full((m,), params.top_k),
                               torch.full((m,), params.top_p), torch.full((m,), params.min_p)).double()

    p1 = dist([prompt])[0]
    p2_given = dist([prompt + [a] for a in range(vocab)])  # [a, b]
    p3_given = dist([prompt + [a, b] for a, b in itertools.product(range(vocab), repeat=2)]).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2_given
    return joint12.sum(0), (joint12[:, :, None] * p3_given).sum((0, 1))


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of `counts` [K] to `probs` [K]; cells expecting < 5 are pooled."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


# Sampling tests check the 2nd and 3rd emitted tokens, but let requests run on: with max_tokens=3 the
# engine caps the first verify step's tree at one node (the tokens still to come), so siblings (and
# the verifier's residual between them) would never be exercised.
SAMPLED_MAX_TOKENS = 8


def assert_follows_target(outs, model_dir, prompt: list[int], params: SamplingParams) -> None:
    """The 2nd and 3rd tokens of `outs` (many seeded requests on `prompt`) match the exact target
    marginals: no token the target rules out, and a chi-square p-value above 1e-3 at each position."""
    exact2, exact3 = exact_marginals(model_dir, prompt, params)
    for position, exact in ((1, exact2), (2, exact3)):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=exact.numel()).double()
        assert float(counts[exact == 0].sum()) == 0, f"token {position + 1}: emitted a token the target gives zero probability"
        p_value = chi_square_p_value(counts, exact)
        assert p_value > 1e-3, f"token {position + 1}: chi-square p-value {p_value:.2e}"
