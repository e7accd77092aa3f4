"""Compiled walks over a tree's parent array (numba): the derived structures of `DraftTree`.

Each is one pass over the nodes in topological order — a parent's row is final before its
children read it — in compiled code, so deriving a tree's layout costs microseconds and never
touches torch's thread pool (tiny matmuls there stall on a busy machine).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """bool[N+1, N+1] over verify rows (row 0 = root): mask[a, b] = row b is row a or its ancestor."""
    n = parents.shape[0]
    mask = np.zeros((n + 1, n + 1), dtype=np.bool_)
    mask[0, 0] = True
    for i in range(n):
        row = i + 1
        mask[row, :] = mask[parents[i] + 1, :]
        mask[row, row] = True
    return mask


@numba.njit(cache=True, nogil=True)
def depths(parents: np.ndarray) -> np.ndarray:
    """int64[N]: each node's depth (children of the root: 1)."""
    out = np.ones(parents.shape[0], dtype=np.int64)
    for i in range(parents.shape[0]):
        if parents[i] >= 0:
            out[i] = out[parents[i]] + 1
    return out


@numba.njit(cache=True, nogil=True)
def first_child_next_sibling(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first_child int64[N+1] per row, next_sibling int64[N] per node), -1 where none."""
    n = parents.shape[0]
    first_child = np.full(n + 1, -1, dtype=np.int64)
    next_sibling = np.full(n, -1, dtype=np.int64)
    for i in range(n - 1, -1, -1):  # backwards, so the lowest-index child ends up first
        row = parents[i] + 1
        next_sibling[i] = first_child[row]
        first_child[row] = i
    return first_child, next_sibling


@numba.njit(cache=True, nogil=True)
def parents_valid(parents: np.ndarray) -> bool:
    """-1 <= parents[i] < i for every node (parents before children)."""
    for i in range(parents.shape[0]):
        if parents[i] < -1 or parents[i] >= i:
            return False
    return True
