"""Batch-1 matrix-vector products on the CPU through numpy's OpenBLAS.

Why: decode at batch 1 is one matrix-vector product per weight matrix, bound by how fast weights
stream from memory. On our CPUs (AMD EPYC) torch's MKL sgemv streams at roughly half the rate of
numpy's bundled OpenBLAS sgemv over the same [out, in] matrix (measured side by side: BENCHMARKS.md,
"Plain decode"); for more than one row MKL's sgemm is as fast or faster, so only single rows come
here. OpenBLAS is pinned to one thread: its own thread pool and torch's OpenMP pool spin against
each other on two cores (a 25x slowdown measured when both had two threads).
"""

from __future__ import annotations

import numpy as np
import torch

_blas_limit = None


def pin_openblas_to_one_thread() -> None:
    """Limit numpy's BLAS to one thread, once per process (threadpoolctl finds the library)."""
    global _blas_limit
    if _blas_limit is None:
        from threadpoolctl import threadpool_limits

        _blas_limit = threadpool_limits(limits=1, user_api="blas")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, in] (fp32, CPU) @ weight [out, in]^T (+ bias [out]) -> [1, out]."""
    out = np.dot(weight.numpy(), x.reshape(-1).numpy())
    if bias is not None:
        out += bias.numpy()
    return torch.from_numpy(out).unsqueeze(0)
