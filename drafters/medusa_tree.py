"""Medusa token trees: static trees from rank paths ("choices"), dynamic trees from head scores.

A Medusa tree is a tree of *ranks*: a node at depth d with rank j takes the j-th candidate of head
d-1 (greedy: its j-th most likely token; sampled: its j-th token drawn without replacement). Every
node of one depth reads the same head, because all heads read the same target feature.

Shapes are host-side numpy arrays (trees are small): ``parents`` int64[N] (-1 = child of the root,
``parents[i] < i``), ``depths`` int64[N] (children of the root have depth 1), ``ranks`` int64[N].
Node order is a priority order: cutting a tree to a budget B keeps nodes ``0..B-1``, which is always
ancestor-closed — for the static tree that order comes from the choices list (best first), for the
dynamic tree from the scores.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.verify import tree_kernels

# 20 nodes for 4 heads, best first: deep along the top-1 path, then second and third guesses near the
# root. Trained checkpoints carry their own list (built from held-out rank accuracies, see
# `choices_from_accuracies`), which the drafter prefers.
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 0, 0), (0, 1), (2,), (1, 0), (0, 0, 0, 0), (0, 0, 1), (3,),
    (0, 2), (2, 0), (1, 1), (0, 1, 0), (0, 0, 0, 1), (4,), (0, 0, 2), (1, 0, 0), (0, 3), (0, 0, 1, 0),
)


def parse_choices(value: object) -> tuple[tuple[int, ...], ...]:
    """Choices as given by a user: a list of lists of ranks, or that list as a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"medusa choices must be a JSON list of lists of ranks, e.g. [[0],[1],[0,0]]: {exc}") from exc
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"medusa choices must be a non-empty list of lists of ranks, e.g. [[0],[1],[0,0]], got {value!r}")
    paths = []
    for path in value:
        ok = isinstance(path, (list, tuple)) and len(path) > 0 and all(
            isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0 for r in path)
        if not ok:
            raise ValueError(f"medusa choices: every path must be a non-empty list of ranks >= 0, got {path!r}")
        paths.append(tuple(int(r) for r in path))
    return tuple(paths)


@dataclass(frozen=True, eq=False)
class StaticTree:
    """The buffers of a static Medusa tree, derived once from its paths.

    choices: the paths in node order; node i is the path ``choices[i]``.
    parents/depths/ranks: int64[N] (see the module docstring); ancestors: bool[N, N], ``[i, j]`` True
    when node j is node i or one of its ancestors (the tree's attention mask without the root).
    """

    choices: tuple[tuple[int, ...], ...]
    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray
    ancestors: np.ndarray

    @staticmethod
    def from_choices(choices: object) -> StaticTree:
        """Validate the paths (no duplicates, every prefix present) and order the nodes.

        Order: a node's priority is the earliest position in the list of its own path or of any path
        below it; nodes are sorted by (priority, depth). The list's order is thus kept wherever it is
        ancestor-closed, and a parent always precedes its children, so every prefix of the node order
        is a valid tree.
        """
        paths = parse_choices(choices)
        position: dict[tuple[int, ...], int] = {}
        for i, path in enumerate(paths):
            if path in position:
                raise ValueError(f"medusa choices: path {list(path)} appears twice")
            position[path] = i
        for path in paths:
            for end in range(1, len(path)):
                if path[:end] not in position:
                    raise ValueError(f"medusa choices: path {list(path)} needs its prefix {list(path[:end])}, "
                                     "which is missing (every prefix of a path must be a path too)")
        priority = dict(position)
        for path, i in position.items():
            for end in range(1, len(path)):
                priority[path[:end]] = min(priority[path[:end]], i)
        ordered = sorted(paths, key=lambda p: (priority[p], len(p)))
        index = {p: i for i, p in enumerate(ordered)}
        parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in ordered], dtype=np.int64)
        depths = np.array([len(p) for p in ordered], dtype=np.int64)
        ranks = np.array([p[-1] for p in ordered], dtype=np.int64)
        ancestors = np.ascontiguousarray(tree_kernels.ancestor_mask(parents)[1:, 1:])  # without the root's row and column
        return StaticTree(tuple(ordered), parents, depths, ranks, ancestors)

    @property
    def num_nodes(self) -> int:
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @property
    def max_rank(self) -> int:
        return int(self.ranks.max())

    def limited_to(self, depth: int) -> StaticTree:
        """The tree without nodes deeper than ``depth`` (still ancestor-closed, order kept)."""
        kept = [p for p in self.choices if len(p) <= depth]
        if not kept:
            raise ValueError(f"medusa choices have no path of depth <= {depth}")
        return StaticTree.from_choices(kept)

    def positions(self, committed_len: int) -> np.ndarray:
        """int64[N+1]: verify-row positions (root at ``committed_len``), as `DraftTree.positions` derives."""
        return committed_len + np.concatenate([[0], self.depths])


def sibling_index(parents: np.ndarray) -> np.ndarray:
    """int64[N]: how many earlier nodes share each node's parent (its draw index among siblings)."""
    n = len(parents)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(parents, kind="stable")
    sorted_parents = parents[order]
    starts = np.concatenate([[True], sorted_parents[1:] != sorted_parents[:-1]])
    group_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    out = np.empty(n, dtype=np.int64)
    out[order] = np.arange(n) - group_start
    return out


def select_dynamic(logscores: torch.Tensor, budgets: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The best ``budgets[r]`` rank paths of each request by summed per-depth log score.

    logscores: float[R, D, k], ``[r, d, j]`` the log score of taking rank j at depth d+1 (must be <= 0
    and non-increasing in j). A path's score is the sum over its depths, so a child never beats its
    parent and the best B paths are ancestor-closed (ties go to the shallower, then earlier, node).
    Only the best max(budgets) nodes of each depth can be chosen, so each depth keeps that many:
    no loop over nodes. Returns (parents, depths, ranks) per request, in topological order.
    """
    num_r, depth, k = logscores.shape
    cap = max(int(b) for b in budgets) if len(budgets) else 0
    if num_r == 0 or cap == 0:
        return [(np.zeros(0, np.int64),) * 3 for _ in range(num_r)]
    logscores = logscores.float().cpu()
    level_scores, level_parents, level_ranks = [], [], []
    prev = None
    for d in range(depth):
        if prev is None:
            cand = logscores[:, 0, :]  # [R, k]
        else:
            cand = (prev[:, :, None] + logscores[:, d, None, :]).reshape(num_r, -1)  # [R, n_prev * k]
        keep = min(cap, cand.shape[1])
        order = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :keep]  # [R, keep]
        prev = cand.gather(1, order)
        level_scores.append(prev)
        level_parents.append(order // k if d else torch.full_like(order, -1))
        level_ranks.append(order % k)
    sizes = [s.shape[1] for s in level_scores]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    scores = torch.cat(level_scores, dim=1)  # [R, M] in level-major order: parents before children
    parent_flat = torch.cat([p + int(offsets[d - 1]) if d else p
                             for d, p in enumerate(level_parents)], dim=1)  # [R, M], -1 at depth 1
    ranks = torch.cat(level_ranks, dim=1)
    depths = torch.cat([torch.full((num_r, s), d + 1, dtype=torch.int64) for d, s in enumerate(sizes)], dim=1)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    place = torch.empty_like(order)
    place.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())
    budget_t = torch.tensor([int(b) for b in budgets], dtype=torch.int64)[:, None]
    selected = (place < budget_t) & torch.isfinite(scores)  # [R, M], ancestor-closed
    node = torch.cumsum(selected.long(), dim=1) - 1
    parent_node = torch.where(parent_flat >= 0, node.gather(1, parent_flat.clamp_min(0)), torch.full_like(node, -1))
    out = []
    sel_np, par_np, dep_np, rank_np = selected.numpy(), parent_node.numpy(), depths.numpy(), ranks.numpy()
    for r in range(num_r):
        m = sel_np[r]
        out.append((par_np[r][m].copy(), dep_np[r][m].copy(), rank_np[r][m].copy()))
    return out


def sampled_logscores(q_max: torch.Tensor, k: int) -> torch.Tensor:
    """Value-independent scores for sampled dynamic trees: float[R, D, k] from float[R, D].

    At temperature > 0 a tree's shape must not depend on the tokens drawn into it. It may depend on
    the heads' distributions, which are fixed before any draw: with a_d = max q_d (clamped to
    [0.05, 0.95]) as the chance a depth-d draw is accepted, the j-th drawn sibling is reached and
    accepted with chance about a_d (1 - a_d)^j.
    """
    a = q_max.float().clamp(0.05, 0.95)[..., None]  # [R, D, 1]
    j = torch.arange(k, dtype=torch.float32)
    return torch.log(a) + j * torch.log1p(-a)


def choices_from_accuracies(rank_accuracy: Sequence[Sequence[float]], size: int) -> list[list[int]]:
    """A static tree of ``size`` nodes maximising the expected accepted length, best first.

    rank_accuracy[d][j]: how often the target's next token at depth d+1 is head d's rank-j guess
    (held-out). Assuming depths independent, node (j1..jd) is accepted with probability
    prod acc[i][ji]; the expected accepted length of a tree is the sum over its nodes, so adding the
    best remaining child of the tree (greedy) is optimal and each prefix of the list is a tree too.
    """
    if not rank_accuracy or any(len(row) == 0 for row in rank_accuracy):
        raise ValueError("rank_accuracy must have at least one rank per depth")
    # Measured accuracies are noisy: make them non-increasing in rank, so a node's j-th candidate is
    # never preferred to its (j-1)-th (which also keeps sampled trees' draw order natural).
    acc = [np.minimum.accumulate(np.maximum(np.asarray(row, dtype=np.float64), 0.0)).tolist() for row in rank_accuracy]
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    chosen: list[list[int]] = []
    frontier = {(j,): acc[0][j] for j in range(len(acc[0]))}
    while frontier and len(chosen) < size:
        path = max(frontier, key=lambda p: (frontier[p], -len(p), [-x for x in p]))
        value = frontier.pop(path)
        chosen.append(list(path))
        d = len(path)
        if d < len(acc):
            for j in range(len(acc[d])):
                frontier[path + (j,)] = value * acc[d][j]
    return chosen


def expected_accepted(choices: Sequence[Sequence[int]], rank_accuracy: Sequence[Sequence[float]]) -> float:
    """Sum over nodes of prod acc[d][j_d] (the estimate `choices_from_accuracies` maximises)."""
    total = 0.0
    for path in choices:
        total += math.prod(rank_accuracy[d][j] if j < len(rank_accuracy[d]) else 0.0 for d, j in enumerate(path))
    return total
