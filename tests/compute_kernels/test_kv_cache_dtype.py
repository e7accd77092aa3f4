"""`LLM(kv_cache_dtype="float16")`: K and V stored as float16 on the CPU kernels' path, widened as attention reads them.

The kernels hold a float16 cache as its bits (uint16 arrays: numba has no float16), write each K and V value rounded
to the nearest float16 (`simd.store_float`) and widen it back exactly as they load (`simd.vload`). References: the
float64 attention of tests/random_step_batches.py on the widened values, and the torch layers with the sdpa backend
over a float16 cache (torch rounds on assignment and widens on read, independently of the kernels).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from cli_runner import cli
from random_step_batches import CONFIGS, random_batch, reference

from specserve import LLM, SamplingParams
from specserve.kernels.attention import paged_attention, visible_keys
from specserve.kernels.threads import get_threads
from specserve.kv_cache import BlockAllocator, PagedKVCache


def _attend(batch, q, k_cache, v_cache, window) -> np.ndarray:
    out = np.full(q.shape, np.nan, dtype=np.float32)
    paged_attention(q, k_cache, v_cache, *visible_keys(batch, window or 0), np.float32(1.0 / math.sqrt(q.shape[2])),
                    out, get_threads())
    return out


@pytest.mark.parametrize("config", ["gqa3-hd64-bs16", "gqa3-hd32-bs2", "mha-hd16-window3"])
def test_attention_reads_a_float16_cache_as_its_exact_float32_values(config, use_threads):
    heads, kv_heads, head_dim, window, block_size = CONFIGS[config]
    for threads in (1, 2):
        use_threads(threads)
        for seed in range(3):
            rng = np.random.default_rng(seed)
            batch = random_batch(rng, BlockAllocator(96 // block_size * 6, block_size), 6)
            slots = batch.block_tables.max() * block_size + block_size
            k16 = rng.standard_normal((slots, kv_heads, head_dim)).astype(np.float16)
            v16 = rng.standard_normal((slots, kv_heads, head_dim)).astype(np.float16)
            q = rng.standard_normal((batch.num_tokens, heads, head_dim)).astype(np.float32)
            got = _attend(batch, q, k16.view(np.uint16), v16.view(np.uint16), window)
            widened = _attend(batch, q, k16.astype(np.float32), v16.astype(np.float32), window)
            np.testing.assert_array_equal(got.view(np.uint32), widened.view(np.uint32))
            ref = reference(batch, q, k16.astype(np.float32), v16.astype(np.float32), window)
            np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5, err_msg=f"{config} seed={seed}")


def test_model_kernels_write_and_read_a_float16_cache_as_the_torch_layers_do(tmp_path):
    """Whole forwards over random StepBatches, the kernels and the torch layers (sdpa) each on a float16 cache with
    the same contents: logits and the K/V written (rounded to float16 by each) agree."""
    from specserve.model import LlamaModel
    from tiny_models import build_model

    path = build_model(tmp_path, "llama", vocab_size=61, tokenizer=False, init_std=0.2, layers=2, hidden_size=96,
                       heads=3, kv_heads=1)
    kernels = LlamaModel.from_pretrained(path, torch.device("cpu"), torch.float32, cpu_kernels=True)
    layers = LlamaModel.from_pretrained(path, torch.device("cpu"), torch.float32, cpu_kernels=False)
    kernels.kv_cache_dtype = layers.kv_cache_dtype = torch.float16
    for seed in range(3):
        rng = np.random.default_rng(200 + seed)
        allocator = BlockAllocator(96 // 4 * 6, 4)
        batch = random_batch(rng, allocator, 6)
        caches = [kernels.new_cache(allocator), layers.new_cache(allocator)]
        assert caches[0].k.dtype == torch.float16
        gen = torch.Generator().manual_seed(seed)
        for part in ("k", "v"):
            values = torch.randn(getattr(caches[0], part).shape, generator=gen).half()
            for cache in caches:
                getattr(cache, part).copy_(values)
        batch = dataclasses.replace(batch, logit_rows=np.arange(batch.num_tokens, dtype=np.int64))
        out_k = kernels.forward(batch, caches[0]).logits
        out_t = layers.forward(batch, caches[1]).logits
        # Each side rounds its own float32 K and V (equal to ~1e-6) to float16: a value near a rounding boundary
        # may land one float16 step (2^-11 relative) apart, which moves the logits by about as much.
        torch.testing.assert_close(out_k, out_t, atol=2e-3, rtol=2e-3)
        slots = torch.from_numpy(batch.slot_mapping)
        for part in ("k", "v"):
            torch.testing.assert_close(getattr(caches[0], part)[:, slots].float(), getattr(caches[1], part)[:, slots].float(),
                                       atol=2e-3, rtol=2e-3)
        # Rounded to nearest, not truncated: layer 0's written values (computed before any attention) are the torch
        # layers' float32 K and V rounded to float16, but where the two sides' float32 values straddle a boundary.
        cfg = layers.config
        full = PagedKVCache(allocator, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
        for part in ("k", "v"):
            getattr(full, part).copy_(getattr(caches[1], part).float())
        layers.forward(batch, full)
        for part in ("k", "v"):
            written, exact = getattr(caches[0], part)[0, slots], getattr(full, part)[0, slots].half()
            assert (written == exact).float().mean() > 0.99, part


def test_speculation_over_a_float16_cache_is_lossless(llama_dir):
    prompts = ["def f(x):\n    return x + 1\n" * 2, "class Point:", "for i in range(10):", "import os"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain_llm = LLM(llama_dir, drafter=None, device="cpu", kv_cache_dtype="float16")
    assert plain_llm.engine.cache.k.dtype == torch.float16
    plain = [o.token_ids for o in plain_llm.generate(prompts, params)]
    llm = LLM(llama_dir, drafter="ngram", device="cpu", kv_cache_dtype="float16", speculation="static")
    for batch in (1, 4):
        outs = llm.generate(prompts[:batch], params)
        assert [o.token_ids for o in outs] == plain[:batch], batch
    assert sum(o.spec.num_drafted for o in outs) > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache_dtype="bfloat16"), "kv_cache_dtype must be one of float32, float16"),
    (dict(kv_cache_dtype="float16", attention="sdpa"), "CPU kernels only"),
])
def test_a_kv_cache_dtype_that_cannot_run_is_refused(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, drafter=None, device="cpu", **kwargs)


def test_cli_takes_kv_cache_dtype_and_refuses_it_in_one_line(capsys, llama_dir):
    res = cli(capsys, "generate", "--model", str(llama_dir), "--prompt", "hi", "--max-tokens", "4", "--drafter", "none",
              "--kv-cache-dtype", "float16")
    assert res.returncode == 0, res.stderr
    res = cli(capsys, "generate", "--model", str(llama_dir), "--prompt", "hi", "--max-tokens", "4",
              "--kv-cache-dtype", "float16", "--attention", "sdpa")
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "kv_cache_dtype" in res.stderr, res.stderr
