"""Few-row matrix products on the CPU (fp32): batch-1 decode and small verify trees.

Why: decode and tree verification multiply a handful of rows by every weight matrix. Measured on our
CPUs (AMD EPYC, one thread, the small default model; BENCHMARKS.md "Verify cost and batch throughput"):

- one row: numpy's OpenBLAS sgemv streams weights about twice as fast as torch's MKL sgemv;
- 2–16 rows: torch's sgemm packs each weight matrix before using it, so a 2-row forward cost
  1.6–2.5x a 1-row one. `rows_matmul` below reads each weight row once and applies it to every
  input row while it sits in L1: a forward over root + 8 draft nodes costs 1.14x a 1-row one.

`linear` is the one entry point: it takes this path for 2-D fp32 CPU inputs outside autograd (model
forwards and drafter heads at inference) and torch's everywhere else (GPU, training, many rows), so
callers need no flag of their own. `prepare` (at model load) pins OpenBLAS to one thread — its own
thread pool and torch's OpenMP pool spin against each other on two cores (a 25x slowdown measured
when both had two threads) — and compiles the numba kernel, which is single-threaded.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
import torch.nn.functional as F

# Above this many rows torch's sgemm wins: the packing cost is shared by enough rows.
MAX_SMALL_ROWS = 16

_blas_limit = None


def prepare() -> None:
    """Once per process, before the first request: pin OpenBLAS to one thread and compile the kernel
    (or load it from numba's disk cache), so neither happens inside a request's first step."""
    global _blas_limit
    if _blas_limit is None:
        from threadpoolctl import threadpool_limits

        _blas_limit = threadpool_limits(limits=1, user_api="blas")
        x = np.ones((2, 4), dtype=np.float32)
        rows_matmul(x, x, np.empty((2, 2), dtype=np.float32))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight [out, in]^T (+ bias [out]) -> [M, out], through the fastest path for its shape."""
    # Cheapest tests first: this runs for every product of every forward (~0.3 us).
    if not (x.is_cpu and x.dtype is torch.float32 and weight.dtype is torch.float32 and x.dim() == 2
            and x.shape[0] <= MAX_SMALL_ROWS and not torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    if x.shape[0] == 1:
        out = np.dot(weight.numpy(), x.reshape(-1).numpy())[None]
    else:
        out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
        rows_matmul(np.ascontiguousarray(x.numpy()), weight.numpy(), out)
    if bias is not None:
        out += bias.numpy()
    return torch.from_numpy(out)


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
