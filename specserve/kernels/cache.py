"""numba's on-disk cache of the compiled kernels (`cache=True`): one cache directory per version of the kernel
sources (`KernelSourcesLocator`), whether the kernels are in it (`missing_from_cache`), and pruning the
directories of old versions (`prune_other_versions`).

A first run on a fresh install compiles every kernel (the decoder layer, the products, paged attention: about
4 minutes on 2 cores, README); numba writes them to its cache and every later run loads them in well under a
second. `specserve generate` and `serve` say which it will be before they start the engine, so a first run's
wait is explained.

Why a directory per version: numba checks a cached function against its own source file only, not the files of
the kernels it calls and inlines. After `linear.py` changes, `layer.py`'s cached decoder layer would still run
the old product (with a new weight layout: wrong numbers, or a crash). So the kernels of this package are cached
under ``<where numba would cache them>/sources-<digest>``, the digest taken over every source of the package
when it is imported. A process still running old code (a server that outlived an upgrade) keeps writing into
its own version's directory, never into the new one's: an earlier scheme, one shared directory emptied when a
stamp of the sources changed, let such a process write an old kernel after the check, and the next run loaded
it (seen as a segfault of the products after a layout change).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent
_PREFIX = "sources-"
#: Source versions whose compiled kernels are kept per cache directory (this one and the most recently used
#: others: switching between branches or installs does not recompile each time).
KEEP_VERSIONS = 4
#: The package directories cached per version, and their source digests (taken once, at registration).
_DIGESTS: dict[Path, str] = {}


def _numba_class(name: str):
    """numba.core.caching's class `name` (numba >= 0.60 spells it so; 0.59 with a leading underscore)."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


def source_digest(package: Path) -> str:
    """A digest of every ``*.py`` source of `package` (names and contents, in name order)."""
    digest = hashlib.sha1()
    for source in sorted(package.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


class KernelSourcesLocator(_numba_class("CacheLocator")):
    """numba's cache locator for the functions of a registered package (`register_package`): the directory
    numba's own locators would choose (``$NUMBA_CACHE_DIR``, ``__pycache__`` beside the source, or a user-wide
    directory when that is not writable), then ``sources-<digest of the package's sources>`` inside it."""

    def __init__(self, inner, digest: str) -> None:
        self._inner = inner
        self._py_file = inner._py_file  # numba's cache reads it when it reports a load failure
        self._cache_path = os.path.join(inner.get_cache_path(), _PREFIX + digest)

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self):
        return self._inner.get_source_stamp()

    def get_disambiguator(self) -> str:
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        digest = _DIGESTS.get(Path(py_file).resolve().parent)
        if digest is None:  # another library's function: numba's own locators place it
            return None
        for base in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"):
            inner = _numba_class(base).from_function(py_func, py_file)
            if inner is None:
                continue
            locator = cls(inner, digest)
            try:
                locator.ensure_cache_path()
            except OSError:
                continue
            return locator
        return None


def register_package(package: Path) -> str:
    """Cache `package`'s numba functions per version of its sources; call before its modules are imported
    (numba picks a function's cache directory when the function is defined). Returns the digest."""
    package = Path(package).resolve()
    _DIGESTS[package] = source_digest(package)
    locators = _numba_class("CacheImpl")._locator_classes  # the class-wide list every cached function tries
    if KernelSourcesLocator not in locators:
        locators.insert(0, KernelSourcesLocator)
    return _DIGESTS[package]


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
    """Where numba keeps the cached kernels of the imported modules under `prefix` (this version's directories)."""
    dirs = set()
    for dispatcher in cached_dispatchers(prefix):
        try:
            dirs.add(Path(dispatcher._cache._cache_path))
        except Exception:  # numba internals moved: nothing to report
            continue
    return sorted(dirs)


def prune_other_versions(version_dirs: list[Path], keep: int = KEEP_VERSIONS) -> list[Path]:
    """In the parent of each of `version_dirs` (this version's cache directories): mark this version used, delete
    the kernels of all but the `keep` - 1 most recently used other versions, and the cache files an unversioned
    cache left there (``*.nbi``, ``*.nbc`` and its stamp: the scheme before this one). Returns what it deleted.
    Safe beside a running old process: numba re-creates its directory before it writes a kernel."""
    deleted = []
    for current in version_dirs:
        parent = current.parent
        try:
            current.mkdir(parents=True, exist_ok=True)
            os.utime(current)  # most recently used
            others = sorted((d for d in parent.glob(_PREFIX + "*") if d.is_dir() and d != current),
                            key=lambda d: d.stat().st_mtime, reverse=True)
            legacy = [*parent.glob("*.nbi"), *parent.glob("*.nbc"), *parent.glob("kernel-sources.sha1")]
            stale = others[keep - 1:] + legacy
            for path in stale:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)  # another process may have deleted it first
                deleted.append(path)
        except OSError:  # not writable: numba cannot cache there either
            continue
    return deleted
