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

import numpy as np
import torch

from specserve.verify import tree_kernels as kernels


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One request's draft tree.

    tokens:  int64[N]   draft token ids, topologically ordered (a parent before its children).
    parents: int64[N]   parent node index, ``-1`` for children of the root; ``parents[i] < i``.

    The draft distribution each node was drawn from (for stochastic verification), *given its earlier
    siblings* (a drafter sampling siblings without replacement gives q with the earlier siblings
    removed and renormalised; one sampling i.i.d. gives q itself). Compact, as drafters give it:

    q_ids:   int64[N, K]   the support of each node's q (K ids; -1 pads a shorter support);
    q_probs: float32[N, K] q over that support (sums to 1 per row; 0 at padding).

    or dense, as tests and hand-built trees find convenient: ``probs`` float32[N, V]. None of them
    means every node is a deterministic proposal (one-hot q), as for n-gram drafts. q tensors may live
    on the device that verifies the tree; tokens and parents live on the CPU (trees are small).

    scores:  float32[N] or None — the drafter's own guess at log P(node is accepted), never above its
             parent's (EAGLE-2's cumulative draft log-probabilities; for sampled requests a guess from
             sibling ranks only, never from drawn values). The adaptive policy calibrates them against
             what is accepted and cuts trees by them; None: the policy ranks nodes by depth.
    sources: tuple[str, ...] or None — which drafter proposed each node (a hybrid drafter's parts, e.g.
             "suffix", "eagle" or "suffix+eagle" when both did); request stats count accepted tokens by it.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    sources: tuple[str, ...] | None = None

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
        if n and not kernels.parents_valid(parents.numpy()):
            raise ValueError(f"DraftTree.parents must satisfy -1 <= parents[i] < i, got {parents.tolist()}")
        if n and int(tokens.min()) < 0:
            raise ValueError("DraftTree.tokens must be non-negative token ids")
        if self.probs is not None:
            if self.probs.dim() != 2 or self.probs.shape[0] != n:
                raise ValueError(f"DraftTree.probs must be [N={n}, vocab], got {tuple(self.probs.shape)}")
            if self.q_ids is not None or self.q_probs is not None:
                raise ValueError("give a DraftTree's q either dense (probs) or compact (q_ids, q_probs), not both")
        if (self.q_ids is None) != (self.q_probs is None):
            raise ValueError("DraftTree.q_ids and .q_probs come together")
        if self.q_ids is not None:
            if self.q_ids.dim() != 2 or self.q_ids.shape[0] != n or self.q_probs.shape != self.q_ids.shape:
                raise ValueError(f"DraftTree.q_ids and .q_probs must both be [N={n}, K], got "
                                 f"{tuple(self.q_ids.shape)} and {tuple(self.q_probs.shape)}")
        if self.scores is not None and tuple(self.scores.shape) != (n,):
            raise ValueError(f"DraftTree.scores must be [N={n}], got {tuple(self.scores.shape)}")
        if self.sources is not None and len(self.sources) != n:
            raise ValueError(f"DraftTree.sources must name N={n} nodes, got {len(self.sources)}")

    @property
    def has_q(self) -> bool:
        """Whether the nodes carry draft distributions (else they are deterministic, one-hot q)."""
        return self.probs is not None or self.q_ids is not None

    @cached_property
    def compact_q(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q_ids int64[N, K], q_probs float32[N, K]) — the compact form, made from dense probs when
        given that way (support = the nonzero entries); None for deterministic drafts."""
        if self.q_ids is not None:
            return self.q_ids, self.q_probs
        if self.probs is None:
            return None
        probs = self.probs.float()
        k = max(int((probs > 0).sum(-1).max()), 1) if self.num_nodes else 1
        values, ids = probs.topk(k, dim=-1)
        return torch.where(values > 0, ids, -1), values

    def q_dense(self, vocab: int) -> torch.Tensor | None:
        """float32[N, vocab]: each node's q over the whole vocabulary (None for deterministic drafts)."""
        if self.probs is not None:
            return self.probs.float()
        if self.q_ids is None:
            return None
        dense = torch.zeros(self.num_nodes, vocab, device=self.q_probs.device)
        valid = self.q_ids >= 0
        dense.scatter_add_(1, self.q_ids.clamp(min=0), torch.where(valid, self.q_probs.float(), 0.0))
        return dense

    # ---- construction helpers -------------------------------------------------------------------

    @staticmethod
    def empty() -> "DraftTree":
        """The tree of plain decoding: no draft nodes, only the root is verified."""
        return DraftTree(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))

    @staticmethod
    def chain(tokens: list[int] | torch.Tensor, probs: torch.Tensor | None = None) -> "DraftTree":
        """A single draft sequence: node i's parent is node i-1 (probs: dense q, optional)."""
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

    def subtree(self, keep: np.ndarray) -> "DraftTree":
        """The tree of the nodes `keep` (int64, ascending, closed under ancestors), renumbered in the same
        order, with their q and scores. Keeping every earlier sibling of a kept sampled node is the
        caller's duty: a sampled sibling's q assumes the earlier ones were tried first."""
        keep = np.asarray(keep, dtype=np.int64)
        if len(keep) == self.num_nodes:
            return self
        parents = self.parents.numpy()[keep]
        index = np.full(self.num_nodes, -1, dtype=np.int64)
        index[keep] = np.arange(len(keep))
        new_parents = np.where(parents >= 0, index[np.maximum(parents, 0)], -1)
        if (new_parents[parents >= 0] < 0).any():
            raise ValueError("subtree: the kept nodes are not closed under ancestors")
        rows = torch.from_numpy(keep)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows.to(t.device)]

        sources = None if self.sources is None else tuple(self.sources[i] for i in keep)
        return DraftTree(self.tokens[rows], torch.from_numpy(new_parents), pick(self.probs), pick(self.q_ids),
                         pick(self.q_probs), pick(self.scores), sources)

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
        return torch.from_numpy(kernels.depths(self.parents.numpy()))

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
        q = "None" if not self.has_q else tuple((self.probs if self.probs is not None else self.q_ids).shape)
        return f"DraftTree(tokens={self.tokens.tolist()}, parents={self.parents.tolist()}, q={q})"
