"""Greedy speculative output == plain greedy output, token for token, for any draft tree.

Trees come from hypothesis-chosen recipes (random, adversarial, all-wrong, all-right, deep chains,
wide fans), at batch 1 and batch > 1, through the real engine and model.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scripted_drafter  # noqa: F401  (registers "scripted")
from adaptive_policy import cutting_policy, install
from scripted_drafter import MODES
from specserve import LLM, SamplingParams

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    plain = LLM(small_vocab_dir, device="cpu")
    outs = plain.generate(PROMPTS, GREEDY)
    return [p + o.token_ids for p, o in zip(PROMPTS, outs)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**31 - 1),
    budget=st.integers(1, 12),
    batch=st.sampled_from([1, 2, 4]),
    with_probs=st.booleans(),
    policy=st.sampled_from(["static", "adaptive"]),
    row_cost=st.sampled_from([0.05, 0.3, 0.9]),
)
def test_speculative_greedy_equals_plain(small_vocab_dir, reference, mode, seed, budget, batch, with_probs, policy,
                                         row_cost):
    llm = LLM(small_vocab_dir, drafter="scripted", device="cpu",
              drafter_options={"mode": mode, "seed": seed, "references": reference, "max_budget": budget, "with_probs": with_probs}, speculation="static")
    if policy == "adaptive":  # trees cut by the adaptive policy (synthetic costs: cheap to dear rows)
        install(llm, cutting_policy(max_budget=budget, max_depth=budget, row_cost=row_cost))
    prompts = PROMPTS[:batch]
    outs = llm.generate(prompts, GREEDY)
    for prompt, ref, out in zip(prompts, reference, outs):
        assert out.token_ids == ref[len(prompt):], (mode, seed, budget)
        assert out.finish_reason == "length"
        assert 1.0 <= out.spec.mean_accepted_length <= budget + 1
    # Nothing leaks: every block is back in the free list.
    alloc = llm.engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


def test_all_right_drafts_accept_everything(small_vocab_dir, reference):
    llm = LLM(small_vocab_dir, drafter="scripted", device="cpu",
              drafter_options={"mode": "all_right", "references": reference, "max_budget": 5}, speculation="static")
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert out.token_ids == reference[0][len(PROMPTS[0]):]
    # 30 tokens: 1 from prefill, then steps of 6 (5 drafts + bonus) until the budget is capped by max_tokens.
    assert out.spec.num_steps == 5
    assert out.spec.accepted_per_position[:5] == [5, 5, 5, 5, 4]


def test_all_wrong_drafts_accept_nothing(small_vocab_dir, reference):
    llm = LLM(small_vocab_dir, drafter="scripted", device="cpu",
              drafter_options={"mode": "all_wrong", "references": reference, "max_budget": 4}, speculation="static")
    out = llm.generate([PROMPTS[1]], GREEDY)[0]
    assert out.token_ids == reference[1][len(PROMPTS[1]):]
    assert out.spec.mean_accepted_length == 1.0
    assert sum(out.spec.accepted_per_position) == 0
    assert out.spec.num_steps == 29


def test_ngram_greedy_equals_plain_on_repetitive_prompt(llama_dir):
    prompt = "for i in range(10):\n    print(i, i * i)\n" * 3
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = LLM(llama_dir, device="cpu").generate([prompt, "def f(x):"], params)
    spec = LLM(llama_dir, drafter="ngram", device="cpu", speculation="static").generate([prompt, "def f(x):"], params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
