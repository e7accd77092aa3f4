"""`LLM.warm_up` (what `specserve serve` runs before it listens): a greedy and a sampled request run through the
engine, and nothing of them is kept — the budget policy as it was, no cache block held or indexed."""

from __future__ import annotations

import pickle

import pytest

from specserve import LLM, SamplingParams


@pytest.mark.parametrize("block_size", [16, 8])
def test_warm_up_leaves_no_trace(small_vocab_dir, block_size):
    # adaptive speculation: a policy that learns
    llm = LLM(small_vocab_dir, drafter="ngram", device="cpu", block_size=block_size)
    engine = llm.engine
    before = pickle.dumps(engine.speculator.policy)
    assert llm.warm_up() > 0
    assert pickle.dumps(engine.speculator.policy) == before
    alloc = engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks and alloc.num_cached_blocks == 0
    assert not engine.requests and not engine.has_unfinished()

    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fresh = LLM(small_vocab_dir, drafter="ngram", device="cpu").generate(prompt, params)
    assert [o.token_ids for o in llm.generate(prompt, params)] == [o.token_ids for o in fresh]
    assert pickle.dumps(engine.speculator.policy) != before  # a request that is kept does teach the policy
