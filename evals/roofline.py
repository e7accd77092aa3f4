"""This machine's limits, measured: what a forward of k rows could cost at best (`bench verify`'s floor).

A forward streams every weight once, whatever its row count, and does each row's multiply-adds. So its floor is
max(bytes streamed / memory bandwidth, Σ over products of rows · multiply-adds / the peak rate of that product's
arithmetic). Each figure comes from a loop that does only that, never from our product kernels (a floor measured
with the kernel under test would call any kernel efficient):

- `memory_bandwidth`: a streaming read of 256 MiB (far beyond the caches), split over the kernels' threads.
- `peak_rates`: multiply-adds per second of loops over cache-resident data with 8 independent accumulators, in the
  host's best spelling of each storage's arithmetic — float32 FMAs (float storages; half-size ones also widen,
  which the floor does not charge), 8-bit dot products as the quantized kernels spell them (`linear_quant.wdot`:
  VNNI's vpdpbusd, or AVX2's vpmaddubsw pair sums for 4-bit weights and signed products for 8-bit ones).

Every rate is the best of 7 tries (a shared host's neighbours only ever slow a try down), with the threads the
kernels use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numba
import numpy as np
from numba import prange

from specserve.kernels.linear_quant import run_sum, wdot, weight_offset, wzero
from specserve.kernels.simd import LANES, vadd, vfma, visum, vload, vload_bytes, vbroadcast_bytes, vsum, vzero

STREAM_BYTES = 256 << 20
RESIDENT_BYTES = 16 << 10  # well inside L1


@numba.njit(parallel=True, boundscheck=False, cache=True)
def _stream(data, parts):
    """Σ of data float32[n] read in `parts` contiguous slices, 64 floats a step (4 independent sums)."""
    per = data.shape[0] // parts
    totals = np.zeros(parts, dtype=np.float32)
    for part in prange(parts):
        a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
        for i in range(part * per, (part + 1) * per, 4 * LANES):
            a0 = vadd(a0, vload(data, i)); a1 = vadd(a1, vload(data, i + LANES))
            a2 = vadd(a2, vload(data, i + 2 * LANES)); a3 = vadd(a3, vload(data, i + 3 * LANES))
        totals[part] = vsum(vadd(vadd(a0, a1), vadd(a2, a3)))
    return totals


@numba.njit(parallel=True, boundscheck=False, cache=True)
def _fma_loop(w, x, repeats, parts):
    """`repeats` passes over w float32[n] (cache-resident), 8 FMA chains: 8 · 16 multiply-adds per 128 floats."""
    n = w.shape[0]
    totals = np.zeros(parts, dtype=np.float32)
    for part in prange(parts):
        a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero(); a4 = vzero(); a5 = vzero(); a6 = vzero(); a7 = vzero()
        xv = vload(x, 0)
        for _ in range(repeats):
            for i in range(0, n, 8 * LANES):
                a0 = vfma(vload(w, i), xv, a0); a1 = vfma(vload(w, i + LANES), xv, a1)
                a2 = vfma(vload(w, i + 2 * LANES), xv, a2); a3 = vfma(vload(w, i + 3 * LANES), xv, a3)
                a4 = vfma(vload(w, i + 4 * LANES), xv, a4); a5 = vfma(vload(w, i + 5 * LANES), xv, a5)
                a6 = vfma(vload(w, i + 6 * LANES), xv, a6); a7 = vfma(vload(w, i + 7 * LANES), xv, a7)
        totals[part] = vsum(vadd(vadd(vadd(a0, a1), vadd(a2, a3)), vadd(vadd(a4, a5), vadd(a6, a7))))
    return totals


@numba.njit(parallel=True, boundscheck=False, cache=True)
def _fma_loop4(w, x, repeats, parts):
    """`_fma_loop` with 4 chains (16 lanes each): 8 would not fit AVX2's 16 registers."""
    n = w.shape[0]
    totals = np.zeros(parts, dtype=np.float32)
    for part in prange(parts):
        a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
        xv = vload(x, 0)
        for _ in range(repeats):
            for i in range(0, n, 4 * LANES):
                a0 = vfma(vload(w, i), xv, a0); a1 = vfma(vload(w, i + LANES), xv, a1)
                a2 = vfma(vload(w, i + 2 * LANES), xv, a2); a3 = vfma(vload(w, i + 3 * LANES), xv, a3)
        totals[part] = vsum(vadd(vadd(a0, a1), vadd(a2, a3)))
    return totals


@numba.njit(parallel=True, boundscheck=False, cache=True)
def _dot_loop(w, scales, qx, repeats, parts):
    """`repeats` passes over w (cache-resident 8-bit weights: uint8 = 8-bit storage, int8-typed = 4-bit), each 64
    bytes one run step of 16 outputs x 4 inputs, as the quantized kernels run them: 8 independent accumulators, a
    run of 32 inputs = 8 `wdot`s, then its `run_sum`. Multiply-adds: 64 per `wdot`."""
    n = w.shape[0]
    offset = weight_offset(w, scales)
    totals = np.zeros(parts, dtype=np.float32)
    for part in prange(parts):
        a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero(); a4 = vzero(); a5 = vzero(); a6 = vzero(); a7 = vzero()
        for _ in range(repeats):
            for run in range(0, n, 8 * 8 * 4 * LANES):  # 8 accumulators x 8 steps of 64 bytes
                i0 = wzero(w); i1 = wzero(w); i2 = wzero(w); i3 = wzero(w)
                i4 = wzero(w); i5 = wzero(w); i6 = wzero(w); i7 = wzero(w)
                for step in range(8):
                    b = vbroadcast_bytes(qx, 4 * step)
                    at = run + step * 8 * 4 * LANES
                    i0 = wdot(w, i0, vload_bytes(w, at), b); i1 = wdot(w, i1, vload_bytes(w, at + 64), b)
                    i2 = wdot(w, i2, vload_bytes(w, at + 128), b); i3 = wdot(w, i3, vload_bytes(w, at + 192), b)
                    i4 = wdot(w, i4, vload_bytes(w, at + 256), b); i5 = wdot(w, i5, vload_bytes(w, at + 320), b)
                    i6 = wdot(w, i6, vload_bytes(w, at + 384), b); i7 = wdot(w, i7, vload_bytes(w, at + 448), b)
                dx = np.float32(0.01)
                a0 = run_sum(a0, i0, 3, offset, scales, scales, 0, dx)
                a1 = run_sum(a1, i1, 3, offset, scales, scales, 0, dx)
                a2 = run_sum(a2, i2, 3, offset, scales, scales, 0, dx)
                a3 = run_sum(a3, i3, 3, offset, scales, scales, 0, dx)
                a4 = run_sum(a4, i4, 3, offset, scales, scales, 0, dx)
                a5 = run_sum(a5, i5, 3, offset, scales, scales, 0, dx)
                a6 = run_sum(a6, i6, 3, offset, scales, scales, 0, dx)
                a7 = run_sum(a7, i7, 3, offset, scales, scales, 0, dx)
        totals[part] = vsum(vadd(vadd(vadd(a0, a1), vadd(a2, a3)), vadd(vadd(a4, a5), vadd(a6, a7))))
    return totals


@numba.njit(parallel=True, boundscheck=False, cache=True)
def _dot_loop4(w, scales, qx, repeats, parts):
    """`_dot_loop` with 4 accumulators (AVX2's int16 pair sums of 8 would not fit its 16 registers)."""
    n = w.shape[0]
    offset = weight_offset(w, scales)
    totals = np.zeros(parts, dtype=np.float32)
    for part in prange(parts):
        a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
        for _ in range(repeats):
            for run in range(0, n, 4 * 8 * 4 * LANES):  # 4 accumulators x 8 steps of 64 bytes
                i0 = wzero(w); i1 = wzero(w); i2 = wzero(w); i3 = wzero(w)
                for step in range(8):
                    b = vbroadcast_bytes(qx, 4 * step)
                    at = run + step * 4 * 4 * LANES
                    i0 = wdot(w, i0, vload_bytes(w, at), b); i1 = wdot(w, i1, vload_bytes(w, at + 64), b)
                    i2 = wdot(w, i2, vload_bytes(w, at + 128), b); i3 = wdot(w, i3, vload_bytes(w, at + 192), b)
                dx = np.float32(0.01)
                a0 = run_sum(a0, i0, 3, offset, scales, scales, 0, dx)
                a1 = run_sum(a1, i1, 3, offset, scales, scales, 0, dx)
                a2 = run_sum(a2, i2, 3, offset, scales, scales, 0, dx)
                a3 = run_sum(a3, i3, 3, offset, scales, scales, 0, dx)
        totals[part] = vsum(vadd(vadd(a0, a1), vadd(a2, a3)))
    return totals


def _best_seconds(fn, tries: int = 7) -> float:
    fn()  # compile / warm
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(threads: int) -> float:
    """Bytes per second one streaming read of 256 MiB reaches with `threads` threads."""
    data = np.ones(STREAM_BYTES // 4, dtype=np.float32)
    return STREAM_BYTES / _best_seconds(lambda: _stream(data, threads))


@dataclass(frozen=True)
class PeakRates:
    """Multiply-adds per second, by the arithmetic a storage runs on."""

    float32: float  # FMAs: the float storages (float32, bfloat16, float16)
    int8: float  # 8-bit weights (Q8_0)
    int4: float  # 4-bit weights (Q4_0, Q4_1)

    def for_storage(self, storage: str) -> float:
        return {"int8": self.int8, "int4": self.int4, "q4_1": self.int4}.get(storage, self.float32)


def peak_rates(threads: int, target_seconds: float = 0.05) -> PeakRates:
    """Each rate the better of 8 and 4 independent chains (which one a host's registers favour)."""
    floats = np.ones(RESIDENT_BYTES // 4, dtype=np.float32)
    fma_repeats = max(1, int(target_seconds * 20e9 / floats.shape[0]))
    fma = max(fma_repeats * floats.shape[0] * threads / _best_seconds(lambda: loop(floats, floats, fma_repeats, threads))
              for loop in (_fma_loop, _fma_loop4))
    qx = np.full(64, 3, dtype=np.int8)
    rates = {}
    for name, dtype in (("int8", np.uint8), ("int4", np.int8)):
        w, scales = np.full(RESIDENT_BYTES, 7, dtype=dtype), np.zeros(2 * LANES, np.uint16)
        repeats = max(1, int(target_seconds * 40e9 / w.shape[0]))
        rates[name] = max(repeats * w.shape[0] * threads / _best_seconds(lambda: loop(w, scales, qx, repeats, threads))
                          for loop in (_dot_loop, _dot_loop4))  # one multiply-add per weight byte
    return PeakRates(float32=fma, **rates)
