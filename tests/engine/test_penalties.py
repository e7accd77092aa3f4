"""Penalties, logit bias and min_tokens are exact under speculation.

The reference is written here from the definitions (OpenAI's frequency/presence penalties over the
generated tokens, transformers'/vLLM's repetition penalty over prompt and output, logit_bias added,
EOS banned before min_tokens) in float64 over transformers' logits — never specserve's penalties.py:
greedy plain and greedy speculative output must both equal it, and sampled speculative output (many
seeds, trees whose rows each carry their own path's counts) must follow the penalised distribution by a
chi-square test of its 2nd and 3rd tokens.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import scripted_drafter  # noqa: F401  (registers "scripted")
from sampling_oracle import target_probs
from specserve import LLM, SamplingParams
from penalty_reference import greedy_reference, penalise
from target_stats import SAMPLED_MAX_TOKENS, chi_square_p_value

PROMPTS = ["def add(a, b):", "import os\nimport os\n", "x = [1, 2, 3]\nfor"]
MAX_TOKENS = 24
PENALTIES = dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3)


@pytest.mark.parametrize("drafter", [None, "scripted"])
def test_penalised_greedy_equals_reference_plain_and_speculative(llama_dir, drafter):
    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    plain_llm = LLM(llama_dir, drafter=None, device="cpu")
    plain = plain_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    banned = plain[0].token_ids[2]  # a token greedy decoding emits: the bias must bite
    eos = tuple(sorted(plain_llm.engine.eos_token_ids))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={banned: -100.0},
                            **PENALTIES)
    prompts = [plain_llm.encode(p) for p in PROMPTS]
    expected = [greedy_reference(hf, p, params, eos, MAX_TOKENS) for p in prompts]
    # The scripted drafter proposes trees mixing the penalised reference's own tokens (accepted: the rows
    # below them carry those tokens' counts) with wrong ones (rejected).
    llm = plain_llm if drafter is None else LLM(
        llama_dir, drafter="scripted", device="cpu", speculation="static",
        drafter_options={"mode": "mixed", "seed": 3, "references": [p + e for p, e in zip(prompts, expected)]})
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert all(banned not in o.token_ids for o in outs)
    assert expected != [o.token_ids for o in plain]  # the penalties changed the output
    if drafter is not None:
        assert sum(sum(o.spec.accepted_per_position) for o in outs) > MAX_TOKENS  # drafts were accepted, deep


def test_min_tokens_bans_eos_until_reached(llama_dir):
    llm = LLM(llama_dir, drafter="ngram", device="cpu", speculation="static")
    eos = tuple(sorted(llm.engine.eos_token_ids))
    # Bias EOS up so the model wants to end at once: min_tokens must hold it off, and no longer.
    bias = {t: 100.0 for t in eos}
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=40, min_tokens=5, logit_bias=bias))[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] in eos and out.finish_reason == "stop"


def test_bad_values_name_the_field(llama_dir):
    for kwargs, field in [(dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
                          (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
                          (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={1: 101}), "logit_bias"),
                          (dict(logprobs=21), "logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    llm = LLM(llama_dir, drafter=None, device="cpu")
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}, max_tokens=2))


# ---- sampled: chi-square on trees ------------------------------------------------------------------

PROMPT = [3, 1, 4, 1, 5]
N = 1500


def exact_penalised_joint(model_dir, params: SamplingParams) -> torch.Tensor:
    """P(2nd token, 3rd token) [V, V] of penalised sampling after PROMPT: each prefix's logits from
    transformers, penalised by that prefix's own counts, then temperature/top-k/top-p/min-p by the oracle.
    The joint, not the marginals: a row that missed its own path's counts shows where the 3rd token
    repeats the 2nd, which the 3rd token's marginal averages away."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size

    def dist(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].double().numpy()
        return torch.from_numpy(np.stack([
            target_probs(penalise(row, PROMPT, p, params), params.temperature, params.top_k, params.top_p, params.min_p)
            for row, p in zip(logits, prefixes)]))

    p1 = dist([[]])[0]
    p2 = dist([[a] for a in range(vocab)])
    p3 = dist([[a, b] for a, b in itertools.product(range(vocab), repeat=2)]).view(vocab, vocab, vocab)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


@pytest.mark.parametrize("mode,with_probs", [("random", False), ("wide_fan", True)])
def test_penalised_sampling_on_trees_follows_the_penalised_target(small_vocab_dir, mode, with_probs):
    params = _penalised_sampling_params()
    reference = LLM(small_vocab_dir, device="cpu").generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    llm = LLM(small_vocab_dir, drafter="scripted", device="cpu", max_num_seqs=N, max_prefill_tokens=N * len(PROMPT),
              speculation="static", drafter_options={"mode": mode, "seed": 7, "references": [PROMPT + reference[0].token_ids],
                                                     "max_budget": 6, "with_probs": with_probs})
    outs = llm.generate([PROMPT] * N, params)
    _assert_pairs_follow_the_penalised_target(outs, small_vocab_dir, params[0])


def _penalised_sampling_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, temperature=1.0, top_p=0.95,
                           frequency_penalty=1.0, presence_penalty=1.0, repetition_penalty=1.2, logit_bias={2: 6.0, 11: 5.0})
            for seed in range(N)]


def _assert_pairs_follow_the_penalised_target(outs, model_dir, params: SamplingParams) -> None:
    exact = exact_penalised_joint(model_dir, params).flatten()  # [V * V]: (2nd, 3rd) pairs
    vocab = int(round(exact.numel() ** 0.5))
    pairs = torch.tensor([o.token_ids[1] * vocab + o.token_ids[2] for o in outs])
    counts = torch.bincount(pairs, minlength=exact.numel()).double()
    assert float(counts[exact == 0].sum()) == 0, "emitted a pair the penalised target gives zero probability"
    p_value = chi_square_p_value(counts, exact)
    assert p_value > 1e-3, f"(2nd, 3rd) tokens: chi-square p-value {p_value:.2e}"
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > N // 10  # the trees were really used


def test_penalised_sampling_with_a_draft_model_drafting_penalised_follows_the_penalised_target(small_vocab_dir,
                                                                                               near_draft_dir):
    """The draft model applies the penalties to its own logits before drawing (q is the adjusted draft
    distribution): the output still has the penalised target's distribution."""
    llm = LLM(small_vocab_dir, drafter=f"draft:{near_draft_dir}", device="cpu", max_num_seqs=N,
              max_prefill_tokens=N * len(PROMPT), speculation="static")
    outs = llm.generate([PROMPT] * N, _penalised_sampling_params())
    _assert_pairs_follow_the_penalised_target(outs, small_vocab_dir, _penalised_sampling_params()[0])


def test_draft_side_penalties_equal_the_verify_side_along_each_path():
    """A drafter's row after the root + a path, adjusted by the rule (`PenaltyRule.adjust`), equals the
    verify row of the node at the end of that path (`process_logits`): drafts follow the penalised
    distribution they are verified against."""
    from specserve.penalties import PenaltyRule
    from specserve.verify import DraftTree

    vocab, rng = 50, np.random.default_rng(0)
    checked = 0
    for _ in range(120):
        params = SamplingParams(temperature=0, frequency_penalty=float(rng.choice([0, 0.5, 1.3])),
                                presence_penalty=float(rng.choice([0, 0.4])),
                                repetition_penalty=float(rng.choice([1, 1.2, 0.8])),
                                logit_bias={int(rng.integers(vocab)): float(rng.uniform(-5, 5))} if rng.random() < 0.5 else None,
                                min_tokens=int(rng.integers(0, 5)))
        if not params.penalized:
            continue
        rule = PenaltyRule(params, rng.integers(0, vocab, size=7), vocab, (3,))
        for token in rng.integers(0, vocab, size=int(rng.integers(0, 4))):
            rule.accept_token(int(token))
        chain = rng.integers(0, vocab, size=3).tolist()
        raw = rng.normal(size=(4, vocab)).astype(np.float32)
        verified = torch.from_numpy(raw.copy())
        rule.process_logits(verified, DraftTree.chain(chain))
        for depth in range(4):
            row = raw[depth].copy()
            rule.draft_logits().adjust(row, chain[:depth], np.arange(vocab))  # the identity column map
            np.testing.assert_allclose(row, verified[depth].numpy(), atol=1e-6)
            # A reduced draft vocabulary (EAGLE-3's): 20 target ids in shuffled columns, the rest absent.
            subset = rng.choice(vocab, 20, replace=False)
            columns = np.full(vocab, -1, dtype=np.int64)
            columns[subset] = np.arange(20)
            row = raw[depth][subset].copy()
            rule.draft_logits().adjust(row, chain[:depth], columns)
            np.testing.assert_allclose(row, verified[depth].numpy()[subset], atol=1e-6)
            checked += 1
    assert checked > 200


def test_a_draft_model_drafts_what_the_bias_favours(small_vocab_dir, near_draft_dir):
    """With logit_bias +100 on a token the penalised target emits only it; the draft model, adjusted the same
    way, drafts it too, so nearly every draft is accepted (unadjusted drafts would follow the draft model's
    own argmax and be rejected). Greedy output equals plain decoding's under the same bias."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={5: 100.0},
                            frequency_penalty=0.2)
    plain = LLM(small_vocab_dir, drafter=None, device="cpu").generate([PROMPT], params)[0]
    llm = LLM(small_vocab_dir, drafter=f"draft:{near_draft_dir}", device="cpu", speculation="static")
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids == plain.token_ids == [5] * 16
    assert out.spec.mean_accepted_length > 3
