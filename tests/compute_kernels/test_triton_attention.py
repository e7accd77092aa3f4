"""The ``triton`` attention backend (paged tree attention + KV write) under Triton's interpreter.

Without CUDA these run with TRITON_INTERPRET=1 (tests/conftest.py sets it): the same kernel source a GPU
compiles, executed by Triton's numpy interpreter, so the indexing, masks and online softmax are checked
in CI. On a CUDA machine the same tests run the compiled kernel.

Kernel vs the float64 reference of the StepBatch semantics (random_step_batches.py) and vs the sdpa
backend, on random batches of every kind (prompt chunks, decode tokens, verify trees, drafter levels with
tail masks), GQA ratios 1-4, head_dim 16-48 (padded to a power of two inside the kernel), block sizes
2-8, sliding windows, scattered block tables; contexts longer than one key tile; prompt chunks longer
than one query tile. Tolerance: the CPU kernel's (atol 2e-5, rtol 1e-5, float32, see
test_attention_kernel.py) — the interpreter's dots are float32 numpy, on a GPU "ieee" float32 dots.
bfloat16 storage: atol 2e-2 against the reference of the same rounded values (bf16 output rounding,
2^-8 relative, of O(1) outputs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from random_step_batches import CONFIGS, random_batch, reference
from specserve.attention import make_backend
from specserve.attention.sdpa import SdpaBackend
from specserve.kv_cache import BlockAllocator, PagedKVCache
from specserve.step_batch import StepBatchBuilder

ATOL, RTOL = 2e-5, 1e-5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _fill(batch, allocator, heads, kv_heads, head_dim, seed, dtype=torch.float32):
    cache = PagedKVCache(allocator, 1, kv_heads, head_dim, DEVICE, dtype)
    gen = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return cache, q, k, v


def _check(batch, cache, q, k, v, window, where, block_n=64, atol=ATOL, rtol=RTOL):
    """Run the triton backend; compare with the float64 reference (and sdpa in float32)."""
    k_ref, v_ref = cache.k[0].float().cpu().numpy().copy(), cache.v[0].float().cpu().numpy().copy()
    k_ref[batch.slot_mapping], v_ref[batch.slot_mapping] = k.float().cpu().numpy(), v.float().cpu().numpy()
    ref = torch.from_numpy(reference(batch, q.float().cpu().numpy(), k_ref, v_ref, window))
    triton_backend = make_backend("triton", DEVICE, window)
    triton_backend.block_n = block_n
    if cache.k.dtype == torch.float32:
        sdpa_cache = PagedKVCache(cache.allocator, 1, k.shape[1], k.shape[2], DEVICE, torch.float32)
        sdpa_cache.k.copy_(cache.k)
        sdpa_cache.v.copy_(cache.v)
        sdpa = SdpaBackend(sliding_window=window)
        sdpa_out = sdpa.attend(0, q, k, v, sdpa.prepare(batch, sdpa_cache), sdpa_cache).view(q.shape)
    out = triton_backend.attend(0, q, k, v, triton_backend.prepare(batch, cache), cache).view(q.shape)
    # The KV write: this step's K/V sit at their slots, as the reference assumed.
    slots = torch.from_numpy(batch.slot_mapping).to(DEVICE)
    torch.testing.assert_close(cache.k[0][slots], k.to(cache.k.dtype), atol=0, rtol=0)
    torch.testing.assert_close(cache.v[0][slots], v.to(cache.v.dtype), atol=0, rtol=0)
    torch.testing.assert_close(out.double().cpu(), ref, atol=atol, rtol=rtol,
                               msg=lambda m: f"{where}: triton vs float64: {m}")
    if cache.k.dtype == torch.float32:
        torch.testing.assert_close(out, sdpa_out, atol=atol, rtol=rtol, msg=lambda m: f"{where}: triton vs sdpa: {m}")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_triton_kernel_matches_the_float64_reference_and_sdpa_on_random_step_batches(config):
    heads, kv_heads, head_dim, window, block_size = CONFIGS[config]
    for seed in range(3):
        rng = np.random.default_rng(seed)
        allocator = BlockAllocator(96 // block_size * 6, block_size)
        batch = random_batch(rng, allocator, 6)
        cache, q, k, v = _fill(batch, allocator, heads, kv_heads, head_dim, seed)
        _check(batch, cache, q, k, v, window, f"{config} seed={seed}")


@pytest.mark.parametrize("config", ["gqa2-hd16-bs4", "gqa4-hd16-window6-bs8"])
def test_contexts_longer_than_a_key_tile_and_chunks_longer_than_a_query_tile(config):
    """Contexts up to ~100 keys over 16-key tiles (many tile iterations, tiles crossing block boundaries)
    and a 70-row prompt chunk (several query tiles, each stopping at its own causal edge)."""
    heads, kv_heads, head_dim, window, block_size = CONFIGS[config]
    rng = np.random.default_rng(7)
    allocator = BlockAllocator(200 // block_size * 8, block_size)
    batch = random_batch(rng, allocator, 5, max_cached=90)
    builder = StepBatchBuilder(allocator)
    for b in range(batch.num_seqs):  # the random sequences again, plus a long chunk after 20 cached
        lo, hi = int(batch.cu_query_lens[b]), int(batch.cu_query_lens[b + 1])
        offset, width = int(batch.mask_offsets[b]), int(batch.mask_widths[b])
        mask = batch.tree_mask[offset:offset + (hi - lo) * width].reshape(hi - lo, width) if offset >= 0 else None
        builder.add(f"s{b}", int(batch.context_lens[b]) - (hi - lo), batch.input_ids[lo:hi], batch.positions[lo:hi], mask)
    allocator.allocate("long", 90)
    builder.add("long", 20, rng.integers(0, 50, 70))
    batch = builder.build()
    cache, q, k, v = _fill(batch, allocator, heads, kv_heads, head_dim, seed=3)
    _check(batch, cache, q, k, v, window, config, block_n=16)


def test_bfloat16_storage_matches_the_reference_of_the_rounded_values():
    heads, kv_heads, head_dim, window, block_size = CONFIGS["gqa2-hd16-bs4"]
    rng = np.random.default_rng(5)
    allocator = BlockAllocator(96 // block_size * 6, block_size)
    batch = random_batch(rng, allocator, 6)
    cache, q, k, v = _fill(batch, allocator, heads, kv_heads, head_dim, 5, dtype=torch.bfloat16)
    _check(batch, cache, q, k, v, window, "bf16", atol=2e-2, rtol=2e-2)


def test_padding_rows_with_a_negative_slot_write_nothing():
    """CUDA-graph buckets pad a batch with rows whose slot is -1: their K/V must not land anywhere."""
    allocator = BlockAllocator(8, 4)
    allocator.allocate("a", 6)
    builder = StepBatchBuilder(allocator)
    builder.add("a", 3, np.array([1, 2, 3]))
    batch = builder.build()
    import dataclasses

    padded = dataclasses.replace(batch, slot_mapping=np.array([batch.slot_mapping[0], -1, batch.slot_mapping[2]]))
    cache, q, k, v = _fill(padded, allocator, 2, 1, 16, 0)
    before = cache.k[0].clone()
    backend = make_backend("triton", DEVICE)
    backend.attend(0, q, k, v, backend.prepare(padded, cache), cache)
    changed = (cache.k[0] != before).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == sorted([int(batch.slot_mapping[0]), int(batch.slot_mapping[2])])


def test_triton_backend_off_cuda_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_backend("triton", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        make_backend("flash", "cpu")
