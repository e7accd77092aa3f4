"""Attention over the paged cache on the CPU, reading a `StepBatch`'s arrays directly.

Each new token (a row) attends over its sequence's keys 0 .. context_len - 1 in slot order, through
the block table; a key is visible unless the sequence's tree mask (or causal order among the new
tokens, or the sliding window) hides it. Masked keys are skipped, not added as zeros, so a row's
arithmetic depends only on the keys it sees and their order: a tree node attends exactly as the same
token does in plain decoding once its ancestors are committed (they are then the same keys, in the
same order). Which keys a row sees (their cache slots, in order) is found once per row, block by block
of its block table; then work is split over (block of rows, KV head) items — (block, query head) when
there are fewer of those than threads, so one decode row's heads still run in parallel when they share one KV
head (GQA; the embedded model has one).

Per (row, head): scores of the visible keys, then the softmax 16 keys at a time (`vexp`; the sum
kept in 16 lanes and added up in one fixed order), then the weighted sum of values key by key, in
registers. A block's rows and a KV head's query heads read the keys they share a tile at a time, while
the tile is in L1: each (row, head) used to stream the whole context's K and V from L2/L3 on its own,
which made a long prompt's prefill quadratic in memory traffic (a 6,000-token prompt took minutes). Within
a tile, four (row, head) pairs at a time share each key's and value's loads (`_key_scores4`,
`_weighted_values4`): one pair at a time, a prompt chunk's attention was bound by its loads, not its FMAs. The
inner loops index flat views of the cache (no per-key array views: numba would reference-count each one,
and that cost more than the arithmetic).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from specserve.kernels.simd import (
    LANES, prefetch, vadd, vbroadcast, vexp, vfma, vlane, vload, vmax, vmax_lanes, vmul, vstore, vstore_quarter, vsub, vsum,
    vsum4, vsum16, vzero,
)


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


#: Rows attended together: consecutive rows that see the same keys (a prompt chunk's rows, a tree's rows over
#: their context) share each key tile while it is in L1.
ROW_BLOCK = 4
#: An item's scores (rows x query heads x keys, float32) at most this big when it takes every KV head: they are
#: written, read and rewritten by its passes, and stay in L2 (1 MB a core on Zen 4 and 5) below it.
SCORES_BYTES = 256 << 10
#: Keys per tile: 64 keys' K (or V) vectors of one KV head are 16 KB at head_dim 64, so every query head of the
#: group and every row of the block reads them from L1 instead of each streaming the whole context from L2/L3.
KEY_TILE = 64


@numba.njit(inline="always")
def _fetch_vectors(flat, starts, lo, hi, head_dim):
    """`prefetch` every cache line (16 floats) of the vectors of keys lo .. hi - 1 (none when hi <= lo)."""
    for f in range(lo, hi):
        start = starts[np.uint64(f)]
        for d in range(0, head_dim, LANES):
            prefetch(flat, start + d)


@numba.njit(inline="always")
def _key_scores(q_flat, q0, k_flat, starts, lo, hi, head_dim, scale, scores, ahead, fetch_end):
    """scores[j] = (q . K_j) * scale for keys lo .. hi - 1 (starts: each key's offset in the flat cache), four keys
    at a time where four remain: each score is one FMA chain over the dims then `vsum`, however keys are grouped.
    Beside key j it prefetches key j + ahead's vector, below fetch_end (0: none): the next tile, from memory while
    this one computes (a long context's keys do not fit the caches, and the hardware prefetchers do not run ahead
    of a strided walk far enough: a decode row at 4,000 keys waited on memory most of its time).
    (Indices are cast to unsigned where numba cannot see they are not negative: a negative index would wrap
    around, and checking for it cost more instructions than the key's arithmetic.)"""
    j = lo
    while j + 4 <= hi:  # four keys at once: four independent dot products in flight
        _fetch_vectors(k_flat, starts, j + ahead, min(j + ahead + 4, fetch_end), head_dim)
        at = np.uint64(j)
        k0, k1, k2, k3 = starts[at], starts[at + 1], starts[at + 2], starts[at + 3]
        c0 = vzero(); c1 = vzero(); c2 = vzero(); c3 = vzero()
        for d in range(0, head_dim, LANES):
            qd = vload(q_flat, q0 + d)
            c0 = vfma(qd, vload(k_flat, k0 + d), c0)
            c1 = vfma(qd, vload(k_flat, k1 + d), c1)
            c2 = vfma(qd, vload(k_flat, k2 + d), c2)
            c3 = vfma(qd, vload(k_flat, k3 + d), c3)
        sums = vsum4(c0, c1, c2, c3)  # each exactly vsum(c_i): the same order as a lone key's
        scores[at] = vlane(sums, 0) * scale
        scores[at + 1] = vlane(sums, 1) * scale
        scores[at + 2] = vlane(sums, 2) * scale
        scores[at + 3] = vlane(sums, 3) * scale
        j += 4
    while j < hi:
        _fetch_vectors(k_flat, starts, j + ahead, min(j + ahead + 1, fetch_end), head_dim)
        at = np.uint64(j)
        k0 = starts[at]
        acc = vzero()
        for d in range(0, head_dim, LANES):
            acc = vfma(vload(q_flat, q0 + d), vload(k_flat, k0 + d), acc)
        scores[at] = vsum(acc) * scale
        j += 1


@numba.njit(inline="always")
def _weighted_values(v_flat, starts, probs, lo, hi, head_dim, acc, ahead, fetch_end):
    """acc[:] += Σ probs[j] · V_j over keys lo .. hi - 1 in key order, 64 dims (four 16-lane chunks) at a time in
    registers, then 16 at a time: each output lane is one FMA chain over the keys (acc round-trips memory between
    calls exactly). The key loop has no branch and no negative-index check: it is the whole cost of a value. The
    vectors of keys lo + ahead .. hi + ahead - 1 below fetch_end are prefetched first (`_key_scores`)."""
    _fetch_vectors(v_flat, starts, lo + ahead, min(hi + ahead, fetch_end), head_dim)
    d0 = 0
    while d0 + 4 * LANES <= head_dim:
        a0, a1 = vload(acc, d0), vload(acc, d0 + LANES)
        a2, a3 = vload(acc, d0 + 2 * LANES), vload(acc, d0 + 3 * LANES)
        for j in range(lo, hi):
            at = np.uint64(j)
            v0 = starts[at] + d0
            pv = vbroadcast(probs[at])
            a0 = vfma(pv, vload(v_flat, v0), a0)
            a1 = vfma(pv, vload(v_flat, v0 + LANES), a1)
            a2 = vfma(pv, vload(v_flat, v0 + 2 * LANES), a2)
            a3 = vfma(pv, vload(v_flat, v0 + 3 * LANES), a3)
        vstore(acc, d0, a0)
        vstore(acc, d0 + LANES, a1)
        vstore(acc, d0 + 2 * LANES, a2)
        vstore(acc, d0 + 3 * LANES, a3)
        d0 += 4 * LANES
    while d0 < head_dim:
        a0 = vload(acc, d0)
        for j in range(lo, hi):
            at = np.uint64(j)
            a0 = vfma(vbroadcast(probs[at]), vload(v_flat, starts[at] + d0), a0)
        vstore(acc, d0, a0)
        d0 += LANES


@numba.njit(inline="always")
def _load64(flat, at):
    """flat[at : at + 64] as four 16-lane vectors."""
    return vload(flat, at), vload(flat, at + LANES), vload(flat, at + 2 * LANES), vload(flat, at + 3 * LANES)


@numba.njit(inline="always")
def _store64(flat, at, a0, a1, a2, a3):
    """flat[at : at + 64] = four 16-lane vectors."""
    vstore(flat, at, a0)
    vstore(flat, at + LANES, a1)
    vstore(flat, at + 2 * LANES, a2)
    vstore(flat, at + 3 * LANES, a3)


@numba.njit(inline="always")
def _fma64(w, x0, x1, x2, x3, a0, a1, a2, a3):
    """(a0 .. a3) + w * (x0 .. x3), chunk by chunk: 64 dims of one value vector weighted into one pair's sums."""
    return vfma(w, x0, a0), vfma(w, x1, a1), vfma(w, x2, a2), vfma(w, x3, a3)


@numba.njit(inline="always")
def _dot64(q0, q1, q2, q3, x0, x1, x2, x3):
    """One score's FMA chain over 64 dims, before its `vsum`: the same chain `_key_scores` runs, chunk by chunk."""
    return vfma(q3, x3, vfma(q2, x2, vfma(q1, x1, vfma(q0, x0, vzero()))))


@numba.njit(inline="always")
def _store_scores4(sums, at, scale, sa, sb, sc, sd):
    """Lanes 0-3 of `vsum4`'s result, scaled, as key `at`'s score of four pairs."""
    sa[at] = vlane(sums, 0) * scale
    sb[at] = vlane(sums, 1) * scale
    sc[at] = vlane(sums, 2) * scale
    sd[at] = vlane(sums, 3) * scale


@numba.njit(inline="always")
def _key_scores4(q_flat, qa, qb, qc, qd, k_flat, starts, lo, hi, head_dim, scale, sa, sb, sc, sd, ahead, fetch_end):
    """`_key_scores` for four (row, head) pairs that see keys lo .. hi - 1 at the same slots (queries at q_flat[qa],
    ..., scores into sa .. sd): each key vector is loaded once for the four queries instead of once per query (a
    prompt chunk's attention was bound by those loads). At 64 dims the four queries stay in 16 registers and four keys
    go at once, their 16 scores summed by one `vsum16` and stored four to a pair (four `vsum4`s and 16 scalar stores
    cost a third more). Every score is the same FMA chain over the dims then `vsum` as `_key_scores` computes alone:
    grouping changes no bit."""
    if head_dim == 4 * LANES:
        qa0, qa1, qa2, qa3 = _load64(q_flat, qa)
        qb0, qb1, qb2, qb3 = _load64(q_flat, qb)
        qc0, qc1, qc2, qc3 = _load64(q_flat, qc)
        qd0, qd1, qd2, qd3 = _load64(q_flat, qd)
        j = lo
        scale_v = vbroadcast(scale)
        while j + 4 <= hi:  # four keys: their 16 scores summed in one `vsum16`, stored four to a pair
            _fetch_vectors(k_flat, starts, j + ahead, min(j + ahead + 4, fetch_end), head_dim)
            at = np.uint64(j)
            x0, x1, x2, x3 = _load64(k_flat, starts[at])
            a0 = _dot64(qa0, qa1, qa2, qa3, x0, x1, x2, x3); b0 = _dot64(qb0, qb1, qb2, qb3, x0, x1, x2, x3)
            c0 = _dot64(qc0, qc1, qc2, qc3, x0, x1, x2, x3); d0 = _dot64(qd0, qd1, qd2, qd3, x0, x1, x2, x3)
            x0, x1, x2, x3 = _load64(k_flat, starts[at + 1])
            a1 = _dot64(qa0, qa1, qa2, qa3, x0, x1, x2, x3); b1 = _dot64(qb0, qb1, qb2, qb3, x0, x1, x2, x3)
            c1 = _dot64(qc0, qc1, qc2, qc3, x0, x1, x2, x3); d1 = _dot64(qd0, qd1, qd2, qd3, x0, x1, x2, x3)
            x0, x1, x2, x3 = _load64(k_flat, starts[at + 2])
            a2 = _dot64(qa0, qa1, qa2, qa3, x0, x1, x2, x3); b2 = _dot64(qb0, qb1, qb2, qb3, x0, x1, x2, x3)
            c2 = _dot64(qc0, qc1, qc2, qc3, x0, x1, x2, x3); d2 = _dot64(qd0, qd1, qd2, qd3, x0, x1, x2, x3)
            x0, x1, x2, x3 = _load64(k_flat, starts[at + 3])
            a3 = _dot64(qa0, qa1, qa2, qa3, x0, x1, x2, x3); b3 = _dot64(qb0, qb1, qb2, qb3, x0, x1, x2, x3)
            c3 = _dot64(qc0, qc1, qc2, qc3, x0, x1, x2, x3); d3 = _dot64(qd0, qd1, qd2, qd3, x0, x1, x2, x3)
            sums = vmul(vsum16(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3), scale_v)
            vstore_quarter(sa, at, sums, 0)
            vstore_quarter(sb, at, sums, 1)
            vstore_quarter(sc, at, sums, 2)
            vstore_quarter(sd, at, sums, 3)
            j += 4
        for j in range(j, hi):
            _fetch_vectors(k_flat, starts, j + ahead, min(j + ahead + 1, fetch_end), head_dim)
            at = np.uint64(j)
            x0, x1, x2, x3 = _load64(k_flat, starts[at])
            _store_scores4(vsum4(_dot64(qa0, qa1, qa2, qa3, x0, x1, x2, x3), _dot64(qb0, qb1, qb2, qb3, x0, x1, x2, x3),
                                 _dot64(qc0, qc1, qc2, qc3, x0, x1, x2, x3), _dot64(qd0, qd1, qd2, qd3, x0, x1, x2, x3)),
                           at, scale, sa, sb, sc, sd)
        return
    for j in range(lo, hi):
        _fetch_vectors(k_flat, starts, j + ahead, min(j + ahead + 1, fetch_end), head_dim)
        at = np.uint64(j)
        k0 = starts[at]
        a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
        for d in range(0, head_dim, LANES):
            x0 = vload(k_flat, k0 + d)
            a0 = vfma(vload(q_flat, qa + d), x0, a0)
            a1 = vfma(vload(q_flat, qb + d), x0, a1)
            a2 = vfma(vload(q_flat, qc + d), x0, a2)
            a3 = vfma(vload(q_flat, qd + d), x0, a3)
        _store_scores4(vsum4(a0, a1, a2, a3), at, scale, sa, sb, sc, sd)


@numba.njit(inline="always")
def _weighted_values4(v_flat, starts, pa, pb, pc, pd, lo, hi, head_dim, acc_a, acc_b, acc_c, acc_d, ahead, fetch_end):
    """`_weighted_values` for four pairs that see keys lo .. hi - 1 at the same slots (probabilities pa .. pd, sums
    into acc_a .. acc_d): each value vector is loaded once for the four, 64 dims at a time in 16 registers, then 16
    at a time. Each output lane is the same FMA chain over the keys in order as alone."""
    _fetch_vectors(v_flat, starts, lo + ahead, min(hi + ahead, fetch_end), head_dim)
    d0 = 0
    while d0 + 4 * LANES <= head_dim:
        a0, a1, a2, a3 = _load64(acc_a, d0)
        b0, b1, b2, b3 = _load64(acc_b, d0)
        c0, c1, c2, c3 = _load64(acc_c, d0)
        e0, e1, e2, e3 = _load64(acc_d, d0)
        for j in range(lo, hi):
            at = np.uint64(j)
            x0, x1, x2, x3 = _load64(v_flat, starts[at] + d0)
            a0, a1, a2, a3 = _fma64(vbroadcast(pa[at]), x0, x1, x2, x3, a0, a1, a2, a3)
            b0, b1, b2, b3 = _fma64(vbroadcast(pb[at]), x0, x1, x2, x3, b0, b1, b2, b3)
            c0, c1, c2, c3 = _fma64(vbroadcast(pc[at]), x0, x1, x2, x3, c0, c1, c2, c3)
            e0, e1, e2, e3 = _fma64(vbroadcast(pd[at]), x0, x1, x2, x3, e0, e1, e2, e3)
        _store64(acc_a, d0, a0, a1, a2, a3)
        _store64(acc_b, d0, b0, b1, b2, b3)
        _store64(acc_c, d0, c0, c1, c2, c3)
        _store64(acc_d, d0, e0, e1, e2, e3)
        d0 += 4 * LANES
    while d0 < head_dim:
        a0, b0, c0, e0 = vload(acc_a, d0), vload(acc_b, d0), vload(acc_c, d0), vload(acc_d, d0)
        for j in range(lo, hi):
            at = np.uint64(j)
            x0 = vload(v_flat, starts[at] + d0)
            a0 = vfma(vbroadcast(pa[at]), x0, a0)
            b0 = vfma(vbroadcast(pb[at]), x0, b0)
            c0 = vfma(vbroadcast(pc[at]), x0, c0)
            e0 = vfma(vbroadcast(pd[at]), x0, e0)
        vstore(acc_a, d0, a0); vstore(acc_b, d0, b0); vstore(acc_c, d0, c0); vstore(acc_d, d0, e0)
        d0 += LANES


@numba.njit(parallel=True, boundscheck=False, cache=True)
def paged_attention(q, k_cache, v_cache, slots, seen_counts, scale, out, threads):
    """out[t, h] = softmax(q[t, h] . K / sqrt(d)) V over row t's visible keys.

    q:        float32[T, heads, head_dim] (rotary applied); out: float32[T, heads, head_dim].
    k_cache, v_cache: [slots, kv_heads, head_dim], this layer's cache (this step's K/V written): float32, or
              uint16 holding float16 bits (`kv_cache_dtype`), widened as they are loaded (`simd.vload`).
    slots, seen_counts: the visible keys' cache slots per row (`visible_slots`); scale: 1 / sqrt(head_dim).
    threads:  the kernel threads (`threads.get_threads`): how many items are worth making (numba's own count is not
              read here: a kernel that calls it cannot be cached on disk).

    Work items are (block of ROW_BLOCK rows, every KV head) while there are items enough for the threads and an
    item's scores fit SCORES_BYTES, else (block, KV head), or (block, query head) when those are fewer than the
    threads. The keys every row of the block sees at the same slots (its shared prefix) are read a KEY_TILE at a time
    by the item's (row, query head) pairs, four at a time (`_key_scores4`, `_weighted_values4`); each row's remaining
    keys alone. A pair's arithmetic is the same
    whichever rows and heads share its item: a score is one chain (`_key_scores`), the softmax runs 16 keys at a time
    (`vexp`, the sum in 16 lanes added up in one fixed order), the value sum one FMA chain per lane over the keys in
    order (`_weighted_values`).
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    q_flat, out_flat = q.reshape(-1), out.reshape(-1)
    k_flat, v_flat = k_cache.reshape(-1), v_cache.reshape(-1)
    num_blocks = (num_rows + ROW_BLOCK - 1) // ROW_BLOCK
    longest = 0
    for t in range(num_rows):
        longest = max(longest, seen_counts[t])
    # Every KV head in one item while there are items enough for the threads and the item's scores stay in L2: a
    # slot holds its KV heads' vectors side by side, so one item reads the cache's lines in order where one item per
    # head read a third of each slot's lines apiece (a decode row at 6,000 keys streamed K and V at 17 GB/s that way,
    # 21 GB/s in order: BENCHMARKS.md, "Long prompts").
    fits = min(num_rows, ROW_BLOCK) * num_heads * longest * 4 <= SCORES_BYTES
    kv_per_item = num_kv if num_blocks >= threads and fits else 1
    # Fewer items than threads (a decode row of a model with one KV head): each query head its own item, so they run
    # in parallel. Only then: the heads of a split group each stream the group's keys and values on their own (three
    # times the traffic on SmolLM2, where a long context's decode step was mostly that stream).
    splits = group if num_blocks * num_kv < threads else 1
    for item in prange(num_blocks * (num_kv // kv_per_item) * splits):  # (the index as int64: numba types it uint64)
        _attention_item(np.int64(item), q_flat, k_flat, v_flat, out_flat, slots, seen_counts, scale, num_rows,
                        num_heads, num_kv, head_dim, splits, kv_per_item)


@numba.njit(boundscheck=False, cache=True)
def _attention_item(item, q_flat, k_flat, v_flat, out_flat, slots, seen_counts, scale, num_rows, num_heads, num_kv,
                    head_dim, splits, kv_per_item):
    """`paged_attention`'s work item `item` (its block of rows; its kv_per_item KV heads, or one query head of
    `splits`), a function of its own: numba's parallel passes then see a one-call loop body (inline, they took most
    of the kernel's ~17 s compile).

    Its (row, query head) pairs are ordered by KV head, then row, then query head: each KV head's pairs (a segment)
    read that head's vectors, at `gi * head_dim` past the first head's in every slot (the cache's flat views are
    taken that far in, so one `starts` serves every head)."""
    group = num_heads // num_kv
    per_item = group // splits  # query heads per KV head in this item
    kv_items = num_kv // kv_per_item
    r0 = (item // (kv_items * splits)) * ROW_BLOCK
    g0 = ((item // splits) % kv_items) * kv_per_item  # the item's first KV head
    h_off = (item % splits) * per_item  # its first query head within each KV head's group
    rows = min(num_rows, r0 + ROW_BLOCK) - r0
    most, shared = 0, seen_counts[r0]
    for r in range(rows):
        most = max(most, seen_counts[r0 + r])
        shared = min(shared, seen_counts[r0 + r])
    for r in range(1, rows):  # the leading keys every row sees at the same slots
        j = 0
        while j < shared and slots[r0 + r, j] == slots[r0, j]:
            j += 1
        shared = j
    # Where each visible key's vector of KV head g0 starts in the flat cache, per row, in key order.
    starts = np.empty((rows, most), dtype=np.int64)
    for r in range(rows):
        for j in range(seen_counts[r0 + r]):
            starts[r, j] = (slots[r0 + r, j] * num_kv + g0) * head_dim
    seg = rows * per_item  # pairs per KV head
    pairs = kv_per_item * seg
    padded = -(-most // LANES) * LANES
    scores = np.full((pairs, padded), -np.inf, dtype=np.float32)  # padding lanes: exp(-inf) = 0 exactly
    # Each pair's row within the block, and where its query starts in q_flat (and its output in out_flat).
    row_of = np.empty(pairs, dtype=np.int64)
    q_at = np.empty(pairs, dtype=np.int64)
    for p in range(pairs):
        gi, r = p // seg, (p % seg) // per_item
        row_of[p] = r
        q_at[p] = ((r0 + r) * num_heads + (g0 + gi) * group + h_off + p % per_item) * head_dim
    for lo in range(0, shared, KEY_TILE):
        hi = min(shared, lo + KEY_TILE)
        # The shared keys sit at the same slots for every row (starts[0]); each segment's first group fetches its
        # head's share of the next tile. Four pairs at a time share each key's loads; two or three left over (a decode
        # row's three heads per KV head on SmolLM2) take a group of four with the last pair repeated, which writes its
        # same scores twice (measured: cheaper than one by one); a single one goes alone.
        fetch_end = min(shared, hi + KEY_TILE)
        for gi in range(kv_per_item):
            k_head = k_flat[gi * head_dim:]
            p, end = gi * seg, (gi + 1) * seg
            while end - p >= 2:
                b, c, d = p + 1, min(p + 2, end - 1), min(p + 3, end - 1)
                _key_scores4(q_flat, q_at[p], q_at[b], q_at[c], q_at[d], k_head, starts[0], lo, hi, head_dim, scale,
                             scores[p], scores[b], scores[c], scores[d], KEY_TILE, fetch_end if p == gi * seg else 0)
                p += 4
            while p < end:
                _key_scores(q_flat, q_at[p], k_head, starts[0], lo, hi, head_dim, scale, scores[p], KEY_TILE,
                            fetch_end if p == gi * seg else 0)
                p += 1
    for p in range(pairs):
        r = row_of[p]
        _key_scores(q_flat, q_at[p], k_flat[(p // seg) * head_dim:], starts[r], shared, seen_counts[r0 + r], head_dim,
                    scale, scores[p], 0, 0)
    inv = np.empty(pairs, dtype=np.float32)
    for p in range(pairs):
        seen = seen_counts[r0 + row_of[p]]
        row = scores[p]
        # The row's maximum 16 lanes at a time (lanes past `seen` hold -inf): numba's scalar np.max over the
        # slice took a third of a 16-row verify's attention.
        top = vbroadcast(np.float32(-np.inf))
        for j in range(0, -(-seen // LANES) * LANES, LANES):
            top = vmax(top, vload(row, j))
        top = vbroadcast(vmax_lanes(top))
        lanes = vzero()
        for j in range(0, -(-seen // LANES) * LANES, LANES):
            e = vexp(vsub(vload(row, j), top))
            vstore(row, j, e)
            lanes = vadd(lanes, e)
        inv[p] = np.float32(1.0) / vsum(lanes)
    acc = np.zeros((pairs, head_dim), dtype=np.float32)
    for lo in range(0, shared, KEY_TILE):
        hi = min(shared, lo + KEY_TILE)
        fetch_end = min(shared, hi + KEY_TILE)
        for gi in range(kv_per_item):  # grouped as the scores are (a repeated pair sums the same values twice, alike)
            v_head = v_flat[gi * head_dim:]
            p, end = gi * seg, (gi + 1) * seg
            while end - p >= 2:
                b, c, d = p + 1, min(p + 2, end - 1), min(p + 3, end - 1)
                _weighted_values4(v_head, starts[0], scores[p], scores[b], scores[c], scores[d], lo, hi, head_dim,
                                  acc[p], acc[b], acc[c], acc[d], KEY_TILE, fetch_end if p == gi * seg else 0)
                p += 4
            while p < end:
                _weighted_values(v_head, starts[0], scores[p], lo, hi, head_dim, acc[p], KEY_TILE,
                                 fetch_end if p == gi * seg else 0)
                p += 1
    for p in range(pairs):
        r = row_of[p]
        _weighted_values(v_flat[(p // seg) * head_dim:], starts[r], scores[p], shared, seen_counts[r0 + r], head_dim,
                         acc[p], 0, 0)
        scale_inv = vbroadcast(inv[p])
        o0 = q_at[p]  # out has q's layout
        for d in range(0, head_dim, LANES):
            vstore(out_flat, o0 + d, vmul(vload(acc[p], d), scale_inv))
