"""Few-row matrix products on the CPU (fp32): batch-1 decode and small verify trees.

Why: decode and tree verification multiply a handful of rows by every weight matrix, so their cost
is how fast the weights stream from memory, not arithmetic. Measured on our CPUs (AMD EPYC, one
thread, the small default model inside a real forward; BENCHMARKS.md "Verify cost"):

- one row: numpy's OpenBLAS sgemv streams weights about twice as fast as torch's MKL sgemv;
- 2–16 rows: torch's sgemm packs each weight matrix before using it, so a 2-row forward costs
  about 2.5x a 1-row one. `rows_matmul` below reads each weight row once and applies it to every
  input row while it sits in L1, so 4 rows cost about 1.3x one row.

OpenBLAS is pinned to one thread: its own thread pool and torch's OpenMP pool spin against each
other on two cores (a 25x slowdown measured when both had two threads). The numba kernel is
single-threaded and releases the GIL.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

# Above this many rows torch's sgemm wins: the packing cost is shared by enough rows.
MAX_SMALL_ROWS = 16

_blas_limit = None


def pin_openblas_to_one_thread() -> None:
    """Limit numpy's BLAS to one thread, once per process (threadpoolctl finds the library)."""
    global _blas_limit
    if _blas_limit is None:
        from threadpoolctl import threadpool_limits

        _blas_limit = threadpool_limits(limits=1, user_api="blas")


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the kernel now, not inside a request's first step."""
    x = np.ones((2, 4), dtype=np.float32)
    rows_matmul(x, x, np.empty((2, 2), dtype=np.float32))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, in] (fp32, CPU) @ weight [out, in]^T (+ bias [out]) -> [1, out]."""
    out = np.dot(weight.numpy(), x.reshape(-1).numpy())
    if bias is not None:
        out += bias.numpy()
    return torch.from_numpy(out).unsqueeze(0)


def small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] (fp32, CPU, M <= MAX_SMALL_ROWS) @ weight [out, in]^T (+ bias [out]) -> [M, out]."""
    if x.shape[0] == 1:
        return gemv(x, weight, bias)
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    rows_matmul(np.ascontiguousarray(x.numpy()), weight.numpy(), out)
    if bias is not None:
        out += bias.numpy()
    return torch.from_numpy(out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product a CPU fp32 forward uses: few rows here, many rows through torch."""
    if x.shape[0] <= MAX_SMALL_ROWS:
        return small_rows_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


@numba.njit(cache=True, nogil=True, fastmath=True, boundscheck=False)
def rows_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """out[m, o] = sum_i w[o, i] * x[m, i], weight rows streamed once, four input rows at a time.

    x: float32[M, in] (C-contiguous), w: float32[out, in] (C-contiguous), out: float32[M, out].
    """
    num_rows, num_in = x.shape
    for o in range(w.shape[0]):
        m = 0
        while m + 4 <= num_rows:
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for i in range(num_in):
                wv = w[o, i]
                a0 += wv * x[m, i]
                a1 += wv * x[m + 1, i]
                a2 += wv * x[m + 2, i]
                a3 += wv * x[m + 3, i]
            out[m, o] = a0
            out[m + 1, o] = a1
            out[m + 2, o] = a2
            out[m + 3, o] = a3
            m += 4
        while m < num_rows:
            acc = np.float32(0.0)
            for i in range(num_in):
                acc += w[o, i] * x[m, i]
            out[m, o] = acc
            m += 1
