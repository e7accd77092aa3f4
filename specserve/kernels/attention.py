"""Attention over the paged cache on the CPU, reading a `StepBatch`'s arrays directly.

Each new token (a row) attends over its sequence's keys 0 .. context_len - 1 in slot order, through
the block table; a key is visible unless the sequence's tree mask (or causal order among the new
tokens, or the sliding window) hides it. Masked keys are skipped, not added as zeros, so a row's
arithmetic depends only on the keys it sees and their order: a tree node attends exactly as the same
token does in plain decoding once its ancestors are committed (they are then the same keys, in the
same order). Which keys a row sees (their cache slots, in order) is found once per row, block by block
of its block table; then work is split over (row, query head) pairs, so one decode row's heads run in
parallel even when they share one KV head (GQA; the embedded model has one).

Per (row, head): scores of the visible keys, then the softmax 16 keys at a time (`vexp`; the sum
kept in 16 lanes and added up in one fixed order), then the weighted sum of values key by key, in
registers. The inner loops index flat views of the cache (no per-key array views: numba would
reference-count each one, and that cost more than the arithmetic).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from specserve.kernels.simd import LANES, vadd, vbroadcast, vexp, vfma, vlane, vload, vmul, vstore, vsub, vsum, vsum4, vzero


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
def visible_slots(token_seq, cu_query_lens, context_lens, block_tables, block_size, mask_offsets, mask_widths,
                  tree_mask, positions, window):
    """For each row t: the cache slots of the keys it sees, in key order — slots[t, :count[t]] (int32[T,
    max context]) — walking its sequence's block table block by block."""
    num_rows = token_seq.shape[0]
    longest = 0
    for t in range(num_rows):
        longest = max(longest, context_lens[token_seq[t]])
    slots = np.empty((num_rows, longest), dtype=np.int32)
    count = np.empty(num_rows, dtype=np.int64)
    for t in prange(num_rows):
        b = token_seq[t]
        row0 = cu_query_lens[b]
        n = cu_query_lens[b + 1] - row0
        context = context_lens[b]
        cached = context - n
        i = t - row0
        width, mask_offset, query_pos = mask_widths[b], mask_offsets[b], positions[t]
        seen = 0
        for first in range(0, context, block_size):
            base = block_tables[b, first // block_size] * block_size
            for j in range(first, min(context, first + block_size)):
                if _visible(j, i, n, context, cached, width, mask_offset, tree_mask, query_pos, positions, row0,
                            window):
                    slots[t, seen] = base + (j - first)
                    seen += 1
        count[t] = seen
    return slots, count


def visible_keys(batch, window: int):
    """`visible_slots` of a `StepBatch` (window: the model's sliding window, 0 = none): the same for every
    layer of a forward, so a forward finds it once and hands it to each layer."""
    return visible_slots(batch.token_seq, batch.cu_query_lens, batch.context_lens, batch.block_tables,
                         batch.block_size, batch.mask_offsets, batch.mask_widths, batch.tree_mask, batch.positions,
                         window)


@numba.njit(parallel=True, boundscheck=False, cache=True)
def paged_attention(q, k_cache, v_cache, slots, seen_counts, scale, out):
    """out[t, h] = softmax(q[t, h] . K / sqrt(d)) V over row t's visible keys.

    q:        float32[T, heads, head_dim] (rotary applied); out: float32[T, heads, head_dim].
    k_cache, v_cache: float32[slots, kv_heads, head_dim], this layer's cache (this step's K/V written).
    slots, seen_counts: the visible keys' cache slots per row (`visible_slots`); scale: 1 / sqrt(head_dim).
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    q_flat, out_flat = q.reshape(-1), out.reshape(-1)
    k_flat, v_flat = k_cache.reshape(-1), v_cache.reshape(-1)
    for item in prange(num_rows * num_heads):  # one query head of one row: heads of a KV group run in parallel
        t = item // num_heads
        h = item % num_heads
        g = h // group  # its KV head
        seen = seen_counts[t]
        # Where each visible key's (K, V) vector starts in the flat cache, in key order.
        starts = np.empty(seen, dtype=np.int64)
        for j in range(seen):
            starts[j] = (slots[t, j] * num_kv + g) * head_dim
        padded = -(-seen // LANES) * LANES
        scores = np.full(padded, -np.inf, dtype=np.float32)  # padding lanes: exp(-inf) = 0 exactly
        q0 = (t * num_heads + h) * head_dim
        j = 0
        while j + 4 <= seen:  # four keys at once: four independent dot products in flight
            k0, k1, k2, k3 = starts[j], starts[j + 1], starts[j + 2], starts[j + 3]
            c0 = vzero(); c1 = vzero(); c2 = vzero(); c3 = vzero()
            for d in range(0, head_dim, LANES):
                qd = vload(q_flat, q0 + d)
                c0 = vfma(qd, vload(k_flat, k0 + d), c0)
                c1 = vfma(qd, vload(k_flat, k1 + d), c1)
                c2 = vfma(qd, vload(k_flat, k2 + d), c2)
                c3 = vfma(qd, vload(k_flat, k3 + d), c3)
            sums = vsum4(c0, c1, c2, c3)  # each exactly vsum(c_i): the same order as a lone key's
            scores[j] = vlane(sums, 0) * scale
            scores[j + 1] = vlane(sums, 1) * scale
            scores[j + 2] = vlane(sums, 2) * scale
            scores[j + 3] = vlane(sums, 3) * scale
            j += 4
        while j < seen:
            k0 = starts[j]
            acc = vzero()
            for d in range(0, head_dim, LANES):
                acc = vfma(vload(q_flat, q0 + d), vload(k_flat, k0 + d), acc)
            scores[j] = vsum(acc) * scale
            j += 1
        top = vbroadcast(np.float32(np.max(scores[:seen])))
        lanes = vzero()
        for j in range(0, padded, LANES):
            e = vexp(vsub(vload(scores, j), top))
            vstore(scores, j, e)
            lanes = vadd(lanes, e)
        inv = vbroadcast(np.float32(1.0) / vsum(lanes))
        # Weighted sum of values, keys in order, accumulated in registers 64 dims (four 16-lane
        # chunks) at a time: each output lane is one FMA chain over the keys.
        for d0 in range(0, head_dim, 4 * LANES):
            chunks = min(4, (head_dim - d0) // LANES)
            a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
            for j in range(seen):
                v0 = starts[j] + d0
                pv = vbroadcast(scores[j])
                a0 = vfma(pv, vload(v_flat, v0), a0)
                if chunks > 1:
                    a1 = vfma(pv, vload(v_flat, v0 + LANES), a1)
                if chunks > 2:
                    a2 = vfma(pv, vload(v_flat, v0 + 2 * LANES), a2)
                if chunks > 3:
                    a3 = vfma(pv, vload(v_flat, v0 + 3 * LANES), a3)
            o0 = (t * num_heads + h) * head_dim + d0
            vstore(out_flat, o0, vmul(a0, inv))
            if chunks > 1:
                vstore(out_flat, o0 + LANES, vmul(a1, inv))
            if chunks > 2:
                vstore(out_flat, o0 + 2 * LANES, vmul(a2, inv))
            if chunks > 3:
                vstore(out_flat, o0 + 3 * LANES, vmul(a3, inv))
