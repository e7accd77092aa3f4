"""One thread pool for every CPU product and attention: numba's OpenMP threading layer.

numba's default order tries TBB first and falls back to a work queue whose parallel regions cost ~100 us
to start (measured here: 100 us vs 1.3 us for OpenMP) — ruinous for a 1 ms decode step — so OpenMP
goes first. torch's own pool is kept to ONE thread while the kernels run a model: the few torch ops
left in a step are too small to gain from threads, and a second pool waking up for them contends with
numba's (measured: an argmax over 9 x 8192 logits took 3.7 ms with two torch threads on a busy machine,
70 us with one).

Work is split over output tiles and (rows, heads) of attention, never over a reduction, so results do not
depend on the thread count (`linear_rows`, `paged_attention`).
"""

from __future__ import annotations

import logging
import os

import numba
import torch

log = logging.getLogger("specserve")

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

_threads: int | None = None  # None: numba's default (every core)
_warned = False


def max_threads() -> int:
    """The most threads the kernels can use in this process (numba's pool size: the cores by default)."""
    return numba.config.NUMBA_NUM_THREADS


def set_threads(threads: int | None) -> None:
    """Use `threads` threads for the CPU kernels; None = every core. torch keeps one (see above)."""
    global _threads
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        if threads > max_threads():
            raise ValueError(f"threads={threads} but this process can run at most {max_threads()} kernel threads "
                             f"(cores, or NUMBA_NUM_THREADS)")
    _threads = threads
    torch.set_num_threads(1)


def get_threads() -> int:
    return _threads or max_threads()


def apply_threads() -> None:
    """Make the calling thread's kernels use the configured count (numba's setting is per thread:
    the server's engine thread needs it as much as the main thread)."""
    global _warned
    want = get_threads()
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
        # numba's OpenMP layer shares torch's OpenMP runtime: setting numba's count just set torch's pool to
        # the cores (measured: 1 -> 2 here), and torch's ops in the step (log-softmax, top-k over a few
        # rows) then stalled for milliseconds. Keep torch at one thread, as set_threads does.
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
    if not _warned:
        _warned = True
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel region has run yet
            _warned = False
            return
        if layer == "workqueue":
            log.warning("numba's threading layer is 'workqueue' (no OpenMP or TBB found): CPU kernels will be "
                        "slow to start each parallel region; install libgomp or tbb")
