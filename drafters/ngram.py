"""The ``ngram`` drafter: prompt-lookup drafting from the request's own context.

No weights, no state. For each request the context's suffix n-gram (n = ``max_ngram`` down to
``min_ngram``) is looked up earlier in the context; what followed each occurrence (up to ``depth``
tokens) is a candidate continuation of the root. Ranking:

1. longer n first; shorter n only fills the branches the longer ones left free;
2. within one n, distinct continuations by how often they occur (frequency), then by recency (the
   most recent occurrence first).

Continuations are merged, in that order, into a trie (shared prefixes share nodes) with at most
``branching`` leaves and ``min(budget, max_budget)`` nodes; higher-priority continuations get lower
node indices, so they are tried first. A continuation the trie already contains adds nothing; one that
only extends an existing leaf (typically a longer copy of a continuation the end of the context cut
short) deepens that path without using a branch; one that would branch off once ``branching`` leaves
exist is skipped; the one being inserted when the node cap is hit is truncated. The matching and the
trie are numba kernels (`specserve.drafters.ngram_match`); the Python side only loops over the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.drafters.base import check_int_option, DraftRequest, Drafter, TargetInfo, register
from specserve.drafters.ngram_match import build_ngram_tree
from specserve.verify import DraftTree


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    return check_int_option("ngram", name, value, low, high)


@register("ngram")
class NgramDrafter(Drafter):
    """N-gram / prompt-lookup drafter (one-hot drafts, stateless).

    Options:
      min_ngram:  shortest suffix n-gram looked up, >= 1.
      max_ngram:  longest suffix n-gram looked up, >= min_ngram.
      branching:  most leaves (root→leaf paths, i.e. distinct continuations) per tree, >= 1.
      depth:      most tokens per continuation (tree depth), >= 1.
      max_budget: most nodes per tree, >= 1; each tree has at most ``min(budget, max_budget)``.
    """

    needs_hidden_states = False
    gives_probs = False

    def __init__(
        self,
        target: TargetInfo,
        path: str | None = None,
        *,
        min_ngram: int = 1,
        max_ngram: int = 4,
        branching: int = 4,
        depth: int = 6,
        max_budget: int = 24,
    ) -> None:
        if path is not None:
            raise ValueError(f"the ngram drafter takes no path, got {path!r}")
        self.target = target
        self.min_ngram = _check("min_ngram", min_ngram, 1)
        self.max_ngram = _check("max_ngram", max_ngram, self.min_ngram)
        self.branching = _check("branching", branching, 1)
        self.depth = _check("depth", depth, 1)
        self.max_budget = _check("max_budget", max_budget, 1)

    def propose(self, requests: list[DraftRequest], budgets: list[int], depth: int | None = None) -> list[DraftTree]:
        if len(budgets) != len(requests):
            raise ValueError(f"propose got {len(requests)} requests but {len(budgets)} budgets")
        trees = []
        for request, budget in zip(requests, budgets):
            budget = int(budget)
            if budget < 0:
                raise ValueError(f"budget for request {request.request_id!r} must be >= 0, got {budget}")
            trees.append(self.propose_one(request.token_ids, budget, depth))
        return trees

    def propose_one(self, token_ids: np.ndarray, budget: int, depth: int | None = None) -> DraftTree:
        """The tree for one context (int64[L], last entry = root), node budget and depth cap."""
        cap = min(int(budget), self.max_budget)
        ctx = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(-1)
        if cap <= 0 or ctx.shape[0] < 2:
            return DraftTree.empty()
        depth = self.depth if depth is None else max(1, min(depth, self.depth))
        tokens, parents = build_ngram_tree(ctx, self.min_ngram, self.max_ngram, self.branching, depth, cap)
        if tokens.shape[0] == 0:
            return DraftTree.empty()
        return DraftTree(torch.from_numpy(tokens), torch.from_numpy(parents))

    def __repr__(self) -> str:
        return (
            f"NgramDrafter(min_ngram={self.min_ngram}, max_ngram={self.max_ngram}, branching={self.branching}, "
            f"depth={self.depth}, max_budget={self.max_budget})"
        )
