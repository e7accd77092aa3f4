"""Compiled CPU kernels (numba): batch-invariant products, paged tree attention, whole decoder layers.

See `linear` (the product and its fixed reduction order), `attention`, `layer`, `model_kernels` (the
executor a `LlamaModel` uses on the CPU), `threads` (one thread pool for all of them) and `cache` (which
of them numba has compiled on disk).
"""

from pathlib import Path

from specserve.numba_cache import register_package

register_package(Path(__file__).parent)  # before any kernel is defined: numba places a kernel's cache then

from specserve.kernels.linear import PackedLinear, linear_rows
from specserve.kernels.model_kernels import LayerKernels, ModelKernels, drafter_storage, kernels_unsupported
from specserve.kernels.threads import get_threads, set_threads

__all__ = ["LayerKernels", "ModelKernels", "PackedLinear", "drafter_storage", "get_threads", "kernels_unsupported",
           "linear_rows",
           "set_threads"]
