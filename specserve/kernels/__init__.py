"""Compiled CPU kernels (numba): batch-invariant products, paged tree attention, whole decoder layers.

See `linear` (the product and its fixed reduction order), `attention`, `layer`, `model_kernels` (the
executor a `LlamaModel` uses on the CPU) and `threads` (one thread pool for all of them).
"""

from specserve.kernels.cache import drop_stale_entries
from specserve.kernels.linear import PackedLinear, linear_rows
from specserve.kernels.model_kernels import LayerKernels, ModelKernels, kernels_unsupported
from specserve.kernels.threads import get_threads, set_threads

drop_stale_entries()  # every kernel module is imported, none has run: see its docstring

__all__ = ["LayerKernels", "ModelKernels", "PackedLinear", "get_threads", "kernels_unsupported", "linear_rows",
           "set_threads"]
