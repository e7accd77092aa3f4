"""Batch-invariant products on the CPU: ``out = x @ W^T + bias`` for any number of rows.

Layout (`PackedLinear`): W [out, in] is stored as blocks of 16 output rows, each block k-major —
``packed[b, k * 16 + l] = W[16 b + l, k]`` — so one vector load brings input k's weights for 16
outputs, and a block streams through memory in order.

Arithmetic (`linear_rows`): every output element is ONE fused multiply-add chain over k = 0, 1, ...,
in - 1, starting from zero, then + bias (then + the old value when accumulating into a residual).
The lanes of a vector are 16 different outputs, never partial sums of one output, so no horizontal
reduction exists whose order could vary. How rows and outputs are tiled (4 rows x 2 blocks, 1 row x 4
blocks, ...) and how tiles are spread over threads changes which elements are computed together, never
how one element is computed: row r of a k-row product equals the 1-row product bitwise, for any k and
any thread count. That is what lets greedy speculative decoding equal plain decoding exactly.

Speed: one broadcast input value feeds up to 8 vector FMAs (4 rows x 2 blocks), so many-row products
(prefill chunks, verify trees) run near the FMA units' rate, while one row streams each weight once
(decode is memory-bound). Half-size weights (bfloat16 bits or float16) are widened as they load;
int8 weights (llama.cpp's Q8_0 layout: `quantize_q8`) are widened and multiplied by their run's float16
scale as they load — q · d is exact in float32, so an int8 product is the same single FMA chain over the
dequantized weights, batch-invariant like the others.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from numba import types
from numba.extending import overload

from specserve.kernels.simd import LANES, vadd, vbroadcast, vfma, vlane, vload, vmul, vstore, vzero

# Products at least this many 16-wide blocks (1024 outputs) use 4-block tiles: 16+ tiles, even for 4 threads.
WIDE_PRODUCT_BLOCKS = 64



class PackedLinear:
    """A weight [out, in] (and optional bias [out]) packed for `linear_rows`.

    storage: "float32", "bfloat16" (kept as int16 bits; rounded to nearest even from the source),
    "float16" (kept as uint16 bits) or "int8" (`quantize_q8`: llama.cpp's Q8_0 — per output row, each run of
    32 inputs shares one float16 scale d = max|w| / 127, and w ≈ q·d with q = round(w / d) in [-127, 127]).
    `scales` holds int8's scales as float16 bits, uint16[blocks, ceil(in / 32) * 16] (scales[b, j * 16 + l]:
    output 16 b + l, inputs 32 j ..), and is empty [blocks, 0] for the other storages. The bias stays
    float32 (zeros when there is none: adding 0.0 changes nothing).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, storage: str = "float32") -> None:
        if weight.dim() != 2:
            raise ValueError(f"a linear weight must be 2-D [out, in], got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        blocks = -(-out_features // LANES)
        padded = torch.zeros(blocks * LANES, in_features, dtype=torch.float32)
        padded[:out_features] = weight.detach().to("cpu", torch.float32)
        packed = padded.view(blocks, LANES, in_features).transpose(1, 2).reshape(blocks, in_features * LANES)
        if storage == "float32":
            self.weight = packed.contiguous().numpy()
        elif storage == "bfloat16":
            self.weight = packed.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        elif storage == "float16":  # kept as uint16 bits: see simd.vload
            self.weight = packed.to(torch.float16).contiguous().view(torch.int16).numpy().view(np.uint16)
        elif storage == "int8":
            q, d = quantize_q8(padded)  # int8[blocks*16, in], float16[blocks*16, ceil(in/32)]
            self.weight = q.view(blocks, LANES, in_features).transpose(1, 2).reshape(blocks, in_features * LANES) \
                .contiguous().numpy()
            kblocks = d.shape[1]
            self.scales = d.view(blocks, LANES, kblocks).transpose(1, 2).reshape(blocks, kblocks * LANES) \
                .contiguous().view(torch.int16).numpy().view(np.uint16)
        else:
            raise ValueError(f"weight storage must be float32, bfloat16, float16 or int8, got {storage!r}")
        if storage != "int8":
            self.scales = np.zeros((blocks, 0), dtype=np.uint16)
        self.bias = np.zeros(blocks * LANES, dtype=np.float32)
        if bias is not None:
            self.bias[:out_features] = bias.detach().to("cpu", torch.float32).numpy()
        self.out_features, self.in_features, self.storage = out_features, in_features, storage

    @property
    def nbytes(self) -> int:
        """Bytes streamed by one product (the weight and int8's scales; padding rows included)."""
        return self.weight.nbytes + self.scales.nbytes

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] the kernel multiplies by, float32 (int8: q · d, exact in float32)."""
        blocks = self.weight.shape[0]
        if self.storage == "int8":
            kblocks = self.scales.shape[1] // LANES
            q = torch.from_numpy(self.weight).view(blocks, self.in_features, LANES).transpose(1, 2).float()
            d = torch.from_numpy(self.scales.view(np.int16)).view(torch.float16).view(blocks, kblocks, LANES)
            d = d.transpose(1, 2).float().repeat_interleave(Q8_BLOCK, dim=2)[:, :, :self.in_features]
            w = q * d
        else:
            raw = torch.from_numpy(self.weight.view(np.int16) if self.weight.dtype == np.uint16 else self.weight)
            w = {"float32": raw, "bfloat16": raw.view(torch.bfloat16), "float16": raw.view(torch.float16)}[self.storage]
            w = w.float().view(blocks, self.in_features, LANES).transpose(1, 2)
        return w.reshape(blocks * LANES, self.in_features)[:self.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32[..., in] (CPU) -> float32[..., out]: a convenience for heads outside a fused layer."""
        rows = np.ascontiguousarray(as_numpy(x).reshape(-1, self.in_features))
        out = np.empty((rows.shape[0], self.out_features), dtype=np.float32)
        linear_rows(rows, self.weight, self.scales, self.bias, out, False)
        return torch.from_numpy(out).view(*x.shape[:-1], self.out_features)


Q8_BLOCK = 32  # inputs sharing one scale (llama.cpp's QK8_0)


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


def as_numpy(x: torch.Tensor) -> np.ndarray:
    """A float32 CPU tensor's numpy view (no copy, no torch op), converting only what must be converted."""
    if x.dtype is not torch.float32 or x.requires_grad:
        x = x.detach().to(torch.float32)
    return x.numpy()


def run_length(w, num_in):
    """How many consecutive inputs share scales: Q8_BLOCK for int8, all of them otherwise."""
    raise NotImplementedError("runs inside numba kernels only")


def run_scales(w, s, k):
    """The scales of the run holding input k as lanes (int8: s[(k // 32) * 16 ..]); unused lanes otherwise."""
    raise NotImplementedError("runs inside numba kernels only")


def run_load(w, d, k):
    """Input k's weights for a block's 16 outputs as float32 lanes: w[k*16 : k*16+16] widened, times the
    run's scales d for int8 (q · d is exact in float32: 8 by 11 significant bits), so every storage feeds the
    same one-FMA-per-input chain. A loop over one run loads d once (`run_scales`); `wload` per input."""
    raise NotImplementedError("runs inside numba kernels only")


@overload(run_length, inline="always")
def _run_length(w, num_in):
    if w.dtype == types.int8:
        return lambda w, num_in: Q8_BLOCK
    return lambda w, num_in: max(num_in, 1)


@overload(run_scales, inline="always")
def _run_scales(w, s, k):
    if w.dtype == types.int8:
        return lambda w, s, k: vload(s, (k // Q8_BLOCK) * LANES)
    return lambda w, s, k: vzero()


@overload(run_load, inline="always")
def _run_load(w, d, k):
    if w.dtype == types.int8:
        return lambda w, d, k: vmul(vload(w, k * LANES), d)
    return lambda w, d, k: vload(w, k * LANES)


@numba.njit(inline="always")
def wload(w, s, k):
    """`run_load` of input k with its run's scales loaded on the spot (the multi-row tiles, where one scale
    load feeds 2-4 rows' FMAs)."""
    return run_load(w, run_scales(w, s, k), k)


@numba.njit(inline="always")
def _finish(out, m, base, acc, bias, accumulate):
    """out[m, base : base + 16] (+)= acc + bias[base : base + 16], only the lanes inside `out`."""
    result = vadd(acc, vload(bias, base))
    row = out[m]
    if base + LANES <= out.shape[1]:
        if accumulate:
            result = vadd(vload(row, base), result)
        vstore(row, base, result)
    else:
        for lane in range(out.shape[1] - base):
            value = vlane(result, lane)
            row[base + lane] = row[base + lane] + value if accumulate else value


@numba.njit(parallel=True, boundscheck=False, cache=True)
def linear_rows(x, w, scales, bias, out, accumulate):
    """out[:, :out_features] (+)= x @ W^T + bias, batch-invariant (see the module docstring).

    x:    float32[M, in], rows C-contiguous.
    w:    [blocks, in * 16] a `PackedLinear.weight` (float32, int16 bfloat16 bits, uint16 float16 bits or
          int8 quantized); scales: its `PackedLinear.scales` (int8: float16 bits per 32 inputs; else [blocks, 0]).
    bias: float32[blocks * 16].
    out:  float32[M, out_features], C-contiguous; accumulate: add to it instead of overwriting.
    """
    num_rows, num_in = x.shape
    num_blocks = w.shape[0]
    # Tiles of 4 blocks keep 4 FMA chains busy for a single row; narrow products use tiles of 2 so
    # threads get even shares (either way each element is computed the same: see above). The cut is
    # a fixed width, not the thread count: asking numba for that makes the function uncacheable.
    tile_blocks = 4 if num_blocks >= WIDE_PRODUCT_BLOCKS else 2
    num_tiles = (num_blocks + tile_blocks - 1) // tile_blocks
    for tile in prange(num_tiles):
        first = tile * tile_blocks
        last = min(num_blocks, first + tile_blocks)
        m = 0
        while m + 4 <= num_rows:  # 4 rows x 2 blocks: each broadcast feeds 2 FMAs, each load 4
            x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
            b = first
            while b + 2 <= last:
                w0, w1 = w[b], w[b + 1]
                s0, s1 = scales[b], scales[b + 1]
                a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
                c0 = vzero(); c1 = vzero(); c2 = vzero(); c3 = vzero()
                for k in range(num_in):
                    u = wload(w0, s0, k)
                    v = wload(w1, s1, k)
                    s = vbroadcast(x0[k]); a0 = vfma(s, u, a0); c0 = vfma(s, v, c0)
                    s = vbroadcast(x1[k]); a1 = vfma(s, u, a1); c1 = vfma(s, v, c1)
                    s = vbroadcast(x2[k]); a2 = vfma(s, u, a2); c2 = vfma(s, v, c2)
                    s = vbroadcast(x3[k]); a3 = vfma(s, u, a3); c3 = vfma(s, v, c3)
                base = b * LANES
                _finish(out, m, base, a0, bias, accumulate); _finish(out, m, base + LANES, c0, bias, accumulate)
                _finish(out, m + 1, base, a1, bias, accumulate); _finish(out, m + 1, base + LANES, c1, bias, accumulate)
                _finish(out, m + 2, base, a2, bias, accumulate); _finish(out, m + 2, base + LANES, c2, bias, accumulate)
                _finish(out, m + 3, base, a3, bias, accumulate); _finish(out, m + 3, base + LANES, c3, bias, accumulate)
                b += 2
            if b < last:
                w0 = w[b]
                s0 = scales[b]
                a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
                for k in range(num_in):
                    u = wload(w0, s0, k)
                    a0 = vfma(vbroadcast(x0[k]), u, a0)
                    a1 = vfma(vbroadcast(x1[k]), u, a1)
                    a2 = vfma(vbroadcast(x2[k]), u, a2)
                    a3 = vfma(vbroadcast(x3[k]), u, a3)
                base = b * LANES
                _finish(out, m, base, a0, bias, accumulate); _finish(out, m + 1, base, a1, bias, accumulate)
                _finish(out, m + 2, base, a2, bias, accumulate); _finish(out, m + 3, base, a3, bias, accumulate)
            m += 4
        if m + 2 <= num_rows:  # 2 rows x 2 blocks: 4 chains (2-3 rows left)
            x0, x1 = x[m], x[m + 1]
            b = first
            while b + 2 <= last:
                w0, w1 = w[b], w[b + 1]
                s0, s1 = scales[b], scales[b + 1]
                a0 = vzero(); a1 = vzero(); c0 = vzero(); c1 = vzero()
                for k in range(num_in):
                    u = wload(w0, s0, k)
                    v = wload(w1, s1, k)
                    s = vbroadcast(x0[k]); a0 = vfma(s, u, a0); c0 = vfma(s, v, c0)
                    s = vbroadcast(x1[k]); a1 = vfma(s, u, a1); c1 = vfma(s, v, c1)
                base = b * LANES
                _finish(out, m, base, a0, bias, accumulate); _finish(out, m, base + LANES, c0, bias, accumulate)
                _finish(out, m + 1, base, a1, bias, accumulate); _finish(out, m + 1, base + LANES, c1, bias, accumulate)
                b += 2
            if b < last:
                w0 = w[b]
                s0 = scales[b]
                a0 = vzero(); a1 = vzero()
                for k in range(num_in):
                    u = wload(w0, s0, k)
                    a0 = vfma(vbroadcast(x0[k]), u, a0)
                    a1 = vfma(vbroadcast(x1[k]), u, a1)
                base = b * LANES
                _finish(out, m, base, a0, bias, accumulate); _finish(out, m + 1, base, a1, bias, accumulate)
            m += 2
        while m < num_rows:  # one row x 4 (or 2) blocks: independent chains, each weight read once
            # For int8 the k loop runs in stretches of 32 (Q8_0's runs), so the scales load once per stretch,
            # not per input (other storages: one stretch). The same products in the same order as `wload`'s,
            # so every path stays bitwise alike.
            xr = x[m]
            run = run_length(w, num_in)
            b = first
            while b + 4 <= last:
                w0, w1, w2, w3 = w[b], w[b + 1], w[b + 2], w[b + 3]
                s0, s1, s2, s3 = scales[b], scales[b + 1], scales[b + 2], scales[b + 3]
                a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
                for k0 in range(0, num_in, run):
                    d0 = run_scales(w0, s0, k0); d1 = run_scales(w1, s1, k0); d2 = run_scales(w2, s2, k0); d3 = run_scales(w3, s3, k0)
                    for k in range(k0, min(num_in, k0 + run)):
                        s = vbroadcast(xr[k])
                        a0 = vfma(s, run_load(w0, d0, k), a0)
                        a1 = vfma(s, run_load(w1, d1, k), a1)
                        a2 = vfma(s, run_load(w2, d2, k), a2)
                        a3 = vfma(s, run_load(w3, d3, k), a3)
                base = b * LANES
                _finish(out, m, base, a0, bias, accumulate)
                _finish(out, m, base + LANES, a1, bias, accumulate)
                _finish(out, m, base + 2 * LANES, a2, bias, accumulate)
                _finish(out, m, base + 3 * LANES, a3, bias, accumulate)
                b += 4
            if b + 2 <= last:
                w0, w1 = w[b], w[b + 1]
                s0, s1 = scales[b], scales[b + 1]
                a0 = vzero(); a1 = vzero()
                for k0 in range(0, num_in, run):
                    d0 = run_scales(w0, s0, k0); d1 = run_scales(w1, s1, k0)
                    for k in range(k0, min(num_in, k0 + run)):
                        s = vbroadcast(xr[k])
                        a0 = vfma(s, run_load(w0, d0, k), a0)
                        a1 = vfma(s, run_load(w1, d1, k), a1)
                _finish(out, m, b * LANES, a0, bias, accumulate)
                _finish(out, m, (b + 1) * LANES, a1, bias, accumulate)
                b += 2
            if b < last:
                w0 = w[b]
                s0 = scales[b]
                a0 = vzero()
                for k in range(num_in):
                    a0 = vfma(vbroadcast(xr[k]), wload(w0, s0, k), a0)
                _finish(out, m, b * LANES, a0, bias, accumulate)
            m += 1
