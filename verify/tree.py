"""The one canonical draft tree, and everything derived from it.

Vocabulary used throughout `verify/`:

- the **root** is the request's pending token: the last token already emitted to the user whose KV
  is not yet in the cache. It is not part of the tree's arrays; the verify forward feeds it first.
- **nodes** ``0..N-1`` are draft tokens. ``parents[i] == -1`` means node ``i`` is a child of the root;
  otherwise ``parents[i] < i`` (nodes are stored in topological order, parents first).
- the **verify rows** of a tree are ``N + 1``: row 0 is the root, row ``i + 1`` is node ``i``. The
  target's distribution at row ``r`` is the distribution of the *next* token after that row's prefix,
  i.e. the distribution the children of that row are checked against.
- an **accepted path** is a root→node chain of node indices; the **bonus token** is sampled from the
  target at the last accepted row (the root when nothing was accepted).

A chain is a tree whose parents are ``[-1, 0, 1, ...]``; plain decoding is the empty tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from specserve.verify import tree_kernels as kernels


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One request's draft tree.

    tokens:  int64[N]   draft token ids, topologically ordered (a parent before its children).
    parents: int64[N]   parent node index, ``-1`` for children of the root; ``parents[i] < i``.
    probs:   float32[N, V] or None. ``probs[i]`` is the exact distribution node ``i`` was drawn from,
             *given its earlier siblings* (a drafter sampling siblings without replacement stores q
             with the earlier siblings removed and renormalised; one sampling i.i.d. stores q itself).
             None means every node is a deterministic proposal (one-hot q), as for n-gram drafts.

    All tensors live on the CPU: trees are small, and the verifier packs them for the device.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens, parents = self.tokens, self.parents
        if not isinstance(tokens, torch.Tensor) or not isinstance(parents, torch.Tensor):
            raise TypeError("DraftTree.tokens and .parents must be torch tensors")
        if tokens.dim() != 1 or parents.dim() != 1 or tokens.shape != parents.shape:
            raise ValueError(
                f"DraftTree.tokens and .parents must be 1-D of one length, got "
                f"{tuple(tokens.shape)} and {tuple(parents.shape)}"
            )
        if tokens.dtype != torch.int64 or parents.dtype != torch.int64:
            raise TypeError("DraftTree.tokens and .parents must be int64")
        n = tokens.numel()
        if n and bool(((parents < -1) | (parents >= torch.arange(n))).any()):
            raise ValueError(f"DraftTree.parents must satisfy -1 <= parents[i] < i, got {parents.tolist()}")
        if n and int(tokens.min()) < 0:
            raise ValueError("DraftTree.tokens must be non-negative token ids")
        if self.probs is not None:
            if self.probs.dim() != 2 or self.probs.shape[0] != n:
                raise ValueError(f"DraftTree.probs must be [N={n}, vocab], got {tuple(self.probs.shape)}")

    # ---- construction helpers -------------------------------------------------------------------

    @staticmethod
    def empty() -> "DraftTree":
        """The tree of plain decoding: no draft nodes, only the root is verified."""
        return DraftTree(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))

    @staticmethod
    def chain(tokens: list[int] | torch.Tensor, probs: torch.Tensor | None = None) -> "DraftTree":
        """A single draft sequence: node i's parent is node i-1."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        parents = torch.arange(tokens.numel(), dtype=torch.int64) - 1
        return DraftTree(tokens, parents, probs)

    @staticmethod
    def from_paths(paths: list[list[int]]) -> "DraftTree":
        """A tree from root→leaf token paths; shared prefixes are merged (a trie).

        Paths are inserted in order, so earlier paths keep lower node indices (and, as siblings,
        are tried first by the stochastic verifier).
        """
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for path in paths:
            parent = -1
            for tok in path:
                key = (parent, int(tok))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(parent)
                parent = index[key]
        return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))

    # ---- derived structure ----------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """bool[N+1, N+1] over verify rows: ``mask[a, b]`` is True when row b is row a or an ancestor.

        Row 0 (the root) is an ancestor of every row. This is the attention mask among the tree's own
        tokens in the verify forward (every row also sees the whole committed prefix).
        """
        return torch.from_numpy(kernels.ancestor_mask(self.parents.numpy()))

    @cached_property
    def depths(self) -> torch.Tensor:
        """int64[N]: depth of each node; children of the root have depth 1."""
        return self.ancestor_mask[1:].sum(dim=1) - 1

    def positions(self, committed_len: int) -> torch.Tensor:
        """int64[N+1]: absolute positions of the verify rows; the root sits at ``committed_len``."""
        return committed_len + torch.cat([torch.zeros(1, dtype=torch.int64), self.depths])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0

    @cached_property
    def is_leaf(self) -> torch.Tensor:
        """bool[N]: nodes with no children."""
        has_child = torch.zeros(self.num_nodes + 1, dtype=torch.bool)
        has_child[self.parents + 1] = True
        return ~has_child[1:]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (inclusive)."""
        rows = torch.nonzero(self.ancestor_mask[node + 1, 1:]).flatten()
        return rows.tolist()  # ancestors have lower indices, so index order is root→node order

    def paths(self) -> list[list[int]]:
        """Every root→leaf path, as lists of node indices."""
        return [self.path_to(int(leaf)) for leaf in torch.nonzero(self.is_leaf).flatten()]

    @cached_property
    def first_child_next_sibling(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first_child int64[N+1], next_sibling int64[N]) over rows/nodes, -1 where none.

        ``first_child[r]`` is the first node whose parent row is r; ``next_sibling[i]`` the next node
        with the same parent. The layout kernels and the stochastic verifier walk.
        """
        first_child, next_sibling = kernels.first_child_next_sibling(self.parents.numpy())
        return torch.from_numpy(first_child), torch.from_numpy(next_sibling)

    def children(self, row: int) -> list[int]:
        """Node indices whose parent is verify row ``row`` (0 = root), in sibling order."""
        first_child, next_sibling = self.first_child_next_sibling
        out = []
        node = int(first_child[row])
        while node != -1:
            out.append(node)
            node = int(next_sibling[node])
        return out

    def __repr__(self) -> str:
        return (
            f"DraftTree(tokens={self.tokens.tolist()}, parents={self.parents.tolist()}, "
            f"probs={'None' if self.probs is None else tuple(self.probs.shape)})"
        )
