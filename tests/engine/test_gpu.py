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


def test_cuda_defaults_are_triton_and_graphs_and_stay_lossless(small_vocab_dir):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eager = LLM(small_vocab_dir, device="cuda", drafter=None, cuda_graphs=False)
    ref = eager.generate(PROMPTS, params)
    spec = LLM(small_vocab_dir, device="cuda", drafter="scripted", speculation="static", drafter_options={
        "mode": "mixed", "references": [p + o.token_ids for p, o in zip(PROMPTS, ref)], "max_budget": 8})
    assert spec.model.backend.name == "triton" and spec.model.graphs is not None and spec.model.graphs.capture
    for a, b in zip(ref, spec.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids
    assert spec.model.graphs.replays > 0


def test_graph_replay_equals_eager_forward_on_cuda(llama_dir):
    """One decode batch through its captured graph and eagerly: the same logits, bit for bit (same kernels,
    same shapes — a graph only replays the launches)."""
    import numpy as np

    from specserve.cuda_graphs import GraphBucket, pad_to_bucket
    from specserve.step_batch import StepBatchBuilder

    llm = LLM(llama_dir, device="cuda", drafter=None)
    graphs = llm.model.graphs
    alloc = llm.engine.cache.allocator
    alloc.allocate("g", 40)
    builder = StepBatchBuilder(alloc)
    builder.add("g", 0, np.arange(1, 31) % 50, logits="all")
    llm.model.forward(builder.build(), llm.engine.cache)  # prefill (eager: 30 rows)
    step = StepBatchBuilder(alloc)
    step.add("g", 30, np.array([7]), logits="all")
    batch = step.build()
    replayed = llm.model.forward(batch, llm.engine.cache).logits.clone()
    assert graphs.replays == 1
    eager = llm.model.eager_forward(pad_to_bucket(batch, GraphBucket(1, 1), graphs.max_blocks, False),
                                    llm.engine.cache).logits[:1]
    assert torch.equal(replayed, eager)
    alloc.free("g")
