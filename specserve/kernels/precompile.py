"""Compiling one kernel signature in a second process while this one compiles the rest (a first start).

On a fresh install the first forward compiles every kernel one after another in one process, in one thread:
the decoder layer (the layers' products and paged attention nested in it), then the LM head's product. On the
default model the head has a weight type of its own (Q8_0 beside the layers' Q4_1): ~75 s of the ~210 s
before the first token on 2 cores when this was written, ~13 s of ~39 s since the kernels' loop bodies compile
as functions of their own, while the second core would sit idle. So when the head's signature is not in
numba's cache, `compile_elsewhere` has a child process compile exactly that signature (its numba types,
pickled) into the shared cache while this process compiles the layer; before its first call the head waits for
the child, and numba then loads the kernel from the cache. Saves to one function's cache from two processes
are serialised by `specserve.numba_cache.lock_cache_index`.

Run as ``python -m specserve.kernels.precompile FILE``: FILE holds the pickled (module, function, signature).
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile

log = logging.getLogger("specserve")


class CompileElsewhere:
    """A child process compiling one signature (`wait` before this process calls it)."""

    def __init__(self, process: subprocess.Popen, job: str) -> None:
        self._process, self._job = process, job

    def wait(self) -> None:
        """Until the child is done (whatever its outcome: numba compiles the signature here if it is not cached)."""
        try:
            _, err = self._process.communicate()
            if self._process.returncode:
                log.warning("compiling a kernel in a second process failed; compiling it here: %s",
                            (err or "").strip().splitlines()[-1:])
        finally:
            try:
                os.unlink(self._job)  # the child removes it once read; not if it died first
            except OSError:
                pass


def is_cached(dispatcher, signature: tuple) -> bool | None:
    """Whether numba's cache holds `signature` of `dispatcher` for this CPU (None: numba's internals moved)."""
    try:
        cache = dispatcher._cache
        key = cache._index_key(signature, dispatcher.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 — numba internals: say "unknown" rather than guess
        return None


def compile_elsewhere(dispatcher, args: tuple) -> CompileElsewhere | None:
    """Start compiling `dispatcher` for the types of `args` in a child process, when it is worth it: more than one
    core, and the signature not in numba's cache. None otherwise."""
    import numba

    if (os.cpu_count() or 1) < 2:
        return None
    signature = tuple(numba.typeof(a) for a in args)
    if is_cached(dispatcher, signature) is not False:
        return None
    fd, job = tempfile.mkstemp(prefix="specserve-compile-", suffix=".pickle")
    with os.fdopen(fd, "wb") as f:
        pickle.dump((dispatcher.py_func.__module__, dispatcher.py_func.__name__, signature), f)
    process = subprocess.Popen([sys.executable, "-m", "specserve.kernels.precompile", job],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return CompileElsewhere(process, job)


def main(job: str) -> None:
    with open(job, "rb") as f:
        module, name, signature = pickle.load(f)
    os.unlink(job)
    getattr(importlib.import_module(module), name).compile(signature)


if __name__ == "__main__":
    main(sys.argv[1])
