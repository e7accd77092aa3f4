"""Batch-invariant products on the CPU: ``out = x @ W^T + bias`` for any number of rows.

Layout (`PackedLinear`): W [out, in] is cut into blocks of 16 output rows, and blocks into tiles of
`tile_blocks` (4 for products of 64+ blocks, else 2: see `tile_blocks`) — the unit one thread computes.
A tile is stored k-major with its blocks interleaved — ``packed[t, (k * tb + i) * 16 + l] =
W[16 (t * tb + i) + l, k]`` — so one vector load brings input k's weights for 16 outputs, and a tile,
like the whole weight, is ONE sequential stream through memory. (Four separate block streams per tile,
the layout before, left a core's hardware prefetchers ramping up on short streams: one row of a product
beyond the caches read 15-30 % slower.) Outputs past `out` (the last tile's padding blocks) are
zeros and never stored.

Arithmetic (`linear_rows`): every output element is ONE fused multiply-add chain over k = 0, 1, ...,
in - 1, starting from zero, then + bias (then + the old value when accumulating into a residual).
The lanes of a vector are 16 different outputs, never partial sums of one output, so no horizontal
reduction exists whose order could vary. How rows and outputs are tiled (4 rows x 2 blocks, 1 row x 4
blocks, ...) and how tiles are spread over threads changes which elements are computed together, never
how one element is computed: row r of a k-row product equals the 1-row product bitwise, for any k and
any thread count. That is what lets greedy speculative decoding equal plain decoding exactly.

Speed: one broadcast input value feeds up to 8 vector FMAs (4 rows x 2 blocks), so many-row products
(prefill chunks, verify trees) run near the FMA units' rate, while one row streams each weight once
(decode is memory-bound). Half-size weights (bfloat16 bits or float16) are widened as they load.
int8, int4 and q4_1 weights (llama.cpp's Q8_0, Q4_0 and Q4_1) take their own kernel, `linear_quant.linear_rows_quant`
(8-bit activations, integer dot products, the same tiles); `linear_rows` picks it by the weight array's dtype.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from specserve.kernels.linear_quant import linear_rows_quant
from specserve.kernels.quant_packing import (
    Q4_OFFSET, Q8_BLOCK, pack_q4, pack_q4_1, pack_q4_1_blocks, pack_q4_blocks, pack_q8, pack_q8_blocks, unpack_q4,
    unpack_q4_1, unpack_q8,
)
from specserve.kernels.simd import (
    FEW_REGISTERS, LANES, PREFETCH_ROWS, prefetch, store_block_rows, store_lanes, store_row_blocks, tile_blocks,
    tiled_rows, vbroadcast, vfma, vload, vzero,
)
from specserve.numba_cache import CALLS_PARALLEL_KERNELS

__all__ = ["BLOCK_FORMATS", "PackedLinear", "Q8_BLOCK", "STORAGES", "as_numpy", "linear_rows", "linear_rows_float"]


STORAGES = ("float32", "bfloat16", "float16", "int8", "int4", "q4_1")
BLOCK_FORMATS = {"q8_0": "int8", "q4_0": "int4", "q4_1": "q4_1"}  # llama.cpp's block formats -> our storage names


class PackedLinear:
    """A weight [out, in] (and optional bias [out]) packed for `linear_rows`.

    storage: "float32", "bfloat16" (kept as int16 bits; rounded to nearest even from the source),
    "float16" (kept as uint16 bits) — weight [tiles, in * tile_blocks * 16] in the layout above — or
    "int8" / "int4" / "q4_1" (llama.cpp's Q8_0 / Q4_0 / Q4_1 in `quant_packing`'s layouts: weight uint8[tiles,
    ceil(in / 32) * 32 * tile_blocks * 16] / int8-typed nibble pairs [tiles, ceil(in / 32) * 16 * tile_blocks *
    16] (Q4_0 and Q4_1), and `scales` their float16 scales as bits, uint16[tiles * tile_blocks, ceil(in / 32) *
    16] (Q4_1: d and m, uint32[.., ceil(in / 32) * 16])); `scales` is empty [.., 0] for the float storages. The
    quantized storages quantize a float weight with llama.cpp's reference quantizers; `from_blocks` takes
    blocks already quantized (a GGUF file's) as they are. The bias stays float32 [tiles * tile_blocks * 16]
    (zeros when there is none: adding 0.0 changes nothing).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, storage: str = "float32") -> None:
        if weight.dim() != 2:
            raise ValueError(f"a linear weight must be 2-D [out, in], got {tuple(weight.shape)}")
        if storage not in STORAGES:
            raise ValueError(f"weight storage must be one of {', '.join(STORAGES)}, got {storage!r}")
        out_features, in_features = weight.shape
        self.tile_blocks = tile_blocks(-(-out_features // LANES))
        rows, tiles = tiled_rows(out_features, self.tile_blocks)  # outputs padded to whole tiles
        if storage in ("int8", "int4", "q4_1"):
            pack = {"int8": pack_q8, "int4": pack_q4, "q4_1": pack_q4_1}[storage]
            self.weight, self.scales = pack(weight, self.tile_blocks)
        else:
            padded = torch.zeros(rows, in_features, dtype=torch.float32)
            padded[:out_features] = weight.detach().to("cpu", torch.float32)
            packed = padded.view(tiles, self.tile_blocks, LANES, in_features).permute(0, 3, 1, 2) \
                .reshape(tiles, in_features * self.tile_blocks * LANES).contiguous()
            if storage == "float32":
                self.weight = packed.numpy()
            elif storage == "bfloat16":
                self.weight = packed.to(torch.bfloat16).view(torch.int16).numpy()
            else:  # float16, kept as uint16 bits: see simd.vload
                self.weight = packed.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
            self.scales = np.zeros((rows // LANES, 0), dtype=np.uint16)
        self._set_bias(bias, out_features, in_features, storage)

    def _set_bias(self, bias: torch.Tensor | None, out_features: int, in_features: int, storage: str) -> None:
        self.bias = np.zeros(self.weight.shape[0] * self.tile_blocks * LANES, dtype=np.float32)
        if bias is not None:
            if tuple(bias.shape) != (out_features,):
                raise ValueError(f"the bias must be [{out_features}], got {tuple(bias.shape)}")
            self.bias[:out_features] = bias.detach().to("cpu", torch.float32).numpy()
        self.out_features, self.in_features, self.storage = out_features, in_features, storage

    @classmethod
    def from_blocks(cls, fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> "PackedLinear":
        """llama.cpp blocks already quantized, packed as they are (no requantization): fmt "q8_0" (q int8[out, in],
        weight q · d), "q4_0" (q uint8[out, in] in 0..15, weight (q - 8) · d) or "q4_1" (q uint8[out, in] in 0..15,
        weight q · d + m); d and m float16[out, ceil(in / 32)], one per output and run of 32 inputs (m: q4_1
        only). Storage "int8", "int4", "q4_1" respectively; the same packed arrays as quantizing a float weight to
        these blocks would give. (GGUF's 4-bit bytes hold inputs k and k + 16 of a run: unpack them first.)"""
        if fmt not in BLOCK_FORMATS:
            raise ValueError(f"block format must be one of {', '.join(BLOCK_FORMATS)}, got {fmt!r}")
        if (m is not None) != (fmt == "q4_1"):
            raise ValueError(f"q4_1 blocks need their minimum m, q8_0 and q4_0 blocks have none (fmt {fmt!r})")
        if q.dim() != 2:
            raise ValueError(f"blocks' q must be 2-D [out, in], got {tuple(q.shape)}")
        self = cls.__new__(cls)
        self.tile_blocks = tile_blocks(-(-q.shape[0] // LANES))
        q, d = q.detach().cpu(), d.detach().cpu()
        if fmt == "q8_0":
            self.weight, self.scales = pack_q8_blocks(q, d, self.tile_blocks)
        elif fmt == "q4_0":
            self.weight, self.scales = pack_q4_blocks(q, d, self.tile_blocks)
        else:
            self.weight, self.scales = pack_q4_1_blocks(q, d, m.detach().cpu(), self.tile_blocks)
        self._set_bias(bias, q.shape[0], q.shape[1], BLOCK_FORMATS[fmt])
        return self

    @property
    def nbytes(self) -> int:
        """Bytes streamed by one product (the weight and the quantized storages' scales; padding rows included)."""
        return self.weight.nbytes + self.scales.nbytes

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] the kernel holds, float32 (int8: q · d, int4: (q - 8) · d, exact in float32; q4_1:
        q · d + m, exact in float64, rounded once to float32)."""
        if self.storage == "q4_1":
            q, d, m = unpack_q4_1(self.weight, self.scales, self.tile_blocks, self.out_features, self.in_features)
            runs = lambda s: s.double().repeat_interleave(Q8_BLOCK, dim=1)[:, :self.in_features]  # noqa: E731
            return (q.double() * runs(d) + runs(m)).float()
        if self.storage in ("int8", "int4"):
            unpack = unpack_q8 if self.storage == "int8" else unpack_q4
            q, d = unpack(self.weight, self.scales, self.tile_blocks, self.out_features, self.in_features)
            q = q.float() - (Q4_OFFSET if self.storage == "int4" else 0)
            return q * d.float().repeat_interleave(Q8_BLOCK, dim=1)[:, :self.in_features]
        raw = torch.from_numpy(self.weight.view(np.int16) if self.weight.dtype == np.uint16 else self.weight)
        w = {"float32": raw, "bfloat16": raw.view(torch.bfloat16), "float16": raw.view(torch.float16)}[self.storage]
        tiles = self.weight.shape[0]
        w = w.float().view(tiles, self.in_features, self.tile_blocks, LANES).permute(0, 2, 3, 1)
        return w.reshape(-1, self.in_features)[:self.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32[..., in] (CPU) -> float32[..., out]: a convenience for heads outside a fused layer."""
        rows = np.ascontiguousarray(as_numpy(x).reshape(-1, self.in_features))
        out = np.empty((rows.shape[0], self.out_features), dtype=np.float32)
        linear_rows(rows, self.weight, self.scales, self.bias, out, False)
        return torch.from_numpy(out).view(*x.shape[:-1], self.out_features)


def as_numpy(x: torch.Tensor) -> np.ndarray:
    """A float32 CPU tensor's numpy view (no copy, no torch op), converting only what must be converted."""
    if x.dtype is not torch.float32 or x.requires_grad:
        x = x.detach().to(torch.float32)
    return x.numpy()


def _product(x, w, scales, bias, out, accumulate):
    """The kernel for w's storage (numba picks it at compile time)."""
    raise NotImplementedError("runs inside numba kernels only")


@overload(_product, inline="always")
def _choose_product(x, w, scales, bias, out, accumulate):
    if w.dtype in (types.uint8, types.int8):  # int8 (Q8_0), int4 (Q4_0) and q4_1 (Q4_1) weights
        return lambda x, w, scales, bias, out, accumulate: linear_rows_quant(x, w, scales, bias, out, accumulate)
    return lambda x, w, scales, bias, out, accumulate: linear_rows_float(x, w, bias, out, accumulate)


@numba.njit(parallel=CALLS_PARALLEL_KERNELS, boundscheck=False, cache=True)
def linear_rows(x, w, scales, bias, out, accumulate):
    """out[:, :out_features] (+)= x @ W^T + bias, batch-invariant, for every `PackedLinear` storage.

    x:      float32[M, in], rows C-contiguous.
    w, scales: a `PackedLinear`'s weight and scales (float32, int16 bfloat16 bits or uint16 float16 bits
            [tiles, in * tile_blocks * 16] with empty scales: `linear_rows_float`; uint8 (int8) or int8-typed
            (int4, q4_1) with uint16 (d) or uint32 (q4_1: d and m) scales: `linear_quant.linear_rows_quant`).
    bias:   float32[tiles * tile_blocks * 16].
    out:    float32[M, out_features], C-contiguous; accumulate: add to it instead of overwriting.
    """
    _product(x, w, scales, bias, out, accumulate)


@numba.njit(inline="always")
def _four_rows_one_block(wt, offset, step, num_in, x0, x1, x2, x3, w_flat, fetch):
    """The FMA chains of one block (input k's 16 weights at wt[k * step + offset]) for the rows x0 .. x3: each load
    feeds 4 FMAs. fetch >= 0: also `prefetch` w_flat[fetch + k * 16] at step k (the next tile, in address order)."""
    a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
    for k in range(num_in):
        if fetch >= 0:
            prefetch(w_flat, fetch + k * LANES)
        u = vload(wt, k * step + offset)
        a0 = vfma(vbroadcast(x0[k]), u, a0)
        a1 = vfma(vbroadcast(x1[k]), u, a1)
        a2 = vfma(vbroadcast(x2[k]), u, a2)
        a3 = vfma(vbroadcast(x3[k]), u, a3)
    return a0, a1, a2, a3


@numba.njit(parallel=True, boundscheck=False, cache=True)
def linear_rows_float(x, w, bias, out, accumulate):
    """`linear_rows` for float32 and half-size weights: the one-FMA-chain arithmetic of the module docstring.

    On AVX2 (`FEW_REGISTERS`: 16 vector registers) a pass of several rows takes 4 rows x 1 block (3 rows: the same
    pass, the last row repeated) or 2 rows x 2 blocks, so its accumulators do not spill. Such a pass sweeps the tile
    once per block or pair of blocks, each sweep reading one or two of every k's cache lines: from memory, that
    strided stream ran at half the sequential one's rate (4 rows of a 3,072 x 576 float16 product cost 2.3x one
    row). So a few-row product's first pass over a tile also fetches the next tile, in address order, one line per
    step (`prefetch`): every sweep then reads the cache, and the memory sees one sequential stream (4 rows 1.1x).
    AVX-512 hosts keep 4 rows x 2 blocks and no prefetch (not measured there)."""
    num_rows, num_in = x.shape
    num_tiles = w.shape[0]
    tb = w.shape[1] // (max(num_in, 1) * LANES)  # blocks per tile
    num_blocks = (out.shape[1] + LANES - 1) // LANES  # real blocks: the last tile's padding is skipped
    w_flat = w.reshape(-1)
    few_rows = FEW_REGISTERS and 1 < num_rows <= PREFETCH_ROWS
    for tile in prange(num_tiles):  # (the index as int64: numba types it uint64 inside its parallel loop)
        _float_tile(np.int64(tile), x, w, w_flat, bias, out, accumulate, tb, num_blocks, few_rows)


@numba.njit(boundscheck=False, cache=True)
def _float_tile(tile, x, w, w_flat, bias, out, accumulate, tb, num_blocks, few_rows):
    """`linear_rows_float`'s work on one tile (its blocks of 16 outputs, every row), a function of its own: numba's
    parallel passes then see a one-call loop body (with the body inline in the parallel loop, a weight type's
    compile took about twice as long, most of it in those passes)."""
    num_rows, num_in = x.shape
    num_tiles = w.shape[0]
    step = tb * LANES  # from input k's weights of a tile to input k + 1's
    tile_len = w.shape[1]
    wt = w[tile]
    first = tile * tb
    count = min(num_blocks, first + tb) - first
    m = 0
    # Where the next tile starts in w_flat while this tile's first pass fetches it; -1 once fetched (or none).
    ahead = (tile + 1) * tile_len if few_rows and tile + 1 < num_tiles else -1
    while FEW_REGISTERS and num_rows - m >= 3:  # 4 rows x 1 block: each load feeds 4 FMAs
        valid = min(4, num_rows - m)
        x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + min(3, valid - 1)]
        for i in range(count):
            fetch = ahead + i * num_in * LANES if ahead >= 0 else -1  # this sweep's share of the next tile
            a0, a1, a2, a3 = _four_rows_one_block(wt, i * LANES, step, num_in, x0, x1, x2, x3, w_flat, fetch)
            store_block_rows(out, m, (first + i) * LANES, a0, a1, a2, a3, bias, accumulate, valid)
        ahead = -1
        m += valid
    while not FEW_REGISTERS and m + 4 <= num_rows:  # 4 rows x 2 blocks: each broadcast feeds 2 FMAs, each load 4
        x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
        i = 0
        while i + 2 <= count:
            a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
            c0 = vzero(); c1 = vzero(); c2 = vzero(); c3 = vzero()
            for k in range(num_in):
                u = vload(wt, k * step + i * LANES)
                v = vload(wt, k * step + (i + 1) * LANES)
                s = vbroadcast(x0[k]); a0 = vfma(s, u, a0); c0 = vfma(s, v, c0)
                s = vbroadcast(x1[k]); a1 = vfma(s, u, a1); c1 = vfma(s, v, c1)
                s = vbroadcast(x2[k]); a2 = vfma(s, u, a2); c2 = vfma(s, v, c2)
                s = vbroadcast(x3[k]); a3 = vfma(s, u, a3); c3 = vfma(s, v, c3)
            base = (first + i) * LANES
            store_block_rows(out, m, base, a0, a1, a2, a3, bias, accumulate)
            store_block_rows(out, m, base + LANES, c0, c1, c2, c3, bias, accumulate)
            i += 2
        if i < count:
            a0, a1, a2, a3 = _four_rows_one_block(wt, i * LANES, step, num_in, x0, x1, x2, x3, w_flat, -1)
            store_block_rows(out, m, (first + i) * LANES, a0, a1, a2, a3, bias, accumulate)
        m += 4
    if m + 2 <= num_rows:  # 2 rows x 2 blocks: 4 chains (2-3 rows left)
        x0, x1 = x[m], x[m + 1]
        i = 0
        while i + 2 <= count:
            a0 = vzero(); a1 = vzero(); c0 = vzero(); c1 = vzero()
            fetch = ahead + i * num_in * LANES
            for k in range(num_in):
                if ahead >= 0:
                    prefetch(w_flat, fetch + 2 * k * LANES)
                    prefetch(w_flat, fetch + (2 * k + 1) * LANES)
                u = vload(wt, k * step + i * LANES)
                v = vload(wt, k * step + (i + 1) * LANES)
                s = vbroadcast(x0[k]); a0 = vfma(s, u, a0); c0 = vfma(s, v, c0)
                s = vbroadcast(x1[k]); a1 = vfma(s, u, a1); c1 = vfma(s, v, c1)
            base = (first + i) * LANES
            store_lanes(out, m, base, a0, bias, accumulate); store_lanes(out, m, base + LANES, c0, bias, accumulate)
            store_lanes(out, m + 1, base, a1, bias, accumulate); store_lanes(out, m + 1, base + LANES, c1, bias, accumulate)
            i += 2
        if i < count:
            a0 = vzero(); a1 = vzero()
            fetch = ahead + i * num_in * LANES
            for k in range(num_in):
                if ahead >= 0:
                    prefetch(w_flat, fetch + k * LANES)
                u = vload(wt, k * step + i * LANES)
                a0 = vfma(vbroadcast(x0[k]), u, a0)
                a1 = vfma(vbroadcast(x1[k]), u, a1)
            base = (first + i) * LANES
            store_lanes(out, m, base, a0, bias, accumulate); store_lanes(out, m + 1, base, a1, bias, accumulate)
        m += 2
    while m < num_rows:  # one row x 4 (or 2) blocks: independent chains, the tile read once, in order
        xr = x[m]
        i = 0
        if i + 4 <= count:
            a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
            for k in range(num_in):
                s = vbroadcast(xr[k])
                o = k * step
                a0 = vfma(s, vload(wt, o), a0)
                a1 = vfma(s, vload(wt, o + LANES), a1)
                a2 = vfma(s, vload(wt, o + 2 * LANES), a2)
                a3 = vfma(s, vload(wt, o + 3 * LANES), a3)
            base = first * LANES
            store_row_blocks(out, m, base, a0, a1, a2, a3, bias, accumulate)
            i = 4
        if i + 2 <= count:
            a0 = vzero(); a1 = vzero()
            for k in range(num_in):
                s = vbroadcast(xr[k])
                a0 = vfma(s, vload(wt, k * step + i * LANES), a0)
                a1 = vfma(s, vload(wt, k * step + (i + 1) * LANES), a1)
            store_lanes(out, m, (first + i) * LANES, a0, bias, accumulate)
            store_lanes(out, m, (first + i + 1) * LANES, a1, bias, accumulate)
            i += 2
        if i < count:
            a0 = vzero()
            for k in range(num_in):
                a0 = vfma(vbroadcast(xr[k]), vload(wt, k * step + i * LANES), a0)
            store_lanes(out, m, (first + i) * LANES, a0, bias, accumulate)
        m += 1
