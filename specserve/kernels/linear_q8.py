"""8-bit products on the CPU: llama.cpp's Q8_0 weights times 8-bit activations, summed in integers.

Format (`quantize_q8`): per output row, each run of 32 inputs shares one scale d = max|w| / 127 kept as
float16, and w ≈ q · d with q = round(w / d) in [-127, 127] — llama.cpp's Q8_0, 8.5 bits a weight.

Arithmetic (`linear_rows_q8`), as llama.cpp's q8_0 × q8_0 dot product does it: each row of x is quantized
the same way per run of 32 (`quantize_activations`: scale dx float32, qx int8), then for every output o,
row m and run j the integer sum S = Σ_k q[o, k] · qx[m, k] is exact in int32, and the float result is ONE
fused multiply-add chain over the runs, acc = fma(float(S_j), d_j · dx_j, acc), j = 0, 1, ..., from zero,
then + bias (then + the old value when accumulating). Integer sums have no order to vary and the chain's
order is fixed, so row r of a k-row product equals the 1-row product bitwise, for any tiling and thread
count — batch-invariant like `linear.linear_rows`.

Why quantize the activations: multiplying float activations by widened weights costs 4-5 vector
instructions per 16 weights, which bound one thread well below the memory's speed; an 8-bit dot product
(AVX-512 VNNI's vpdpbusd: 64 multiply-adds in one instruction) makes the product memory-bound again.
The cost is accuracy: activations carry ~8 bits per run of 32 (BENCHMARKS.md "8-bit weights" measures it).

Layout (`pack_q8`): weights are stored as unsigned bytes q + 128 in `linear`'s tiles (blocks of 16
outputs, `tile_blocks` blocks a tile, each tile one sequential stream), in groups of 4 consecutive
inputs: ``packed[t, (g * tb + i) * 64 + l * 4 + c] = q[16 (t * tb + i) + l, 4 g + c] + 128`` — one 64-byte
load is 4 inputs of 16 outputs, the shape vpdpbusd multiplies (unsigned by signed bytes). The +128 makes
the weights unsigned; Σ (q + 128) · qx = Σ q · qx + 128 · Σ qx, and 128 · Σ qx is one integer per row
and run (`quantize_activations` returns it), subtracted before the conversion. Inputs are padded to
whole runs with q = 0 (and x = 0), outputs to whole tiles.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import prange

from specserve.kernels.simd import (
    LANES, store_lanes, vbroadcast, vbroadcast_bytes, vdot4, vfma, visum, vizero, visub_scalar, vload,
    vload_bytes, vmax_abs, vmul, vround_to_int, vstore_int8, vtofloat, vzero,
)

Q8_BLOCK = 32  # inputs sharing one scale (llama.cpp's QK8_0)
GROUP = 4  # inputs per int32 lane of one 8-bit dot product
WEIGHT_OFFSET = 128  # stored weight byte = q + 128 (unsigned)


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of w [out, in] (any float dtype): per output row and run of 32 inputs (the last run
    may be shorter), d = max|w| / 127 and q = round(w / d) (half away from zero, as roundf), clamped to
    ±127; d is stored as float16, as Q8_0 stores it. Returns (q int8[out, in], d float16[out, ceil(in/32)])."""
    w = w.detach().to("cpu", torch.float32)
    out_features, in_features = w.shape
    kblocks = -(-in_features // Q8_BLOCK)
    padded = torch.zeros(out_features, kblocks * Q8_BLOCK)
    padded[:, :in_features] = w
    runs = padded.view(out_features, kblocks, Q8_BLOCK)
    d = runs.abs().amax(dim=2) / 127.0  # float32, as llama.cpp computes it
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = runs * inv[:, :, None]
    q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    return q.view(out_features, kblocks * Q8_BLOCK)[:, :in_features].contiguous(), d.to(torch.float16)


def pack_q8(w: torch.Tensor, tile_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (weight uint8[tiles, runs * 32 * tile_blocks * 16], scales uint16[tiles * tile_blocks,
    runs * 16]) in the layout above; scales[b, j * 16 + l] holds output 16 b + l's float16 scale of run j,
    as bits."""
    out_features, in_features = w.shape
    rows = -(-out_features // (LANES * tile_blocks)) * LANES * tile_blocks
    tiles = rows // (LANES * tile_blocks)
    q, d = quantize_q8(w)
    runs = d.shape[1]
    padded_in = runs * Q8_BLOCK
    qp = torch.zeros(rows, padded_in, dtype=torch.int16)
    qp[:out_features, :in_features] = q.to(torch.int16)
    stored = (qp + WEIGHT_OFFSET).to(torch.uint8).view(tiles, tile_blocks, LANES, padded_in // GROUP, GROUP)
    weight = stored.permute(0, 3, 1, 2, 4).reshape(tiles, padded_in * tile_blocks * LANES).contiguous().numpy()
    dp = torch.zeros(rows, runs, dtype=torch.float16)
    dp[:out_features] = d
    scales = dp.view(rows // LANES, LANES, runs).transpose(1, 2).reshape(rows // LANES, runs * LANES).contiguous()
    return weight, scales.view(torch.int16).numpy().view(np.uint16)


def unpack_q8(weight: np.ndarray, scales: np.ndarray, tile_blocks: int, out_features: int, in_features: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_q8`'s inverse: (q int8[out, in], d float16[out, runs])."""
    tiles, blocks = weight.shape[0], scales.shape[0]
    runs = scales.shape[1] // LANES
    q = torch.from_numpy(weight).view(tiles, runs * Q8_BLOCK // GROUP, tile_blocks, LANES, GROUP)
    q = q.permute(0, 2, 3, 1, 4).reshape(blocks * LANES, runs * Q8_BLOCK)
    q = (q.to(torch.int16) - WEIGHT_OFFSET).to(torch.int8)
    d = torch.from_numpy(scales.view(np.int16)).view(torch.float16).view(blocks, runs, LANES).transpose(1, 2)
    return q[:out_features, :in_features].contiguous(), d.reshape(blocks * LANES, runs)[:out_features].contiguous()


@numba.njit(boundscheck=False, cache=True)
def quantize_activations(x, runs):
    """Each row of x float32[M, in] as Q8_0 with float32 scales (llama.cpp keeps float16: float32 is a little
    closer, at no cost): per run j of 32, dx[m, j] = max|x| / 127 and qx = round(x / dx) (half away from zero)
    in int8[M, runs * 32] (padding inputs 0); correction[m, j] = 128 · Σ qx over the run (the +128 weight
    offset's share, see the module docstring). Whole runs 16 lanes at a time, a short last run lane by lane;
    both compute the same values."""
    rows, num_in = x.shape
    qx = np.zeros((rows, runs * Q8_BLOCK), dtype=np.int8)
    dx = np.empty((rows, runs), dtype=np.float32)
    correction = np.empty((rows, runs), dtype=np.int32)
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
            correction[m, j] = WEIGHT_OFFSET * (visum(q_lo) + visum(q_hi))
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
            correction[m, j] = WEIGHT_OFFSET * total
    return qx, dx, correction


@numba.njit(inline="always")
def _run_sum(acc, isum, correction, scales, j, dx):
    """acc + (S_j - correction) · (d_j · dx): one run's FMA (S exact in int32; the scale product rounded once)."""
    return vfma(vtofloat(visub_scalar(isum, correction)), vmul(vload(scales, j * LANES), vbroadcast(dx)), acc)


@numba.njit(parallel=True, boundscheck=False, cache=True)
def linear_rows_q8(x, w, scales, bias, out, accumulate):
    """out[:, :out_features] (+)= x @ W^T + bias in the arithmetic above.

    x:       float32[M, in], rows C-contiguous.
    w:       uint8[tiles, runs * 32 * tile_blocks * 16], scales: uint16[tiles * tile_blocks, runs * 16]
             (`pack_q8`).
    bias:    float32[tiles * tile_blocks * 16]; out: float32[M, out_features], C-contiguous.
    """
    num_rows = x.shape[0]
    num_tiles = w.shape[0]
    runs = scales.shape[1] // LANES
    tb = scales.shape[0] // num_tiles  # blocks per tile
    qx, dx, correction = quantize_activations(x, runs)
    groups_per_run = Q8_BLOCK // GROUP
    block_bytes = GROUP * LANES  # one group of one block: 4 inputs x 16 outputs
    stride = tb * block_bytes  # from one group of a tile to the next
    num_blocks = (out.shape[1] + LANES - 1) // LANES  # real blocks: the last tile's padding is skipped
    for tile in prange(num_tiles):
        wt = w[tile]
        first = tile * tb
        count = min(num_blocks, first + tb) - first
        m = 0
        while m + 4 <= num_rows:  # 4 rows x 2 blocks: each weight load feeds 4 dot products
            x0, x1, x2, x3 = qx[m], qx[m + 1], qx[m + 2], qx[m + 3]
            i = 0
            while i < count:
                pair = i + 1 < count
                s0 = scales[first + i]
                s1 = scales[first + i + 1] if pair else s0
                o1 = (i + 1) * block_bytes if pair else i * block_bytes
                a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
                c0 = vzero(); c1 = vzero(); c2 = vzero(); c3 = vzero()
                for j in range(runs):
                    i0 = vizero(); i1 = vizero(); i2 = vizero(); i3 = vizero()
                    k0 = vizero(); k1 = vizero(); k2 = vizero(); k3 = vizero()
                    for g in range(j * groups_per_run, (j + 1) * groups_per_run):
                        u = vload_bytes(wt, g * stride + i * block_bytes)
                        v = vload_bytes(wt, g * stride + o1)
                        s = vbroadcast_bytes(x0, g * GROUP); i0 = vdot4(i0, u, s); k0 = vdot4(k0, v, s)
                        s = vbroadcast_bytes(x1, g * GROUP); i1 = vdot4(i1, u, s); k1 = vdot4(k1, v, s)
                        s = vbroadcast_bytes(x2, g * GROUP); i2 = vdot4(i2, u, s); k2 = vdot4(k2, v, s)
                        s = vbroadcast_bytes(x3, g * GROUP); i3 = vdot4(i3, u, s); k3 = vdot4(k3, v, s)
                    a0 = _run_sum(a0, i0, correction[m, j], s0, j, dx[m, j])
                    a1 = _run_sum(a1, i1, correction[m + 1, j], s0, j, dx[m + 1, j])
                    a2 = _run_sum(a2, i2, correction[m + 2, j], s0, j, dx[m + 2, j])
                    a3 = _run_sum(a3, i3, correction[m + 3, j], s0, j, dx[m + 3, j])
                    c0 = _run_sum(c0, k0, correction[m, j], s1, j, dx[m, j])
                    c1 = _run_sum(c1, k1, correction[m + 1, j], s1, j, dx[m + 1, j])
                    c2 = _run_sum(c2, k2, correction[m + 2, j], s1, j, dx[m + 2, j])
                    c3 = _run_sum(c3, k3, correction[m + 3, j], s1, j, dx[m + 3, j])
                base = (first + i) * LANES
                store_lanes(out, m, base, a0, bias, accumulate); store_lanes(out, m + 1, base, a1, bias, accumulate)
                store_lanes(out, m + 2, base, a2, bias, accumulate); store_lanes(out, m + 3, base, a3, bias, accumulate)
                if pair:
                    base += LANES
                    store_lanes(out, m, base, c0, bias, accumulate); store_lanes(out, m + 1, base, c1, bias, accumulate)
                    store_lanes(out, m + 2, base, c2, bias, accumulate); store_lanes(out, m + 3, base, c3, bias, accumulate)
                i += 2
            m += 4
        while m < num_rows:  # one row x 4 blocks (else one by one): independent chains, the tile read in order
            xr = qx[m]
            i = 0
            if count == 4:
                s0, s1, s2, s3 = scales[first], scales[first + 1], scales[first + 2], scales[first + 3]
                a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
                for j in range(runs):
                    i0 = vizero(); i1 = vizero(); i2 = vizero(); i3 = vizero()
                    for g in range(j * groups_per_run, (j + 1) * groups_per_run):
                        s = vbroadcast_bytes(xr, g * GROUP)
                        o = g * stride
                        i0 = vdot4(i0, vload_bytes(wt, o), s)
                        i1 = vdot4(i1, vload_bytes(wt, o + block_bytes), s)
                        i2 = vdot4(i2, vload_bytes(wt, o + 2 * block_bytes), s)
                        i3 = vdot4(i3, vload_bytes(wt, o + 3 * block_bytes), s)
                    a0 = _run_sum(a0, i0, correction[m, j], s0, j, dx[m, j])
                    a1 = _run_sum(a1, i1, correction[m, j], s1, j, dx[m, j])
                    a2 = _run_sum(a2, i2, correction[m, j], s2, j, dx[m, j])
                    a3 = _run_sum(a3, i3, correction[m, j], s3, j, dx[m, j])
                base = first * LANES
                store_lanes(out, m, base, a0, bias, accumulate)
                store_lanes(out, m, base + LANES, a1, bias, accumulate)
                store_lanes(out, m, base + 2 * LANES, a2, bias, accumulate)
                store_lanes(out, m, base + 3 * LANES, a3, bias, accumulate)
                i = 4
            if i + 2 <= count:
                s0, s1 = scales[first + i], scales[first + i + 1]
                a0 = vzero(); a1 = vzero()
                for j in range(runs):
                    i0 = vizero(); i1 = vizero()
                    for g in range(j * groups_per_run, (j + 1) * groups_per_run):
                        s = vbroadcast_bytes(xr, g * GROUP)
                        o = g * stride + i * block_bytes
                        i0 = vdot4(i0, vload_bytes(wt, o), s)
                        i1 = vdot4(i1, vload_bytes(wt, o + block_bytes), s)
                    a0 = _run_sum(a0, i0, correction[m, j], s0, j, dx[m, j])
                    a1 = _run_sum(a1, i1, correction[m, j], s1, j, dx[m, j])
                store_lanes(out, m, (first + i) * LANES, a0, bias, accumulate)
                store_lanes(out, m, (first + i + 1) * LANES, a1, bias, accumulate)
                i += 2
            while i < count:
                s0 = scales[first + i]
                a0 = vzero()
                for j in range(runs):
                    i0 = vizero()
                    for g in range(j * groups_per_run, (j + 1) * groups_per_run):
                        i0 = vdot4(i0, vload_bytes(wt, g * stride + i * block_bytes), vbroadcast_bytes(xr, g * GROUP))
                    a0 = _run_sum(a0, i0, correction[m, j], s0, j, dx[m, j])
                store_lanes(out, m, (first + i) * LANES, a0, bias, accumulate)
                i += 1
            m += 1
