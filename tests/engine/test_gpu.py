"""CUDA paths (bf16): skipped on machines without a GPU; run them where one is lent."""

from __future__ import annotations

import pytest
import torch

import scripted_drafter  # noqa: F401
from specserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7]]


def test_cuda_bf16_speculative_greedy_equals_plain(small_vocab_dir):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = LLM(small_vocab_dir, device="cuda")
    assert plain.dtype == torch.bfloat16
    ref = plain.generate(PROMPTS, params)
    spec = LLM(small_vocab_dir, device="cuda", drafter="scripted", drafter_options={
        "mode": "mixed", "references": [p + o.token_ids for p, o in zip(PROMPTS, ref)], "max_budget": 8}, speculation="static")
    for a, b in zip(ref, spec.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids


def test_cuda_sampling_runs_and_frees_blocks(llama_dir):
    llm = LLM(llama_dir, device="cuda", drafter="ngram", speculation="static")
    outs = llm.generate(["def f(x):"] * 4, SamplingParams(max_tokens=16, temperature=0.8, seed=0))
    assert all(1 <= len(o.token_ids) <= 16 for o in outs)
    alloc = llm.engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks
