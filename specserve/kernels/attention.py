"""Attention over the paged cache on the CPU, reading a `StepBatch`'s arrays directly.

Each new token (a row) attends over its sequence's keys 0 .. context_len - 1 in slot order, through
the block table; a key is visible unless the sequence's tree mask (or causal order among the new
tokens, or the sliding window) hides it. Masked keys are skipped, not added as zeros, so a row's
arithmetic depends only on the keys it sees and their order: a tree node attends exactly as the same
token does in plain decoding once its ancestors are committed (they are then the same keys, in the
same order). Work is split over (row, KV head) pairs; one thread computes a row's heads of a group.

Per (row, head): scores of the visible keys, then the softmax 16 keys at a time (`vexp`; the sum
kept in 16 lanes and added up in one fixed order), then the weighted sum of values key by key.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from specserve.kernels.simd import LANES, vadd, vbroadcast, vexp, vfma, vload, vmul, vstore, vsub, vsum, vzero


@numba.njit(inline="always")
def _visible(j, i, n, context, cached, width, mask_offset, tree_mask, query_pos, positions, row0, window):
    """Whether new token i (of n) of a sequence sees its key j (see `StepBatch` for the mask layout)."""
    tail = context - width
    if j >= tail:
        col = j - tail
        if mask_offset >= 0:
            if not tree_mask[mask_offset + i * width + col]:
                return False
        elif col > i + (width - n):
            return False
    if window > 0:
        key_pos = j if j < cached else positions[row0 + j - cached]
        if query_pos - key_pos >= window:
            return False
    return True


@numba.njit(parallel=True, boundscheck=False, cache=True)
def paged_attention(q, k_cache, v_cache, token_seq, cu_query_lens, context_lens, block_tables, block_size,
                    mask_offsets, mask_widths, tree_mask, positions, window, scale, out):
    """out[t, h] = softmax(q[t, h] . K / sqrt(d)) V over row t's visible keys.

    q:        float32[T, heads, head_dim] (rotary applied); out: float32[T, heads, head_dim].
    k_cache, v_cache: float32[slots, kv_heads, head_dim], this layer's cache (this step's K/V written).
    window:   sliding window (0 = none); scale: 1 / sqrt(head_dim).
    The rest: the StepBatch arrays of the same names.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    for item in prange(num_rows * num_kv):
        t = item // num_kv
        g = item % num_kv
        b = token_seq[t]
        row0 = cu_query_lens[b]
        n = cu_query_lens[b + 1] - row0
        context = context_lens[b]
        cached = context - n
        i = t - row0
        width = mask_widths[b]
        mask_offset = mask_offsets[b]
        query_pos = positions[t]
        # The visible keys' physical slots, in key order.
        slots = np.empty(context, dtype=np.int64)
        seen = 0
        for j in range(context):
            if _visible(j, i, n, context, cached, width, mask_offset, tree_mask, query_pos, positions, row0, window):
                slots[seen] = block_tables[b, j // block_size] * block_size + j % block_size
                seen += 1
        padded = -(-seen // LANES) * LANES
        scores = np.full(padded, -np.inf, dtype=np.float32)  # padding lanes: exp(-inf) = 0 exactly
        acc_out = np.empty(head_dim, dtype=np.float32)
        for r in range(group):
            h = g * group + r
            query = q[t, h]
            for j in range(seen):
                key = k_cache[slots[j], g]
                acc = vzero()
                for d in range(0, head_dim, LANES):
                    acc = vfma(vload(query, d), vload(key, d), acc)
                scores[j] = vsum(acc) * scale
            for j in range(seen, padded):
                scores[j] = -np.inf  # padding lanes (the previous head left exps there)
            top = vbroadcast(np.float32(np.max(scores[:seen])))
            lanes = vzero()
            for j in range(0, padded, LANES):
                e = vexp(vsub(vload(scores, j), top))
                vstore(scores, j, e)
                lanes = vadd(lanes, e)
            inv = vbroadcast(np.float32(1.0) / vsum(lanes))
            for d in range(0, head_dim, LANES):
                vstore(acc_out, d, vzero())
            for j in range(seen):
                value = v_cache[slots[j], g]
                pv = vbroadcast(scores[j])
                for d in range(0, head_dim, LANES):
                    vstore(acc_out, d, vfma(pv, vload(value, d), vload(acc_out, d)))
            dst = out[t, h]
            for d in range(0, head_dim, LANES):
                vstore(dst, d, vmul(vload(acc_out, d), inv))
