"""Exact target distributions and the chi-square test that sampling-losslessness tests share.

The exact distributions come from transformers' logits (not specserve's model) processed by the
independent float64 oracle in tests/sampling_oracle.py (not specserve.sampling.logits_to_probs, the
code under test): a bug in either specserve's forward pass or its temperature/top-k/top-p/min-p
filters shows up as a chi-square failure instead of being reproduced by the reference."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from sampling_oracle import target_probs_rows
from specserve import SamplingParams


def exact_marginals(model_dir, prompt: list[int], params: SamplingParams,
                    allowed: Callable[[list[int]], Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """P(2nd emitted token) and P(3rd emitted token) after `prompt` under the processed target
    distribution (temperature/top-k/top-p/min-p), from transformers' logits through the oracle.
    `allowed(prefix)`, if given, is the grammar mask (bool [vocab]) after the emitted tokens `prefix`:
    forbidden tokens get probability 0 before the other filters (a prefix the grammar rules out may
    allow nothing: it is unreachable, its row is 0). float64 [vocab] each."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size

    def dist(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
        if allowed is None:
            return target_probs_rows(logits, params)
        masks = np.stack([np.asarray(allowed(p), dtype=bool) for p in prefixes])
        dead = ~masks.any(-1)
        masks[dead] = True
        return target_probs_rows(logits, params, masks) * torch.from_numpy(~dead)[:, None]

    p1 = dist([[]])[0]
    p2_given = dist([[a] for a in range(vocab)])  # [a, b]
    p3_given = dist([[a, b] for a, b in itertools.product(range(vocab), repeat=2)]).view(vocab, vocab, vocab)
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
