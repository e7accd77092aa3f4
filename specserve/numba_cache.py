"""numba's on-disk cache (`cache=True`) kept per version of the sources: each package of ours that defines numba
functions registers itself (`register_package`) before its modules are imported, and numba then caches its
functions under ``<where numba would cache them>/sources-<digest>``, the digest taken over the package's sources
and those of the packages its functions call into.

Why: numba checks a cached function against its own source file only, not the files of the functions it calls
and inlines. After `kernels/linear.py` changes, `kernels/layer.py`'s cached decoder layer would still run the old
product (with a new weight layout: wrong numbers, or a crash); after `verify/tree_kernels.py` changes, Medusa's
cached tree builder would still run the old one. With a directory per version a run on new sources never sees
an old kernel, and a process still running old code (a server that outlived an upgrade) keeps writing into its
own version's directory. (An earlier scheme, one shared directory emptied when a stamp of the sources changed,
let such a process write an old kernel after the check, and the next run loaded it: seen as a segfault of the
products after a layout change.)

The first time a version's directory is used, the directory above it is pruned (`prune_other_versions`): all but
the most recently used few versions, and the cache files an unversioned cache left there.

Processes share a version's directory, and numba's cache index is not safe for that: saving a function reads
its index, picks the first free data-file number, writes the index, then the data file. Two processes saving
two signatures of one function at once (a first start compiling while another process compiles: replicas, a
tensor-parallel worker, a second command) can both pick number 1; the index then names one signature and the
data file holds the other's machine code, which the next run loads for it. `lock_cache_index` makes a save
(read, pick, write both) one step under an exclusive lock per function, and a load a reader under a shared one.

Nor does numba know that another process is compiling the signature it is about to compile: two processes that
start at once (the test suite's workers, server replicas, a forward beside the head's `precompile` child) each
compiled the same kernel — measured in a fresh clone's test run: 9 signatures, ~560 s of compile done twice, the
product kernel 60-110 s a time. `lock_compiles` makes compiling one signature of one of our functions one step
across processes: the second waits for the first, then loads its code from the cache instead of compiling it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: numba's own unlocked cache files
    fcntl = None

from numba.core import caching, sigutils

_PREFIX = "sources-"
#: Source versions whose compiled functions are kept per cache directory (this one and the most recently used
#: others: switching between branches or installs does not recompile every time).
KEEP_VERSIONS = 4
#: Registered package directories -> the digest naming their cache's version directory.
_DIGESTS: dict[Path, str] = {}
#: Version directories already pruned around in this process.
_PRUNED: set[Path] = set()


def _numba_class(name: str):
    """numba.core.caching's class `name` (numba >= 0.60 spells it so; 0.59 with a leading underscore)."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


def source_digest(*packages: Path) -> str:
    """A digest of every ``*.py`` source of `packages` (each package's sources by name, packages in the order
    given)."""
    digest = hashlib.sha1()
    for package in packages:
        for source in sorted(Path(package).glob("*.py")):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
        digest.update(b"\1")
    return digest.hexdigest()[:16]


#: `numba.njit(parallel=CALLS_PARALLEL_KERNELS, cache=True)` for a cached function that calls a `parallel=True` one
#: (the decoder layer, the product dispatcher). numba has a bug there (numba/numba#4807, #8578, open): a cached
#: caller compiled while its parallel callee was loaded from the cache, not compiled, segfaults when a later
#: process loads the caller from the cache (a call through a null pointer: seen here with `linear_rows` on Q4_1
#: weights after a benchmark had compiled `linear_rows_quant` in another process). A caller compiled in parallel
#: mode does not; every parallel transformation is off, so its own code is what plain `njit` makes of it.
CALLS_PARALLEL_KERNELS = {"comprehension": False, "reduction": False, "inplace_binop": False, "setitem": False,
                          "numpy": False, "stencil": False, "fusion": False, "prange": False}


def _quiet_parallel_mode_warnings(package: Path) -> None:
    """Silence numba's "parallel=True was specified but no transformation ... was possible" for the functions of
    `package` (`CALLS_PARALLEL_KERNELS` asks for none on purpose); the same warning about other code still shows."""
    import re
    import warnings

    from numba.core.errors import NumbaPerformanceWarning

    warnings.filterwarnings("ignore", category=NumbaPerformanceWarning,
                            message=r'(?s).*no transformation for parallel execution.*File ".*' + re.escape(package.name)
                            + r"[/\\]")


def register_package(package: Path, *calls_into: Path) -> str:
    """Cache the numba functions of `package` per version of its sources and of those of `calls_into` (the
    packages whose numba functions they call). Call it before the package's modules are imported: numba
    places a function's cache when the function is defined. Returns the version's digest."""
    package = Path(package).resolve()
    _DIGESTS[package] = source_digest(package, *(Path(p).resolve() for p in calls_into))
    locators = _numba_class("CacheImpl")._locator_classes  # the class-wide list every cached function tries
    if VersionedCacheLocator not in locators:
        locators.insert(0, VersionedCacheLocator)
    lock_cache_index()
    lock_compiles()
    _quiet_parallel_mode_warnings(package)
    return _DIGESTS[package]


def lock_cache_index() -> None:
    """Make numba's cache-file `save` and `load` hold a lock on the function's index while they run, for the
    functions cached in a version's directory (class-wide, as the locator is; other libraries' caches are left
    as numba keeps them). Idempotent."""
    cache_file = _numba_class("IndexDataCacheFile")
    if fcntl is None or getattr(cache_file.save, "_specserve_locked", False):
        return
    for name, exclusive in (("save", True), ("load", False)):
        setattr(cache_file, name, _locked(getattr(cache_file, name), exclusive))


def _locked(method, exclusive: bool):
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        if not os.path.basename(os.path.normpath(self._cache_path)).startswith(_PREFIX):
            return method(self, *args, **kwargs)
        with _index_lock(self._index_path, exclusive):
            return method(self, *args, **kwargs)

    locked._specserve_locked = True
    return locked


@contextlib.contextmanager
def _index_lock(index_path: str, exclusive: bool):
    """flock on ``<index>.lock`` beside the index (created on first use, never deleted: deleting it would let
    two processes lock two different files). A directory that cannot be written cannot be saved into either:
    then no lock."""
    try:
        fd = os.open(index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_compiles() -> None:
    """Make numba's `Dispatcher.compile` of a signature of a function cached in a version's directory hold an
    exclusive lock on that signature (a file beside the function's index, named by a digest of the signature and
    the CPU it compiles for) while it runs (class-wide; other functions compile as numba does). numba's compile
    first looks in the cache, so a process that waited loads what the other compiled. Idempotent.

    No deadlock: a process takes these locks in call order (a caller's signature, then the callees' it compiles
    nested), and no kernel calls back into its callers; the process's own threads are serialised first by numba's
    global compiler lock, taken before the file's (a thread of this process never waits on a file another of its
    threads holds)."""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.dispatcher import Dispatcher

    if fcntl is None or getattr(Dispatcher.compile, "_specserve_locked", False):
        return
    compile_signature = Dispatcher.compile

    @functools.wraps(compile_signature)
    def compile_once(self, sig):
        cache = getattr(self, "_cache", None)
        cache_path = getattr(cache, "_cache_path", None)
        if cache_path is None or not os.path.basename(os.path.normpath(cache_path)).startswith(_PREFIX):
            return compile_signature(self, sig)
        with global_compiler_lock:
            args, _ = sigutils.normalize_signature(sig)
            if tuple(args) in self.overloads:  # compiled or loaded already in this process
                return compile_signature(self, sig)
            key = hashlib.sha1(repr((tuple(args), self.targetctx.codegen().magic_tuple())).encode()).hexdigest()[:16]
            with _index_lock(f"{cache._cache_file._index_path}.{key}.compile", exclusive=True):
                return compile_signature(self, sig)

    compile_once._specserve_locked = True
    Dispatcher.compile = compile_once


class VersionedCacheLocator(_numba_class("CacheLocator")):
    """numba's cache locator for the functions of a registered package: the directory numba's own locators
    would choose (``$NUMBA_CACHE_DIR``, ``__pycache__`` beside the source, or a user-wide directory when that is
    not writable), then ``sources-<digest>`` inside it (`register_package`). Other functions: numba's own."""

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
        if digest is None:  # another library's function
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
            version = Path(locator.get_cache_path())
            if version not in _PRUNED:
                _PRUNED.add(version)
                prune_other_versions(version)
            return locator
        return None


def prune_other_versions(version: Path, keep: int = KEEP_VERSIONS) -> list[Path]:
    """In the directory above `version` (a version's cache directory): mark `version` used, delete the functions
    of all but the `keep` - 1 most recently used other versions, and the cache files an unversioned cache left
    there (``*.nbi``, ``*.nbc``, and the stamp of the scheme before this one). Returns what it deleted. Safe
    beside a running old process: numba re-creates its directory before it writes a function."""
    parent = version.parent
    deleted = []
    try:
        version.mkdir(parents=True, exist_ok=True)
        os.utime(version)  # most recently used
        others = sorted((d for d in parent.glob(_PREFIX + "*") if d.is_dir() and d != version),
                        key=lambda d: d.stat().st_mtime, reverse=True)
        legacy = [*parent.glob("*.nbi"), *parent.glob("*.nbc"), *parent.glob("kernel-sources.sha1")]
        for path in others[keep - 1:] + legacy:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)  # another process may have deleted it first
            deleted.append(path)
    except OSError:  # not writable: numba cannot cache there either
        pass
    return deleted


def package_dir(name: str) -> Path:
    """Where the package `name` (dotted) lives, found without importing it: the repository's top-level
    `drafters/` or `verify/` in a checkout, ``specserve/drafters`` and so on in an installed wheel."""
    import importlib.util

    return Path(importlib.util.find_spec(name).origin).resolve().parent
