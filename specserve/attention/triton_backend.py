"""The ``triton`` attention backend: paged tree attention in one Triton kernel, plus the KV write.

Unlike ``sdpa`` it never gathers the cache into a padded copy: the kernel reads K/V through each
sequence's block table. Everything it launches has shapes fixed by (num_seqs, max_query_len, head
layout), and it reads the batch only from device tensors — which is what lets `specserve.cuda_graphs`
capture a forward once per bucket and replay it with new contents in the same buffers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from specserve.attention.triton_kernels import paged_tree_attention_kernel, write_kv_kernel
from specserve.kv_cache import PagedKVCache
from specserve.step_batch import DeviceArrays, StepBatch

# Triton's interpreter (TRITON_INTERPRET=1, how CI runs the kernel on the CPU) computes bf16 dots wrongly.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class TritonMetadata:
    """What every layer's launch reads: the batch's device arrays and the grid's extent.

    arrays:        the StepBatch's tensors on the cache's device (static buffers under a CUDA graph).
    tree_mask:     uint8[max(M, 1)] the packed masks as bytes (Triton loads no bool pointers).
    num_seqs:      sequences (grid axis 0).
    max_query_len: the most new rows of any sequence (sets the query tiles, grid axis 1).
    block_size:    cache slots per block.
    """

    arrays: DeviceArrays
    tree_mask: torch.Tensor
    num_seqs: int
    max_query_len: int
    block_size: int


class TritonBackend:
    name = "triton"

    def __init__(self, sliding_window: int | None = None, block_n: int = 64) -> None:
        self.sliding_window = sliding_window
        self.block_n = block_n  # keys per inner tile

    def prepare(self, batch: StepBatch, cache: PagedKVCache) -> TritonMetadata:
        d = batch.device_arrays(cache.device)
        mask = d.tree_mask.view(torch.uint8) if d.tree_mask.numel() else torch.zeros(1, dtype=torch.uint8,
                                                                                        device=cache.device)
        return TritonMetadata(arrays=d, tree_mask=mask, num_seqs=batch.num_seqs,
                              max_query_len=batch.max_query_len, block_size=batch.block_size)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TritonMetadata,
               cache: PagedKVCache) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] → output [T, heads * head_dim]."""
        T, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        d = meta.arrays
        k_cache, v_cache = cache.k[layer], cache.v[layer]  # [slots, kv_heads, head_dim] each, contiguous
        new_k = k.reshape(T, kv_heads * head_dim).to(k_cache.dtype)
        new_v = v.reshape(T, kv_heads * head_dim).to(v_cache.dtype)
        row = kv_heads * head_dim
        if T:
            # k is rotary's output, v a view into the QKV projection: each has its own row stride.
            write_kv_kernel[(T,)](new_k, new_v, k_cache, v_cache, d.slot_mapping, new_k.stride(0), new_v.stride(0),
                                  k_cache.stride(0), ROW=row, ROW_P=triton.next_power_of_2(row))
        q = q.to(k_cache.dtype)
        out = torch.empty_like(q)
        group = heads // kv_heads
        block_m = _block_m(group, meta.max_query_len)
        tiles = triton.cdiv(meta.max_query_len, block_m // group)
        if meta.num_seqs and tiles:
            paged_tree_attention_kernel[(meta.num_seqs, tiles, kv_heads)](
                q, k_cache, v_cache, out,
                d.cu_query_lens, d.context_lens, d.block_tables, d.mask_offsets, d.mask_widths, meta.tree_mask,
                d.positions,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
                d.block_tables.stride(0),
                1.0 / math.sqrt(head_dim), self.sliding_window or 0,
                GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_M=block_m, BLOCK_N=self.block_n, BLOCK_SIZE=meta.block_size,
                HAS_WINDOW=self.sliding_window is not None, FP32_DOT=k_cache.dtype == torch.float32 or _INTERPRETED,
            )
        return out.reshape(T, heads * head_dim)


def _block_m(group: int, max_query_len: int) -> int:
    """Rows per program (query rows x the GROUP heads sharing a kv head): the fewest power of two >= 16 (tl.dot's
    minimum) that holds every query of the longest sequence, capped at 64 (prefill chunks tile instead)."""
    need = triton.next_power_of_2(max(1, max_query_len) * group)
    return max(16, triton.next_power_of_2(group), min(64, need))
