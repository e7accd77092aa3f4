"""The kernels keep torch's own pool at one thread: numba's OpenMP layer shares torch's OpenMP runtime, so
setting numba's count used to set torch's to the cores too, and the few torch ops in a step (top-k and
log-softmax of log-probabilities, measured: 2 x 8192 rows 5-8 ms instead of 5 us) then stalled."""

from __future__ import annotations

import numba
import torch

from specserve.kernels import threads as kernel_threads


def test_applying_kernel_threads_leaves_torch_at_one(use_threads):
    for n in (2, 1):
        if n > kernel_threads.max_threads():
            continue
        use_threads(n)
        numba.set_num_threads(max(1, kernel_threads.max_threads() + 1 - n) if kernel_threads.max_threads() > 1 else 1)
        kernel_threads.apply_threads()  # the engine does this before each forward
        assert numba.get_num_threads() == n and torch.get_num_threads() == 1
