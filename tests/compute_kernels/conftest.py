from __future__ import annotations

import pytest
import torch

from specserve.kernels import set_threads
from specserve.kernels import threads as kernel_threads


@pytest.fixture
def use_threads():
    """use_threads(n): run the CPU kernels on n threads from here on (skips when the process cannot run n).
    The previous setting (kernels and torch) is restored after the test."""
    saved, saved_torch = kernel_threads._threads, torch.get_num_threads()

    def use(n: int) -> None:
        if n > kernel_threads.max_threads():
            pytest.skip(f"needs {n} kernel threads, this process has {kernel_threads.max_threads()}")
        set_threads(n)
        kernel_threads.apply_threads()

    yield use
    set_threads(saved)
    torch.set_num_threads(saved_torch)
    kernel_threads.apply_threads()
