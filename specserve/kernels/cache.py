"""Which of the compiled kernels numba has on disk (`missing_from_cache`).

A first run on a fresh install compiles every kernel (the decoder layer, the products, paged attention: about
4 minutes on 2 cores, README); numba writes them to its cache (one directory per version of the sources:
`specserve.numba_cache`) and every later run loads them in well under a second. `specserve generate` and `serve`
say which it will be before they start the engine, so a first run's wait is explained.
"""

from __future__ import annotations

import sys


def cached_dispatchers(prefix: str = "specserve.kernels.") -> list:
    """Every ``cache=True`` numba function of the imported modules under `prefix` (deduplicated)."""
    import numba

    found, seen = [], set()
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, numba.core.registry.CPUDispatcher) and id(obj) not in seen:
                seen.add(id(obj))
                if type(obj._cache).__name__ != "NullCache":
                    found.append(obj)
    return found


def missing_from_cache(prefix: str = "specserve.kernels.", quantized: bool = True, floats: bool = True) -> list[str]:
    """Names of the cached kernels (of the imported modules under `prefix`: the model's kernels by default,
    which are most of the compile time) that have no usable on-disk entry yet: a cache index that is
    absent, or stale (numba drops an index whose source file or numba version changed). quantized=False leaves
    out the 8- and 4-bit products' kernels, which a model with float weights never compiles (counting them
    said "compiling kernels (first run only…)" on every run of a float model); floats=False the float products'
    kernel, which a model whose products are all quantized never compiles."""
    missing = []
    for dispatcher in cached_dispatchers(prefix):
        if not quantized and dispatcher.__module__.endswith(".linear_quant"):
            continue
        if not floats and dispatcher.py_func.__name__ == "linear_rows_float":
            continue
        try:
            index = dispatcher._cache._cache_file._load_index()
        except Exception:  # numba internals moved: say nothing rather than guess
            continue
        if not index:
            missing.append(dispatcher.py_func.__qualname__)
    return missing
