"""8- and 4-bit products on the CPU: llama.cpp's Q8_0, Q4_0 and Q4_1 weights times 8-bit activations, summed in
integers.

Formats and layouts: `quant_packing` (llama.cpp's quantizers, packing from float weights or from blocks as given).

Arithmetic (`linear_rows_quant`), as llama.cpp's q8_0 × q8_0, q4_0 × q8_0 and q4_1 × q8_1 dot products do it: each
row of x is quantized to Q8_0 per run of 32 (`quantize_activations`: scale dx float32, qx int8, and the exact
Σ qx of the run, int32), then for every output o, row m and run j the integer sum S = Σ_k q[o, k] · qx[m, k]
(Q4_0: Σ (q - 8) · qx; Q4_1: Σ q · qx with the stored q in [0, 15]) is exact in int32, and the float result is
ONE fused multiply-add chain over the runs, j = 0, 1, ..., from zero:
- Q8_0, Q4_0: acc = fma(float(S_j), d_j · dx_j, acc);
- Q4_1 (w = q · d + m): acc = fma(float(S_j), d_j · dx_j, acc), then acc = fma(m_j, dx_j · float(Σ qx_j), acc) —
  the two terms of llama.cpp's d · dx · S + m · s (s = dx · Σ qx), d's first; each product in a scale rounded
  once to float32 (d, m are float16, so m_j and d_j are exact; Σ qx is exact in float32);
then + bias (then + the old value when accumulating). Integer sums have no order to vary and the chain's order
is fixed, so row r of a k-row product equals the 1-row product bitwise, for any tiling and thread count —
batch-invariant like `linear.linear_rows`.

The format is a compile-time tag, the dtypes of the packed arrays (numba compiles one kernel per combination):
weight uint8 = Q8_0; weight int8-typed (nibble pairs) with scales uint16 (d as float16 bits) = Q4_0; weight
int8-typed with scales uint32 = Q4_1 (each uint32 only a container: viewed as uint16, a block's row holds for
run j the 16 outputs' d at [32 j .. 32 j + 15] and their m at [32 j + 16 .. 32 j + 31], float16 bits).

Why quantize the activations: multiplying float activations by widened weights costs 4-5 vector
instructions per 16 weights, which bound one thread well below the memory's speed; an 8-bit dot product
(AVX-512 VNNI's vpdpbusd: 64 multiply-adds in one instruction) makes the product memory-bound again.
The cost is accuracy: activations carry ~8 bits per run of 32 (`specserve bench quantization` measures it).

Tiles: 4 rows x 2 blocks share each weight load where AVX-512 VNNI's 32 registers hold their accumulators, and 2-3
rows (in all, or left over) take that pass too with the last row repeated (a pass costs about what a 1-row pass over
the tile does: one pass instead of one per row); on AVX2 (16 registers, `simd.PAIR_SUMS`) 4 rows x 1 block, with
4-bit weights summed in int16 pairs and 8-bit ones as signed products (`wdot`: the same integers, fewer
instructions), 2-3 rows in all taking that pass with the last row repeated, leftover rows one by one. A single row
takes the 1-row x 4-block pass. Each pass over a tile prefetches its share of the next tile line by line
(`fetch_pair`): a few-row pass computes long enough that the hardware prefetchers stop running ahead, and the weight
stream would otherwise wait for the arithmetic (`specserve bench verify` measures the floor these passes are held
to). The AVX2 pass sweeps one block at a time, so it fetches the next tile in address order instead
(`fetch_in_order`): fetched in its own strided order the stream ran at about half the sequential rate (the default
model's 1 + 3 verify rows 1.40-1.49x one row, now 1.17-1.19x). Integer sums are exact, so how rows and blocks are
grouped never changes a bit.

The stored weights are unsigned (vpdpbusd multiplies unsigned by signed bytes), offset by o: Σ (q + o) · qx =
Σ q · qx + o · Σ qx with o = 128 (Q8_0), 8 (Q4_0: the stored nibble is the signed weight + 8, as llama.cpp stores
it) or 0 (Q4_1: the stored nibble is q itself); o · Σ qx is subtracted before the conversion. Inputs are padded
to whole runs with zero weights (and x = 0: padding adds nothing, to S nor to Σ qx), outputs to whole tiles.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from specserve.kernels.quant_packing import (  # noqa: F401 (the packing API, re-exported: it lived here)
    GROUP, Q4_OFFSET, Q8_BLOCK, Q8_OFFSET, pack_q4, pack_q4_1, pack_q4_1_blocks, pack_q4_blocks, pack_q8,
    pack_q8_blocks, quantize_q4, quantize_q4_1, quantize_q8, unpack_q4, unpack_q4_1, unpack_q8,
)
from specserve.kernels.simd import (
    LANES, PAIR_SUMS, PREFETCH_ROWS, I16x32Type, prefetch, store_block_rows, store_lanes, store_row_blocks,
    vbroadcast, vbroadcast_bytes, vdot2_pairs, vdot4, vdot4_signed, vfma, vhigh_nibbles, visub_scalar, visum, vizero,
    vload, vload_bytes, vlow_nibbles, vmax_abs, vmul, vpairs_widen, vpairs_zero, vround_to_int, vstore_int8, vtofloat,
    vzero,
)


@numba.njit(boundscheck=False, cache=True)
def quantize_activations(x, runs):
    """Each row of x float32[M, in] as Q8_0 with float32 scales (llama.cpp keeps float16: float32 is a little
    closer, at no cost): per run j of 32, dx[m, j] = max|x| / 127 and qx = round(x / dx) (half away from zero)
    in int8[M, runs * 32] (padding inputs 0); sums[m, j] = Σ qx over the run (the kernel subtracts offset ·
    sums, what the weights' offset adds to each run's integer sum, and Q4_1 multiplies m by dx · sums: see the
    module docstring). Whole runs 16 lanes at a time, a short last run lane by lane;
    both compute the same values."""
    rows, num_in = x.shape
    qx = np.zeros((rows, runs * Q8_BLOCK), dtype=np.int8)
    dx = np.empty((rows, runs), dtype=np.float32)
    sums = np.empty((rows, runs), dtype=np.int32)
    whole = num_in // Q8_BLOCK  # runs of a full 32 inputs; a shorter last one goes lane by lane
    for m in range(rows):
        row, out = x[m], qx[m]
        for j in range(whole):
            start = j * Q8_BLOCK
            lo, hi = vload(row, start), vload(row, start + LANES)
            d = max(vmax_abs(lo), vmax_abs(hi)) / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            scale = vbroadcast(inv)
            q_lo, q_hi = vround_to_int(vmul(lo, scale)), vround_to_int(vmul(hi, scale))
            vstore_int8(out, start, q_lo)
            vstore_int8(out, start + LANES, q_hi)
            dx[m, j] = d
            sums[m, j] = visum(q_lo) + visum(q_hi)
        for j in range(whole, runs):
            start, stop = j * Q8_BLOCK, num_in
            amax = np.float32(0.0)
            for k in range(start, stop):
                amax = max(amax, abs(row[k]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            total = 0
            for k in range(start, stop):
                v = row[k] * inv
                q = int(math.floor(abs(v) + np.float32(0.5)))
                q = -q if v < 0 else q
                out[k] = q
                total += q
            dx[m, j] = d
            sums[m, j] = total
    return qx, dx, sums


def run_sum(acc, isum, total, offset, scales, lanes, j, dx):
    """acc after run j of one output block: isum the run's integer sums Σ stored q · qx (16 outputs), total = Σ qx
    (the row's `sums`), offset the stored weights' (`weight_offset`), scales the packed scales (only their dtype is
    read: the format's tag), lanes the block's row of `scale_lanes(scales)`, dx the row's activation scale — one FMA
    (Q8_0, Q4_0) or two (Q4_1) of the module docstring's chain."""
    raise NotImplementedError("runs inside numba kernels only")


def scale_lanes(scales):
    """The packed scales as float16 bits, uint16[blocks, lanes]: Q8_0's and Q4_0's as they are, Q4_1's uint32
    containers viewed once per call of the kernel. (Viewing a block's row inside `run_sum` made a new array each
    run: a reference-count call per run and block, and every accumulator spilled around it.)"""
    raise NotImplementedError("runs inside numba kernels only")


@overload(scale_lanes, inline="always")
def _scale_lanes(scales):
    if scales.dtype == types.uint32:
        return lambda scales: scales.view(np.uint16)
    return lambda scales: scales


def group_pair(w, p, stride, offset):
    """Groups 2p and 2p + 1 (inputs 8p .. 8p + 7) of one block as two vectors of unsigned bytes: Q8_0 loads
    them from two group slots, Q4_0 and Q4_1 from the low and high nibbles of one."""
    raise NotImplementedError("runs inside numba kernels only")


def weight_offset(w, scales):
    """What the stored unsigned weights are offset by: 128 (Q8_0), 8 (Q4_0), 0 (Q4_1)."""
    raise NotImplementedError("runs inside numba kernels only")


@overload(run_sum, inline="always")
def _run_sum(acc, isum, total, offset, scales, lanes, j, dx):
    if isinstance(isum, I16x32Type):  # AVX2 4-bit pair sums (`wzero`): widened to int32 once per run
        return lambda acc, isum, total, offset, scales, lanes, j, dx: run_sum(acc, vpairs_widen(isum), total, offset,
                                                                              scales, lanes, j, dx)
    if scales.dtype == types.uint32:  # Q4_1 (offset 0): d and m (float16 bits) of each run, 16 outputs each, in turn
        def q4_1(acc, isum, total, offset, scales, lanes, j, dx):
            d_term = vtofloat(visub_scalar(isum, offset * total))
            acc = vfma(d_term, vmul(vload(lanes, 2 * j * LANES), vbroadcast(dx)), acc)
            return vfma(vload(lanes, (2 * j + 1) * LANES), vbroadcast(dx * np.float32(total)), acc)
        return q4_1
    # Q8_0, Q4_0: acc + (S_j - offset · Σ qx) · (d_j · dx), S exact in int32, the scale product rounded once
    return lambda acc, isum, total, offset, scales, lanes, j, dx: vfma(
        vtofloat(visub_scalar(isum, offset * total)), vmul(vload(lanes, j * LANES), vbroadcast(dx)), acc)


@overload(group_pair, inline="always")
def _group_pair(w, p, stride, offset):
    if w.dtype == types.int8:  # Q4_0, Q4_1: nibble pairs (the dtype is only the format's tag)
        def q4(w, p, stride, offset):
            both = vload_bytes(w, p * stride + offset)
            return vlow_nibbles(both), vhigh_nibbles(both)
        return q4
    return lambda w, p, stride, offset: (vload_bytes(w, 2 * p * stride + offset),
                                         vload_bytes(w, (2 * p + 1) * stride + offset))


def fetch_pair(w_flat, start, p, stride, offset):
    """`prefetch` the lines `group_pair(w[tile], p, stride, offset)` reads, in the tile starting at w_flat[start]."""
    raise NotImplementedError("runs inside numba kernels only")


def fetch_in_order(w_flat, start, n):
    """`prefetch` the n-th of a tile's `group_pair` loads in address order (Q4_0, Q4_1: one 64-byte line; Q8_0: two),
    the tile starting at w_flat[start]: a few-row pass sweeping one block at a time fetches the next tile as one
    sequential stream (see the AVX2 pass in `linear_rows_quant`)."""
    raise NotImplementedError("runs inside numba kernels only")


@overload(fetch_in_order, inline="always")
def _fetch_in_order(w_flat, start, n):
    if w_flat.dtype == types.int8:
        return lambda w_flat, start, n: prefetch(w_flat, start + 64 * n)

    def q8(w_flat, start, n):
        prefetch(w_flat, start + 128 * n)
        prefetch(w_flat, start + 128 * n + 64)
    return q8


@overload(fetch_pair, inline="always")
def _fetch_pair(w_flat, start, p, stride, offset):
    if w_flat.dtype == types.int8:  # Q4_0, Q4_1: one 64-byte slot
        return lambda w_flat, start, p, stride, offset: prefetch(w_flat, start + p * stride + offset)

    def q8(w_flat, start, p, stride, offset):
        prefetch(w_flat, start + 2 * p * stride + offset)
        prefetch(w_flat, start + (2 * p + 1) * stride + offset)
    return q8


@overload(weight_offset, inline="always")
def _weight_offset(w, scales):
    if scales.dtype == types.uint32:
        return lambda w, scales: 0
    if w.dtype == types.int8:
        return lambda w, scales: Q4_OFFSET
    if PAIR_SUMS:  # AVX2's `vdot4_signed` takes Q8_0's offset out as it multiplies
        return lambda w, scales: 0
    return lambda w, scales: Q8_OFFSET


def wzero(w):
    """A zero accumulator of one run's integer sums (16 outputs): int32 lanes, or on AVX2 without VNNI for 4-bit
    weights int16 pair sums (`simd.vdot2_pairs`: a run is exactly the eight calls they hold; `run_sum` widens)."""
    raise NotImplementedError("runs inside numba kernels only")


def wdot(w, acc, a, b):
    """acc + the 4-byte dot products of weight bytes a (from `group_pair`) and activation bytes b, in the spelling
    the host does best (`simd`): VNNI's vpdpbusd; on AVX2, 4-bit nibbles (Q4_0, Q4_1: int8-typed w) as int16 pair
    sums and 8-bit weights signed (`weight_offset` is then 0). Every spelling gives the same exact integers."""
    raise NotImplementedError("runs inside numba kernels only")


@overload(wzero, inline="always")
def _wzero(w):
    if PAIR_SUMS and w.dtype == types.int8:
        return lambda w: vpairs_zero()
    return lambda w: vizero()


@overload(wdot, inline="always")
def _wdot(w, acc, a, b):
    if PAIR_SUMS:
        if w.dtype == types.int8:
            return lambda w, acc, a, b: vdot2_pairs(acc, a, b)
        return lambda w, acc, a, b: vdot4_signed(acc, a, b)
    return lambda w, acc, a, b: vdot4(acc, a, b)


@numba.njit(parallel=True, boundscheck=False, cache=True)
def linear_rows_quant(x, w, scales, bias, out, accumulate):
    """out[:, :out_features] (+)= x @ W^T + bias in the arithmetic above.

    x:       float32[M, in], rows C-contiguous.
    w:       [tiles, runs * 32 * tile_blocks * 16] uint8 (Q8_0: `pack_q8_blocks`) or [tiles, runs * 16 * tile_blocks
             * 16] int8-typed nibble pairs (Q4_0: `pack_q4_blocks`, Q4_1: `pack_q4_1_blocks`).
    scales:  uint16[tiles * tile_blocks, runs * 16] (Q8_0, Q4_0: d) or uint32[.., runs * 16] (Q4_1: d and m).
    bias:    float32[tiles * tile_blocks * 16]; out: float32[M, out_features], C-contiguous.
    """
    num_rows = x.shape[0]
    num_tiles = w.shape[0]
    runs = scales.shape[1] // LANES
    tb = scales.shape[0] // num_tiles  # blocks per tile
    qx, dx, sums = quantize_activations(x, runs)
    offset = weight_offset(w, scales)
    lanes = scale_lanes(scales)
    num_blocks = (out.shape[1] + LANES - 1) // LANES  # real blocks: the last tile's padding is skipped
    w_flat = w.reshape(-1)
    for tile in prange(num_tiles):  # (the index as int64: numba types it uint64 inside its parallel loop)
        _quant_tile(np.int64(tile), w, w_flat, scales, bias, out, accumulate, qx, dx, sums, offset, lanes, tb, runs, num_blocks)


@numba.njit(boundscheck=False, cache=True)
def _quant_tile(tile, w, w_flat, scales, bias, out, accumulate, qx, dx, sums, offset, lanes, tb, runs, num_blocks):
    """`linear_rows_quant`'s work on one tile (its blocks of 16 outputs, every row), a function of its own: numba's
    parallel passes then see a one-call loop body (compiling the body inline in the parallel loop cost ~20 s more
    per weight type, most of it in those passes)."""
    num_rows = qx.shape[0]
    num_tiles = w.shape[0]
    pairs_per_run = Q8_BLOCK // (2 * GROUP)
    block_bytes = GROUP * LANES  # one slot of one block: 4 inputs x 16 outputs (Q4_0, Q4_1: 8 inputs)
    stride = tb * block_bytes  # from one slot of a tile to the next
    tile_len = w.shape[1]
    wt = w[tile]
    first = tile * tb
    count = min(num_blocks, first + tb) - first
    m = 0
    # Where the next tile starts in w_flat while this tile's first pass fetches it (`prefetch`); -1 once done.
    ahead = (tile + 1) * tile_len if tile + 1 < num_tiles and num_rows <= PREFETCH_ROWS else -1
    # AVX2: 4 rows x 1 block, the accumulators fit 16 registers. 2-3 rows in all take the same pass with the last
    # row repeated and only the real rows stored: from memory it costs about one 1-row pass (measured: 2 / 3 rows
    # 1.15 / 1.37x faster than a pass per row). Rows left over after a 4-row pass go one by one: the tile is then
    # in the cache, where a repeated-row pass computes more than it saves (6 rows 0.83x).
    while PAIR_SUMS and (num_rows - m >= 4 or (m == 0 and num_rows >= 2)):
        valid = min(4, num_rows - m)
        r1, r2, r3 = m + 1, m + min(2, valid - 1), m + min(3, valid - 1)
        x0, x1, x2, x3 = qx[m], qx[r1], qx[r2], qx[r3]
        for i in range(count):
            s0 = lanes[first + i]
            a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
            fetched = i * runs * pairs_per_run  # this sweep's share of the next tile, in address order
            for j in range(runs):
                i0 = wzero(wt); i1 = wzero(wt); i2 = wzero(wt); i3 = wzero(wt)
                for p in range(j * pairs_per_run, (j + 1) * pairs_per_run):
                    if ahead >= 0:
                        fetch_in_order(w_flat, ahead, fetched + p)
                    u, u2 = group_pair(wt, p, stride, i * block_bytes)
                    g = 2 * p * GROUP
                    i0 = wdot(wt, i0, u, vbroadcast_bytes(x0, g)); i1 = wdot(wt, i1, u, vbroadcast_bytes(x1, g))
                    i2 = wdot(wt, i2, u, vbroadcast_bytes(x2, g)); i3 = wdot(wt, i3, u, vbroadcast_bytes(x3, g))
                    g += GROUP
                    i0 = wdot(wt, i0, u2, vbroadcast_bytes(x0, g)); i1 = wdot(wt, i1, u2, vbroadcast_bytes(x1, g))
                    i2 = wdot(wt, i2, u2, vbroadcast_bytes(x2, g)); i3 = wdot(wt, i3, u2, vbroadcast_bytes(x3, g))
                a0 = run_sum(a0, i0, sums[m, j], offset, scales, s0, j, dx[m, j])
                a1 = run_sum(a1, i1, sums[r1, j], offset, scales, s0, j, dx[r1, j])
                a2 = run_sum(a2, i2, sums[r2, j], offset, scales, s0, j, dx[r2, j])
                a3 = run_sum(a3, i3, sums[r3, j], offset, scales, s0, j, dx[r3, j])
            store_block_rows(out, m, (first + i) * LANES, a0, a1, a2, a3, bias, accumulate, valid)
        ahead = -1
        m += valid
    # VNNI: 4 rows x 2 blocks, each weight load feeding 4 dot products. Two or three rows left over (or in all)
    # take the same pass with the last row repeated and only the real rows stored: it costs about what one 1-row
    # pass over the tile does. A single row left over (or in all) takes the 1-row pass below. Every pass fetches
    # its share of the next tile (a 1/passes range of its pairs), so the weight stream overlaps the
    # arithmetic of every pass, not only the first one's.
    passes = 1 if PAIR_SUMS else num_rows // 4 + (num_rows % 4 + 2) // 4 + (1 if num_rows % 4 == 1 else 0)
    pairs = runs * pairs_per_run
    share = 0  # this pass fetches the pairs fetch_from <= p < fetch_to (a comparison: no division per step)
    fetch_from, fetch_to = 0, -(-pairs // passes)
    while not PAIR_SUMS and num_rows - m >= 2:
        valid = min(4, num_rows - m)
        r1, r2, r3 = m + min(1, valid - 1), m + min(2, valid - 1), m + min(3, valid - 1)
        x0, x1, x2, x3 = qx[m], qx[r1], qx[r2], qx[r3]
        i = 0
        while i < count:
            pair = i + 1 < count
            s0 = lanes[first + i]
            s1 = lanes[first + i + 1] if pair else s0
            o1 = (i + 1) * block_bytes if pair else i * block_bytes
            a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
            c0 = vzero(); c1 = vzero(); c2 = vzero(); c3 = vzero()
            for j in range(runs):
                i0 = wzero(wt); i1 = wzero(wt); i2 = wzero(wt); i3 = wzero(wt)
                k0 = wzero(wt); k1 = wzero(wt); k2 = wzero(wt); k3 = wzero(wt)
                for p in range(j * pairs_per_run, (j + 1) * pairs_per_run):
                    if ahead >= 0 and fetch_from <= p < fetch_to:
                        fetch_pair(w_flat, ahead, p, stride, i * block_bytes)
                        if pair:
                            fetch_pair(w_flat, ahead, p, stride, o1)
                    u, u2 = group_pair(wt, p, stride, i * block_bytes)
                    v, v2 = group_pair(wt, p, stride, o1)
                    g = 2 * p * GROUP
                    s = vbroadcast_bytes(x0, g); i0 = wdot(wt, i0, u, s); k0 = wdot(wt, k0, v, s)
                    s = vbroadcast_bytes(x1, g); i1 = wdot(wt, i1, u, s); k1 = wdot(wt, k1, v, s)
                    s = vbroadcast_bytes(x2, g); i2 = wdot(wt, i2, u, s); k2 = wdot(wt, k2, v, s)
                    s = vbroadcast_bytes(x3, g); i3 = wdot(wt, i3, u, s); k3 = wdot(wt, k3, v, s)
                    g += GROUP
                    s = vbroadcast_bytes(x0, g); i0 = wdot(wt, i0, u2, s); k0 = wdot(wt, k0, v2, s)
                    s = vbroadcast_bytes(x1, g); i1 = wdot(wt, i1, u2, s); k1 = wdot(wt, k1, v2, s)
                    s = vbroadcast_bytes(x2, g); i2 = wdot(wt, i2, u2, s); k2 = wdot(wt, k2, v2, s)
                    s = vbroadcast_bytes(x3, g); i3 = wdot(wt, i3, u2, s); k3 = wdot(wt, k3, v2, s)
                t0, t1, t2, t3 = sums[m, j], sums[r1, j], sums[r2, j], sums[r3, j]
                a0 = run_sum(a0, i0, t0, offset, scales, s0, j, dx[m, j]); c0 = run_sum(c0, k0, t0, offset, scales, s1, j, dx[m, j])
                a1 = run_sum(a1, i1, t1, offset, scales, s0, j, dx[r1, j]); c1 = run_sum(c1, k1, t1, offset, scales, s1, j, dx[r1, j])
                a2 = run_sum(a2, i2, t2, offset, scales, s0, j, dx[r2, j]); c2 = run_sum(c2, k2, t2, offset, scales, s1, j, dx[r2, j])
                a3 = run_sum(a3, i3, t3, offset, scales, s0, j, dx[r3, j]); c3 = run_sum(c3, k3, t3, offset, scales, s1, j, dx[r3, j])
            base = (first + i) * LANES
            store_block_rows(out, m, base, a0, a1, a2, a3, bias, accumulate, valid)
            if pair:
                base += LANES
                store_block_rows(out, m, base, c0, c1, c2, c3, bias, accumulate, valid)
            i += 2
        m += 4
        share += 1
        fetch_from, fetch_to = share * pairs // passes, (share + 1) * pairs // passes
    while m < num_rows:  # one row x 4 blocks (else 2, 1): independent chains, the tile read in order
        xr = qx[m]
        i = 0
        if count == 4:
            s0, s1, s2, s3 = lanes[first], lanes[first + 1], lanes[first + 2], lanes[first + 3]
            a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
            for j in range(runs):
                i0 = wzero(wt); i1 = wzero(wt); i2 = wzero(wt); i3 = wzero(wt)
                for p in range(j * pairs_per_run, (j + 1) * pairs_per_run):
                    s = vbroadcast_bytes(xr, 2 * p * GROUP)
                    t = vbroadcast_bytes(xr, (2 * p + 1) * GROUP)
                    if ahead >= 0 and fetch_from <= p < fetch_to:
                        for b in range(4):
                            fetch_pair(w_flat, ahead, p, stride, b * block_bytes)
                    u, u2 = group_pair(wt, p, stride, 0)
                    i0 = wdot(wt, wdot(wt, i0, u, s), u2, t)
                    u, u2 = group_pair(wt, p, stride, block_bytes)
                    i1 = wdot(wt, wdot(wt, i1, u, s), u2, t)
                    u, u2 = group_pair(wt, p, stride, 2 * block_bytes)
                    i2 = wdot(wt, wdot(wt, i2, u, s), u2, t)
                    u, u2 = group_pair(wt, p, stride, 3 * block_bytes)
                    i3 = wdot(wt, wdot(wt, i3, u, s), u2, t)
                t = sums[m, j]
                a0 = run_sum(a0, i0, t, offset, scales, s0, j, dx[m, j])
                a1 = run_sum(a1, i1, t, offset, scales, s1, j, dx[m, j])
                a2 = run_sum(a2, i2, t, offset, scales, s2, j, dx[m, j])
                a3 = run_sum(a3, i3, t, offset, scales, s3, j, dx[m, j])
            base = first * LANES
            store_row_blocks(out, m, base, a0, a1, a2, a3, bias, accumulate)
            i = 4
        if i + 2 <= count:
            s0, s1 = lanes[first + i], lanes[first + i + 1]
            a0 = vzero(); a1 = vzero()
            for j in range(runs):
                i0 = wzero(wt); i1 = wzero(wt)
                for p in range(j * pairs_per_run, (j + 1) * pairs_per_run):
                    s = vbroadcast_bytes(xr, 2 * p * GROUP)
                    t = vbroadcast_bytes(xr, (2 * p + 1) * GROUP)
                    if ahead >= 0 and fetch_from <= p < fetch_to:
                        fetch_pair(w_flat, ahead, p, stride, i * block_bytes)
                        fetch_pair(w_flat, ahead, p, stride, (i + 1) * block_bytes)
                    u, u2 = group_pair(wt, p, stride, i * block_bytes)
                    i0 = wdot(wt, wdot(wt, i0, u, s), u2, t)
                    u, u2 = group_pair(wt, p, stride, (i + 1) * block_bytes)
                    i1 = wdot(wt, wdot(wt, i1, u, s), u2, t)
                t = sums[m, j]
                a0 = run_sum(a0, i0, t, offset, scales, s0, j, dx[m, j])
                a1 = run_sum(a1, i1, t, offset, scales, s1, j, dx[m, j])
            store_lanes(out, m, (first + i) * LANES, a0, bias, accumulate)
            store_lanes(out, m, (first + i + 1) * LANES, a1, bias, accumulate)
            i += 2
        while i < count:
            s0 = lanes[first + i]
            a0 = vzero()
            for j in range(runs):
                i0 = wzero(wt)
                for p in range(j * pairs_per_run, (j + 1) * pairs_per_run):
                    u, u2 = group_pair(wt, p, stride, i * block_bytes)
                    i0 = wdot(wt, wdot(wt, i0, u, vbroadcast_bytes(xr, 2 * p * GROUP)), u2,
                               vbroadcast_bytes(xr, (2 * p + 1) * GROUP))
                a0 = run_sum(a0, i0, sums[m, j], offset, scales, s0, j, dx[m, j])
            store_lanes(out, m, (first + i) * LANES, a0, bias, accumulate)
            i += 1
        ahead = -1
        m += 1
