"""Sampled speculative output has the target's distribution, end to end through the engine.

Many requests with different seeds run as one batch (batched verification). The 2nd and 3rd emitted
tokens come from verify steps (the 1st from prefill); their empirical marginals are compared with the
exact target marginals — computed from transformers' logits through the independent temperature/top-k/
top-p/min-p oracle (tests/sampling_oracle.py, not the engine's logits_to_probs) — by a chi-square test at
a fixed seed (tests/verify/test_sampling_oracle.py shows the test rejects an off-by-one filter).
"""

from __future__ import annotations

import pytest
import torch

import scripted_drafter  # noqa: F401
from adaptive_policy import cutting_policy, install
from specserve import LLM, SamplingParams
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target

PROMPT = [3, 1, 4, 1, 5]
N = 1500

CASES = {
    "chain-one-hot": dict(mode="deep_chain", with_probs=False, params=dict(temperature=1.0)),
    "tree-one-hot-topk": dict(mode="random", with_probs=False, params=dict(temperature=0.8, top_k=6)),
    "tree-with-q-topp-minp": dict(mode="wide_fan", with_probs=True, params=dict(temperature=1.2, top_p=0.9, min_p=0.02)),
    "chain-with-q": dict(mode="deep_chain", with_probs=True, params=dict(temperature=1.0)),
}


@pytest.mark.parametrize("policy", ["static", "adaptive"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_tokens_follow_target_distribution(small_vocab_dir, case, policy):
    """static: every tree verified whole; adaptive: the policy cuts trees (synthetic costs) and decides
    who drafts from what earlier steps accepted — the distribution must not move either way."""
    spec = CASES[case]
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, **spec["params"]) for seed in range(N)]
    # Trees are drawn near the target's own greedy path so drafts are accepted often and deep.
    reference = LLM(small_vocab_dir, device="cpu").generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    references = [PROMPT + reference[0].token_ids]
    # All prompts in one prefill step: the adaptive policy plans decode-only steps (not prefill steps).
    llm = LLM(small_vocab_dir, drafter="scripted", device="cpu", max_num_seqs=N, max_prefill_tokens=N * len(PROMPT),
              drafter_options={
        "mode": spec["mode"], "seed": 7, "references": references, "max_budget": 6, "with_probs": spec["with_probs"]},
        speculation="static")
    if policy == "adaptive":
        install(llm, cutting_policy(max_budget=6, max_depth=6, row_cost=0.02, batch=N))
    outs = llm.generate([PROMPT] * N, params)
    assert_follows_target(outs, small_vocab_dir, PROMPT, params[0])
    # The drafts were actually used: some steps accepted draft tokens.
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > N // 10


def test_same_seed_reproduces_output(llama_dir):
    llm = LLM(llama_dir, drafter="ngram", device="cpu", speculation="static")
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    a = llm.generate(["def f(x):", "class A:"], params)
    b = llm.generate(["class A:", "def f(x):"], params)  # different batch position
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids


def test_plain_sampled_decoding_follows_target_distribution(small_vocab_dir):
    """No drafter: every step verifies empty trees, drawn without packing them (`Verifier`'s plain path)."""
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, temperature=0.8, top_k=6)
              for seed in range(N)]
    llm = LLM(small_vocab_dir, drafter=None, device="cpu", max_num_seqs=N, max_prefill_tokens=N * len(PROMPT))
    outs = llm.generate([PROMPT] * N, params)
    assert_follows_target(outs, small_vocab_dir, PROMPT, params[0])


def test_a_plain_requests_draws_do_not_depend_on_what_its_batch_mates_verify(small_vocab_dir):
    """A seeded sampled request decoding plainly draws the same tokens in steps where nobody verifies a tree
    (the plain path) as beside a request verifying trees every step (the general acceptance path)."""
    params = SamplingParams(max_tokens=16, seed=5, temperature=1.0, ignore_eos=True)
    alone = LLM(small_vocab_dir, drafter=None, device="cpu").generate([PROMPT], params)[0].token_ids
    llm = LLM(small_vocab_dir, drafter="scripted", drafter_options={"mode": "deep_chain", "max_budget": 4},
              speculation="static", device="cpu")
    plain = llm.engine.add_request(PROMPT, params, speculate=False)
    mate = llm.engine.add_request([2, 7, 1], SamplingParams(max_tokens=16, seed=9, temperature=1.0, ignore_eos=True))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert mate.stats.num_drafted > 0 and plain.stats.num_drafted == 0
    assert plain.output_ids == alone

