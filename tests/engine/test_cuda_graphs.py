"""CUDA-graph buckets: bucket choice, padding, the static buffer and output slicing.

Without CUDA, `GraphedForward(capture=False)` runs the padded forward eagerly from the same static buffer
a graph would read (Triton's interpreter), so everything around `torch.cuda.graph` is checked in CI; on a
CUDA machine the same tests run on the GPU with real captures (and tests/engine/test_gpu.py adds more).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import scripted_drafter  # noqa: F401  (registers "scripted")
from random_step_batches import random_batch
from specserve import LLM, SamplingParams
from specserve.cuda_graphs import (GraphBucket, GraphedForward, choose_bucket, cuda_kv_budget, dummy_batch,
                                   make_buckets, pad_to_bucket)
from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel
from specserve.step_batch import StepBatchBuilder

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# The triton backend runs on CUDA tensors, or on CPU ones only under Triton's interpreter (conftest.py
# turns it on where there is no CUDA): on a GPU machine these tests must use the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# cuBLAS chooses its float32 kernel by row count, so a padded batch's products may sum in another order
# than the unpadded one's: bitwise on the interpreter, a few ulps apart on a GPU.
TOL = 1e-4 if DEVICE == "cuda" else 1e-5


def _batch(allocator, seqs):
    """seqs: [(cached, new rows, tree?)] -> a StepBatch with logits at every row."""
    builder = StepBatchBuilder(allocator)
    for i, (cached, n, tree) in enumerate(seqs):
        allocator.allocate(f"s{i}", cached + n)
        mask = np.tril(np.ones((n, n), dtype=bool)) if tree else None
        builder.add(f"s{i}", cached, np.arange(n) % 7, None, mask, logits="all")
    return builder.build()


def test_make_buckets_covers_the_limits():
    buckets = make_buckets(max_num_seqs=6, max_query_len=9)
    assert GraphBucket(6, 9) in buckets and GraphBucket(1, 1) in buckets
    assert all(b.num_seqs <= 6 and b.query_len <= 9 for b in buckets)
    assert {b.num_seqs for b in buckets} == {1, 2, 4, 6} and {b.query_len for b in buckets} == {1, 2, 4, 8, 9}


def test_choose_bucket_takes_the_smallest_that_fits_and_refuses_what_none_holds():
    buckets = make_buckets(8, 16)
    alloc = BlockAllocator(64, 4)
    assert choose_bucket(buckets, _batch(alloc, [(5, 1, False)]), 32) == GraphBucket(1, 1)
    alloc = BlockAllocator(64, 4)
    assert choose_bucket(buckets, _batch(alloc, [(5, 1, False), (3, 5, True), (0, 1, False)]), 32) == GraphBucket(4, 8)
    alloc = BlockAllocator(64, 4)
    assert choose_bucket(buckets, _batch(alloc, [(5, 17, True)]), 32) is None  # more rows than any bucket
    alloc = BlockAllocator(64, 4)
    assert choose_bucket(buckets, _batch(alloc, [(40, 1, False)]), 8) is None  # block table wider than the graphs'
    alloc = BlockAllocator(64, 4)
    alloc.allocate("t", 10)
    builder = StepBatchBuilder(alloc)  # a drafter level whose mask reaches into 2 cached entries
    builder.add("t", 6, np.array([1, 2]), np.array([6, 6]), np.ones((2, 4), dtype=bool))
    assert choose_bucket(buckets, builder.build(), 32) is None


def test_padding_keeps_every_array_at_the_buckets_size():
    bucket, max_blocks = GraphBucket(4, 8), 10
    rng = np.random.default_rng(0)
    sizes = set()
    for seed in range(5):
        alloc = BlockAllocator(64, 4)
        seqs = [(int(rng.integers(0, 20)), int(rng.integers(1, 9)), bool(rng.integers(0, 2))) for _ in range(rng.integers(1, 5))]
        padded = pad_to_bucket(_batch(alloc, seqs), bucket, max_blocks, hidden=True)
        sizes.add(padded.flat_arrays().size)
        assert padded.max_query_len == 8 and padded.num_seqs == 4
    dummy = dummy_batch(bucket, max_blocks, 4, hidden=True)
    assert sizes == {dummy.flat_arrays().size}


@pytest.mark.parametrize("attention", ["triton"])
def test_padded_forward_equals_the_unpadded_one_on_random_batches(attention, llama_dir):
    """Real rows' logits and the K/V they write are the same whether or not the batch is padded to a
    bucket; padding rows write no K/V anywhere."""
    model = LlamaModel.from_pretrained(llama_dir, torch.device(DEVICE), torch.float32, attention=attention,
                                       cpu_kernels=False)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        allocator = BlockAllocator(96 // 4 * 6, 4)
        batch = random_batch(rng, allocator, 3)  # a prompt chunk, a decode token, a verify tree (no tail masks)
        batch = dataclasses.replace(batch, logit_rows=np.arange(batch.num_tokens, dtype=np.int64),
                                    hidden_rows=np.arange(batch.num_tokens, dtype=np.int64))
        assert choose_bucket([GraphBucket(6, 8)], batch, 32) == GraphBucket(6, 8)
        caches = [model.new_cache(allocator) for _ in range(2)]
        gen = torch.Generator().manual_seed(seed)
        for part in ("k", "v"):
            values = torch.randn(getattr(caches[0], part).shape, generator=gen)
            for cache in caches:
                getattr(cache, part).copy_(values)
        plain = model.eager_forward(batch, caches[0], (1,))
        padded = pad_to_bucket(batch, GraphBucket(6, 8), 32, hidden=True)
        out = model.eager_forward(padded, caches[1], (1,))
        n = batch.num_tokens
        torch.testing.assert_close(out.logits[:n], plain.logits, atol=TOL, rtol=TOL)
        torch.testing.assert_close(out.hidden_states[1][:n], plain.hidden_states[1], atol=TOL, rtol=TOL)
        torch.testing.assert_close(caches[1].k, caches[0].k, atol=TOL, rtol=TOL)  # padding wrote nothing


def test_engine_with_graph_buckets_is_lossless_and_serves_steps_from_buckets(small_vocab_dir):
    plain = LLM(small_vocab_dir, device=DEVICE, attention="triton", drafter=None, dtype="float32", cuda_graphs=False)
    reference = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    refs = [p + r for p, r in zip(PROMPTS, reference)]
    llm = LLM(small_vocab_dir, device=DEVICE, attention="triton", dtype="float32", speculation="static", cuda_graphs=True,
              drafter="scripted", drafter_options={"mode": "mixed", "references": refs, "max_budget": 8})
    graphs = llm.model.graphs
    assert isinstance(graphs, GraphedForward) and graphs.capture == (DEVICE == "cuda")  # no CUDA: eager replays
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert graphs.replays > 10  # decode/verify steps came from buckets (prefills ran eagerly)


def test_graphs_need_the_triton_backend(small_vocab_dir):
    with pytest.raises(ValueError, match="triton"):
        LLM(small_vocab_dir, device="cpu", attention="sdpa", drafter=None, cuda_graphs=True)


def test_kv_budget_counts_the_reserve_before_the_cache():
    gib = 1 << 30
    # 80 GiB device, 16 GiB of weights loaded (64 free), 90 %: 72 - 16 - 3 reserve = 53 GiB for the cache.
    assert cuda_kv_budget(64 * gib, 80 * gib, 0.9, 3 * gib) == 72 * gib - 16 * gib - 3 * gib
    assert cuda_kv_budget(1 * gib, 80 * gib, 0.9, 3 * gib) == 0
