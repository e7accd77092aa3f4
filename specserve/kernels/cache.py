"""numba's on-disk cache of the compiled kernels (`cache=True`): whether they are in it, and dropping it when
a kernel source changed (`drop_stale_entries`).

A first run on a fresh install compiles every kernel (the decoder layer, the products, paged attention,
the drafters' matchers: ~10-15 s on 2 cores, measured in BENCHMARKS.md); numba writes them to its cache (``__pycache__`` beside the
sources, a user-wide cache directory when that is not writable, or ``$NUMBA_CACHE_DIR``) and every later
run loads them in well under a second. `specserve generate` and `serve` say which it will be before
they start the engine, so a first run's wait is explained.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_STAMP = "kernel-sources.sha1"


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


def kernel_cache_dirs(prefix: str = "specserve.kernels.") -> list[Path]:
    """Where numba keeps the cached kernels of the imported modules under `prefix`: ``__pycache__`` beside the
    sources, ``$NUMBA_CACHE_DIR``, or a user-wide directory when ``__pycache__`` is not writable."""
    dirs = {_PACKAGE / "__pycache__"}
    for dispatcher in cached_dispatchers(prefix):
        try:
            dirs.add(Path(dispatcher._cache._cache_path))
        except Exception:  # numba internals moved: the default location still gets checked
            continue
    return sorted(dirs)


def drop_stale_entries(package: Path = _PACKAGE, cache_dirs: list[Path] | None = None) -> bool:
    """Delete numba's cache files of the kernels (``*.nbi``, ``*.nbc`` in each of `cache_dirs`, by default
    `kernel_cache_dirs()`) when any kernel source changed since they were written; returns whether it did.
    Call it after the kernel modules are imported (numba reads a cache entry at a kernel's first call, not at
    import) and before any kernel runs.

    numba checks a cached function against its own source file only, not the files of the kernels it
    calls and inlines: after `linear.py` changes, `layer.py`'s cached decoder layer would still run the old
    product (with a new weight layout: wrong numbers). A hash of every source of the package, kept in each
    cache directory, catches that. (A process still running the old code can write an old entry after the
    check; the next source change drops it again.)"""
    digest = hashlib.sha1()
    for source in sorted(package.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    dropped = False
    for directory in (cache_dirs if cache_dirs is not None else kernel_cache_dirs()):
        stamp = directory / _STAMP
        try:
            if stamp.read_text() == digest.hexdigest():
                continue
        except OSError:
            pass
        try:
            for entry in [*directory.glob("*.nbi"), *directory.glob("*.nbc")]:
                entry.unlink(missing_ok=True)  # another process may have dropped it first
                dropped = True
            directory.mkdir(parents=True, exist_ok=True)
            stamp.write_text(digest.hexdigest())
        except OSError:  # not writable: numba cannot cache there either
            pass
    return dropped
