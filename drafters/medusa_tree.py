"""Medusa token trees: static trees from rank paths ("choices") and their sampled tokens (dynamic trees
come from the shared `tree_builder`).

A Medusa tree is a tree of *ranks*: a node at depth d with rank j takes the j-th candidate of head
d-1 (greedy: its j-th most likely token; sampled: its j-th token drawn without replacement). Every
node of one depth reads the same head, because all heads read the same target feature.

Shapes are host-side numpy arrays (trees are small): ``parents`` int64[N] (-1 = child of the root,
``parents[i] < i``), ``depths`` int64[N] (children of the root have depth 1), ``ranks`` int64[N].
Node order is a priority order: cutting a tree to a budget B keeps nodes ``0..B-1``, which is always
ancestor-closed — that order comes from the choices list (best first).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

from specserve.drafters.tree_builder import DRAFT_Q_SUPPORT, draw_siblings
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


@numba.njit(cache=True, nogil=True)
def sample_static_tree(logits, temperature, parents, depths, uniforms):
    """Draw a static tree's tokens: the children of every row (the root, then each node), in node order,
    are drawn without replacement from the compact q of their depth's head (`draw_siblings`).

    logits: float32[D, V] the heads' logits; parents, depths: int64[N] the shape; uniforms: float64[>= N],
    node i's draw uses uniforms[i]. Returns tokens int64[N], q_ids int64[N, K], q_probs float32[N, K] (the
    distribution each node was drawn from) and keep bool[N]: drawn, and so were all its ancestors.
    """
    n = parents.shape[0]
    support = max(DRAFT_Q_SUPPORT, n)
    tokens = np.zeros(n, np.int64)
    q_ids = np.full((n, support), -1, np.int64)
    q_probs = np.zeros((n, support), np.float32)
    keep = np.zeros(n, np.bool_)
    top_ids = np.empty(support, np.int64)
    top_vals = np.empty(support, np.float64)
    weights = np.empty(support, np.float64)
    children = np.empty(n, np.int64)
    for row in range(-1, n):  # -1: the root
        count = 0
        for i in range(n):
            if parents[i] == row:
                children[count] = i
                count += 1
        if count == 0 or (row >= 0 and not keep[row]):
            continue
        head = 0 if row < 0 else depths[row]
        u = np.empty(count, np.float64)
        for j in range(count):
            u[j] = uniforms[children[j]]
        c_tokens = np.zeros(count, np.int64)
        c_ids = np.full((count, support), -1, np.int64)
        c_probs = np.zeros((count, support), np.float32)
        drawn = draw_siblings(logits[head], temperature, count, u, c_ids, c_probs, c_tokens, top_ids, top_vals, weights)
        for j in range(drawn):
            i = children[j]
            tokens[i] = c_tokens[j]
            q_ids[i] = c_ids[j]
            q_probs[i] = c_probs[j]
            keep[i] = True
    return tokens, q_ids, q_probs, keep


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
