"""How much of an array's memory is resident (Linux ``mincore``), so that a leak check can leave out the first
touches of memory reserved up front.

The CPU KV cache is allocated zeroed but untouched (`kv_cache._zeros`: the OS maps a page in when a block is
first written), so a server's resident memory climbs in steps for as long as new blocks are reached — a longer
prompt than any before, more clients at once — up to the cache's full size. That is not a leak, and a soak that
counts it cannot tell one apart: `bench soak` measures the process's RSS less the cache's resident pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np

_PAGE = mmap.PAGESIZE


def _mincore():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = libc.mincore
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return fn


try:
    _MINCORE = _mincore()
except (OSError, AttributeError):  # no libc mincore (not Linux/BSD): nothing is subtracted
    _MINCORE = None


def resident_bytes(array: np.ndarray) -> int:
    """Bytes of the pages under `array`'s memory (C-contiguous) that are resident now, whole pages counted (the
    first and last may hold other data too). 0 where mincore is unavailable or fails."""
    if _MINCORE is None or array.nbytes == 0:
        return 0
    start = array.ctypes.data
    first = start - start % _PAGE
    length = start + array.nbytes - first
    pages = -(-length // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _MINCORE(first, length, vec) != 0:
        return 0
    return int(np.frombuffer(vec, dtype=np.uint8).__and__(1).sum()) * _PAGE


def resident_mib(arrays) -> float:
    """`resident_bytes` summed over `arrays` (numpy arrays, or CPU torch tensors), in MiB; GPU tensors count 0."""
    total = 0
    for a in arrays:
        if hasattr(a, "device") and getattr(a.device, "type", "cpu") != "cpu":
            continue
        total += resident_bytes(a.numpy() if hasattr(a, "numpy") else a)
    return total / 2**20
