"""The draft trees of one verify step, packed into flat arrays (one pass, numba) for batched acceptance.

B requests with N_b nodes each: N = sum N_b nodes and R = N + B verify rows. Request b's rows are
``cu_rows[b] .. cu_rows[b+1] - 1``: its root row first, then one row per node (node i at row
``cu_rows[b] + 1 + i``). Nodes are numbered globally: request b's node i is ``cu_nodes[b] + i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch

from specserve.verify.tree import DraftTree


@dataclass(frozen=True)
class PackedTrees:
    """Flat structure of a step's trees (host numpy) and their draft distributions.

    cu_rows:      int64[B+1]  verify rows per request (root + nodes), cumulative.
    cu_nodes:     int64[B+1]  nodes per request, cumulative.
    tokens:       int64[N]    draft tokens, request after request.
    parent_row:   int64[N]    the global verify row each node's token follows (its parent's row).
    first_child:  int64[R]    the global node of each row's first child, -1 when none.
    next_sibling: int64[N]    the next global node with the same parent, -1 when none.
    depth:        int64[N]    children of a root have depth 1.
    q_ids:        int64[N, K] each node's draft distribution, compact (one-hot at its own token for
    q_probs:      float32[N, K] deterministic drafts; -1 / 0 pad shorter supports). torch tensors on
                  `q_device`: the distributions stay where the drafter made them. Empty [0, 1] when packed
                  without them (`pack_trees(..., with_q=False)`: greedy requests only).
    """

    cu_rows: np.ndarray
    cu_nodes: np.ndarray
    tokens: np.ndarray
    parent_row: np.ndarray
    first_child: np.ndarray
    next_sibling: np.ndarray
    depth: np.ndarray
    q_ids: torch.Tensor
    q_probs: torch.Tensor

    @property
    def num_requests(self) -> int:
        return len(self.cu_rows) - 1

    @property
    def num_rows(self) -> int:
        return int(self.cu_rows[-1])

    @property
    def num_nodes(self) -> int:
        return int(self.cu_nodes[-1])

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.depth.size else 0

    def node_rows(self) -> np.ndarray:
        """int64[N]: the global verify row of each node."""
        request = np.repeat(np.arange(self.num_requests), np.diff(self.cu_nodes))
        return self.cu_rows[request] + 1 + (np.arange(self.num_nodes) - self.cu_nodes[request])


def pack_trees(trees: Sequence[DraftTree], q_device: torch.device | str = "cpu", with_q: bool = True) -> PackedTrees:
    """Pack one step's trees (validated when they were built: nothing is checked twice). with_q=False leaves the
    draft distributions out (q_ids, q_probs empty [0, 1]): greedy acceptance never reads them, and a step of greedy
    requests then skips their packing (a handful of tensor calls, each slow on the caches a forward has emptied)."""
    sizes = np.fromiter((t.num_nodes for t in trees), dtype=np.int64, count=len(trees))
    if not sizes.any():  # plain decoding: every tree is empty
        return _empty_pack(len(trees), torch.device(q_device))
    cu_nodes = np.zeros(len(trees) + 1, dtype=np.int64)
    np.cumsum(sizes, out=cu_nodes[1:])
    cu_rows = cu_nodes + np.arange(len(trees) + 1, dtype=np.int64)
    nonempty = [t for t in trees if t.num_nodes]
    tokens = np.concatenate([t.tokens.numpy() for t in nonempty]) if nonempty else np.zeros(0, np.int64)
    parents = np.concatenate([t.parents.numpy() for t in nonempty]) if nonempty else np.zeros(0, np.int64)
    parent_row, first_child, next_sibling, depth = _structure(parents, cu_nodes, cu_rows)
    q_ids, q_probs = _pack_q(trees, tokens, q_device) if with_q else _no_q(torch.device(q_device))
    return PackedTrees(cu_rows, cu_nodes, tokens, parent_row, first_child, next_sibling, depth, q_ids, q_probs)


@numba.njit(cache=True, nogil=True)
def _structure(parents, cu_nodes, cu_rows):
    """Global parent rows, first-child / next-sibling links and depths from per-tree parent arrays."""
    num_nodes = parents.shape[0]
    parent_row = np.empty(num_nodes, np.int64)
    depth = np.empty(num_nodes, np.int64)
    first_child = np.full(cu_rows[-1], -1, np.int64)
    next_sibling = np.full(num_nodes, -1, np.int64)
    for b in range(cu_nodes.shape[0] - 1):
        n0, r0 = cu_nodes[b], cu_rows[b]
        for g in range(n0, cu_nodes[b + 1]):
            p = parents[g]
            parent_row[g] = r0 + 1 + p if p >= 0 else r0
            depth[g] = depth[n0 + p] + 1 if p >= 0 else 1
        for g in range(cu_nodes[b + 1] - 1, n0 - 1, -1):  # backwards: the lowest-index child ends up first
            row = parent_row[g]
            next_sibling[g] = first_child[row]
            first_child[row] = g
    return parent_row, first_child, next_sibling, depth


def _pack_q(trees: Sequence[DraftTree], tokens: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] compact q of every node; deterministic trees become one-hot at their own tokens."""
    compact = [t.compact_q if t.num_nodes else None for t in trees]
    width = max([1] + [c[0].shape[1] for c in compact if c is not None])
    num_nodes = tokens.shape[0]
    if all(c is None for c in compact):  # deterministic drafts only (n-gram, greedy requests)
        ids = torch.full((num_nodes, 1), -1, dtype=torch.int64)
        ids[:, 0] = torch.from_numpy(tokens)
        return ids.to(device), torch.ones(num_nodes, 1, device=device)
    id_parts, prob_parts = [], []
    for tree, c in zip(trees, compact):
        n = tree.num_nodes
        if not n:
            continue
        if c is None:
            ids = torch.full((n, width), -1, dtype=torch.int64, device=device)
            ids[:, 0] = tree.tokens.to(device)
            probs = torch.zeros(n, width, device=device)
            probs[:, 0] = 1.0
        else:
            ids, probs = c[0].to(device), c[1].to(device, torch.float32)
            if ids.shape[1] < width:
                pad = width - ids.shape[1]
                ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
                probs = torch.nn.functional.pad(probs, (0, pad))
        id_parts.append(ids)
        prob_parts.append(probs)
    return torch.cat(id_parts), torch.cat(prob_parts)


_NO_Q: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _no_q(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty q_ids int64[0, 1] and q_probs float32[0, 1] on `device` (made once per device)."""
    if device not in _NO_Q:
        _NO_Q[device] = (torch.zeros(0, 1, dtype=torch.int64, device=device), torch.zeros(0, 1, device=device))
    return _NO_Q[device]


def _empty_pack(num_requests: int, device: torch.device) -> PackedTrees:
    """The packing of `num_requests` empty trees (one root row each), without the general path's work."""
    none = np.zeros(0, dtype=np.int64)
    return PackedTrees(np.arange(num_requests + 1, dtype=np.int64), np.zeros(num_requests + 1, dtype=np.int64), none,
                       none, np.full(num_requests, -1, dtype=np.int64), none, none, *_no_q(device))
