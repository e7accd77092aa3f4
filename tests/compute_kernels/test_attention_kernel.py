"""The paged tree-attention kernel against the sdpa backend and a float64 reference, on random StepBatches.

Batches mix several sequences of every kind the engine builds — prompt chunks (causal), single decode
tokens, verify trees (ancestor masks, positions committed_len + depth) and drafter levels with "tail"
masks over cached entries — with GQA or not, head_dim 16..48, block sizes 2..8 (smaller than the
contexts, block tables scattered over the pool), with and without a sliding window.

The reference computes each row in float64 from the StepBatch semantics (step_batch.py): a key before
the mask's columns is visible; the last `width` keys follow the mask (causal among the new tokens when
there is none); the sliding window hides keys `window` or more positions back (a cached key j sits at
position j, a new token at its own position).

Tolerance: atol 2e-5, rtol 1e-5 for the kernel and for sdpa against the float64 reference and against
each other. Values are O(1) (scores ~ N(0, 1)); a row sums at most ~40 keys, so float32 rounding of the
dot products, exponentials and the weighted sum stays below ~40 * 2^-24 * max|v| ~ 1e-5.

The same random batches then run through whole models — kernels vs the torch layers — with rotary
(default, linear, llama3), GQA, biases and sliding windows (atol/rtol 1e-4 on logits and written K/V).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from random_step_batches import CONFIGS, random_batch, reference
from specserve.attention.sdpa import SdpaBackend
from specserve.kernels.attention import paged_attention, visible_keys
from specserve.kernels.threads import get_threads
from specserve.kv_cache import BlockAllocator, PagedKVCache

ATOL, RTOL = 2e-5, 1e-5


def run_kernel(batch, q, k_cache, v_cache, window) -> np.ndarray:
    out = np.full(q.shape, np.nan, dtype=np.float32)
    paged_attention(q, k_cache, v_cache, *visible_keys(batch, window or 0), np.float32(1.0 / math.sqrt(q.shape[2])), out,
                    get_threads())
    return out


def _setup(config: str, seed: int, num_seqs: int = 6):
    heads, kv_heads, head_dim, window, block_size = CONFIGS[config]
    rng = np.random.default_rng(seed)
    allocator = BlockAllocator(96 // block_size * num_seqs, block_size)
    batch = random_batch(rng, allocator, num_seqs)
    cache = PagedKVCache(allocator, 1, kv_heads, head_dim, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen)
    return batch, cache, q, k, v, window


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_kernel_matches_sdpa_and_float64_reference_on_random_step_batches(config):
    for seed in range(6):
        batch, cache, q, k, v, window = _setup(config, seed)
        # The kernel reads the cache with this step's K/V already written (decoder_layer writes them first).
        k_cache, v_cache = cache.k[0].numpy().copy(), cache.v[0].numpy().copy()
        k_cache[batch.slot_mapping], v_cache[batch.slot_mapping] = k.numpy(), v.numpy()
        kernel = run_kernel(batch, q.numpy(), k_cache, v_cache, window)
        sdpa_backend = SdpaBackend(sliding_window=window)
        sdpa = sdpa_backend.attend(0, q, k, v, sdpa_backend.prepare(batch, cache), cache).view(q.shape)
        ref = torch.from_numpy(reference(batch, q.numpy(), k_cache, v_cache, window))
        where = f"{config} seed={seed}"
        torch.testing.assert_close(torch.from_numpy(kernel).double(), ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: kernel vs float64: {m}")
        torch.testing.assert_close(sdpa.double(), ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: sdpa vs float64: {m}")
        torch.testing.assert_close(torch.from_numpy(kernel), sdpa, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: kernel vs sdpa: {m}")


@pytest.mark.parametrize("config", ["gqa3-hd32-bs2", "gqa4-hd16-window6-bs8"])
def test_kernel_rows_do_not_depend_on_the_batch_or_thread_count(config, use_threads):
    batch, cache, q, k, v, window = _setup(config, seed=11, num_seqs=8)
    k_cache, v_cache = cache.k[0].numpy().copy(), cache.v[0].numpy().copy()
    k_cache[batch.slot_mapping], v_cache[batch.slot_mapping] = k.numpy(), v.numpy()
    results = []
    for threads in (1, 2):
        use_threads(threads)
        together = run_kernel(batch, q.numpy(), k_cache, v_cache, window)
        for b in range(batch.num_seqs):
            rows = slice(int(batch.cu_query_lens[b]), int(batch.cu_query_lens[b + 1]))
            alone = _only(batch, b)
            out = run_kernel(alone, np.ascontiguousarray(q.numpy()[rows]), k_cache, v_cache, window)
            np.testing.assert_array_equal(out.view(np.uint32), together[rows].view(np.uint32))
        results.append(together)
    np.testing.assert_array_equal(results[0].view(np.uint32), results[1].view(np.uint32))


def _only(batch, b: int):
    """The StepBatch of sequence b alone (same cache slots, same mask)."""
    from specserve.step_batch import StepBatch

    lo, hi = int(batch.cu_query_lens[b]), int(batch.cu_query_lens[b + 1])
    offset, width = int(batch.mask_offsets[b]), int(batch.mask_widths[b])
    mask = batch.tree_mask[offset:offset + (hi - lo) * width] if offset >= 0 else np.zeros(0, dtype=np.bool_)
    return StepBatch(
        input_ids=batch.input_ids[lo:hi], positions=batch.positions[lo:hi], slot_mapping=batch.slot_mapping[lo:hi],
        token_seq=np.zeros(hi - lo, dtype=np.int32), cu_query_lens=np.array([0, hi - lo], dtype=np.int32),
        context_lens=batch.context_lens[b:b + 1], block_tables=batch.block_tables[b:b + 1],
        mask_offsets=np.array([0 if offset >= 0 else -1], dtype=np.int64), mask_widths=batch.mask_widths[b:b + 1],
        tree_mask=mask, logit_rows=np.zeros(0, dtype=np.int64), hidden_rows=np.zeros(0, dtype=np.int64),
        block_size=batch.block_size)


# ---- the whole decoder layer: kernels vs the torch layer ----------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
MODELS = {  # arch, build_model keyword arguments: GQA ratios, head_dim 16/32, biases, RoPE variants, windows
    "llama-gqa2-hd16-llama3-rope": ("llama", dict(hidden_size=64, heads=4, kv_heads=2, rope_scaling=LLAMA3_ROPE)),
    "llama-gqa3-hd32-bias": ("llama", dict(hidden_size=96, heads=3, kv_heads=1, attention_bias=True, mlp_bias=True)),
    "mistral-window5-hd16": ("mistral", dict(hidden_size=64, heads=4, kv_heads=2, sliding_window=5)),
    "qwen2-hd32-linear-rope": ("qwen2", dict(hidden_size=64, heads=2, kv_heads=1,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3-hd32-qk-norm-yarn-rope": ("qwen3", dict(hidden_size=64, heads=4, kv_heads=2, head_dim=32, max_positions=64,
                                                   rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 16})),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_kernels_match_the_torch_layers_on_random_step_batches(name, tmp_path):
    """Whole forwards (norms, QKV, rotary at each token's position, KV writes, paged tree attention, MLP,
    LM head) on the kernels vs the torch layers with the sdpa backend, over the same random StepBatches
    and the same cache contents. Tolerance: atol 1e-4, rtol 1e-4 on logits and written K/V (the model
    parity tests' fp32 tolerance against transformers)."""
    from specserve.model import LlamaModel
    from tiny_models import build_model

    arch, extra = MODELS[name]
    path = build_model(tmp_path, arch, vocab_size=61, tokenizer=False, init_std=0.2, layers=2, **extra)
    kernels = LlamaModel.from_pretrained(path, torch.device("cpu"), torch.float32, cpu_kernels=True)
    layers = LlamaModel.from_pretrained(path, torch.device("cpu"), torch.float32, cpu_kernels=False)
    assert kernels.kernels is not None and layers.kernels is None
    cfg = kernels.config
    for seed in range(4):
        rng = np.random.default_rng(100 + seed)
        block_size = int(rng.choice([2, 4, 8]))
        allocator = BlockAllocator(96 // block_size * 6, block_size)
        batch = random_batch(rng, allocator, 6)
        batch = _with_logits_everywhere(batch)
        caches = [kernels.new_cache(allocator), layers.new_cache(allocator)]
        gen = torch.Generator().manual_seed(seed)
        for part in ("k", "v"):
            values = torch.randn(getattr(caches[0], part).shape, generator=gen)
            for cache in caches:
                getattr(cache, part).copy_(values)
        out_k = kernels.forward(batch, caches[0]).logits
        out_t = layers.forward(batch, caches[1]).logits
        assert out_k.shape == (batch.num_tokens, cfg.vocab_size)
        where = f"{name} seed={seed} block={block_size}"
        torch.testing.assert_close(out_k, out_t, atol=1e-4, rtol=1e-4, msg=lambda m: f"{where}: logits: {m}")
        slots = torch.from_numpy(batch.slot_mapping)
        for part in ("k", "v"):
            torch.testing.assert_close(getattr(caches[0], part)[:, slots], getattr(caches[1], part)[:, slots],
                                       atol=1e-4, rtol=1e-4, msg=lambda m: f"{where}: written {part}: {m}")


def _with_logits_everywhere(batch):
    """The same StepBatch, returning logits at every row."""
    import dataclasses

    return dataclasses.replace(batch, logit_rows=np.arange(batch.num_tokens, dtype=np.int64))


def test_sixteen_sums_at_once_equal_each_sum_alone_bit_for_bit():
    """`simd.vsum16` (four keys' scores of four pairs at once) against `simd.vsum` of each input: the scores must not
    depend on how many keys and pairs were summed together."""
    import numba

    from specserve.kernels.simd import vload, vstore, vsum, vsum16

    @numba.njit
    def sums(x, out):
        vstore(out, 0, vsum16(vload(x, 0), vload(x, 16), vload(x, 32), vload(x, 48), vload(x, 64), vload(x, 80),
                              vload(x, 96), vload(x, 112), vload(x, 128), vload(x, 144), vload(x, 160), vload(x, 176),
                              vload(x, 192), vload(x, 208), vload(x, 224), vload(x, 240)))
        for i in range(16):
            out[16 + i] = vsum(vload(x, 16 * i))

    rng = np.random.default_rng(7)
    for _ in range(100):
        x = (rng.standard_normal(256) * 10.0 ** rng.uniform(-4, 4, 256)).astype(np.float32)  # sums that round
        out = np.zeros(32, dtype=np.float32)
        sums(x, out)
        np.testing.assert_array_equal(out[:16].view(np.uint32), out[16:].view(np.uint32))
