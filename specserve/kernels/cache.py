"""Whether the compiled kernels are already in numba's on-disk cache (`cache=True`).

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


def missing_from_cache(prefix: str = "specserve.kernels.") -> list[str]:
    """Names of the cached kernels (of the imported modules under `prefix`: the model's kernels by default,
    which are most of the compile time) that have no usable on-disk entry yet: a cache index that is
    absent, or stale (numba drops an index whose source file or numba version changed)."""
    missing = []
    for dispatcher in cached_dispatchers(prefix):
        try:
            index = dispatcher._cache._cache_file._load_index()
        except Exception:  # numba internals moved: say nothing rather than guess
            continue
        if not index:
            missing.append(dispatcher.py_func.__qualname__)
    return missing


def drop_stale_entries(package: Path = _PACKAGE) -> bool:
    """Delete the package's numba cache files (``__pycache__/*.nbi``, ``*.nbc``) when any kernel source changed
    since they were written; returns whether it did.

    numba checks a cached function against its own source file only, not the files of the kernels it
    calls and inlines: after `linear.py` changes, `layer.py`'s cached decoder layer would still run the old
    product (with a new weight layout: wrong numbers). A hash of every source of the package, kept beside
    the cache, catches that. (A cache numba keeps elsewhere — an unwritable ``__pycache__`` — is left alone.)"""
    digest = hashlib.sha1()
    for source in sorted(package.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    stamp = package / "__pycache__" / _STAMP
    try:
        if stamp.read_text() == digest.hexdigest():
            return False
    except OSError:
        pass
    dropped = False
    try:
        for entry in [*stamp.parent.glob("*.nbi"), *stamp.parent.glob("*.nbc")]:
            entry.unlink(missing_ok=True)  # another process may have dropped it first
            dropped = True
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(digest.hexdigest())
    except OSError:  # a read-only install: numba caches elsewhere (or not at all)
        pass
    return dropped
