"""One huge-page-backed block of memory for a model's packed weights.

A decode step streams every weight once, so it runs at memory bandwidth; with 4 KiB pages that stream
also walks the page tables every 4 KiB. Packing a model's weights into one 2 MiB-aligned anonymous
mapping advised MADV_HUGEPAGE (Linux transparent huge pages in "madvise" mode, the common default)
removes most of those walks: measured here, the products of the embedded model read 10 % faster on one
thread (BENCHMARKS.md, "CPU kernels"). Where huge pages are unavailable the advice is ignored and the
arena is ordinary memory.
"""

from __future__ import annotations

import mmap

import numpy as np

_HUGE = 2 << 20
_ALIGN = 64  # a cache line: every array starts on one


def pack_into_arena(arrays: list[np.ndarray]) -> tuple[list[np.ndarray], mmap.mmap]:
    """Copies of `arrays` laid out in one huge-page-advised mapping (keep the mapping alive with them)."""
    sizes = [-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays]
    mapping = mmap.mmap(-1, sum(sizes) + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: ordinary pages
            pass
    buf = np.frombuffer(mapping, dtype=np.uint8)
    offset = (-buf.ctypes.data) % _HUGE
    out = []
    for a, size in zip(arrays, sizes):
        view = buf[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        out.append(view)
        offset += size
    return out, mapping
