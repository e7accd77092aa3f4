"""Greedy and lossless stochastic acceptance of draft trees, for a whole step at once (ARCHITECTURE.md, "Lossless acceptance").

Vocabulary (see ``tree.py`` for rows and nodes):

- **accepted tokens**: draft nodes on one root→node path that the target agrees with;
- **bonus token**: one token drawn from the target at the last accepted row (greedy: its argmax;
  stochastic: a sample from the *residual* distribution when children were rejected there, or from
  the untouched target row when the row has no children). Every step emits ``accepted + 1`` tokens.

Greedy: node i is *acceptable* when it and all its ancestors equal the target's argmax at their
parent's row; the deepest acceptable node wins (ties: the lowest index, which matters only for trees
with duplicate sibling tokens). The result equals plain greedy decoding's next ``accepted + 1`` tokens.

Stochastic (multi-draft recursive rejection sampling, as in SpecInfer / vLLM's rejection sampler): at
the current row with residual target p, try its children x1..xm in sibling order; accept xi with
probability min(1, p(xi) / qi(xi)) and move to its row; on rejection p <- normalize(max(0, p - qi))
(one-hot qi: zero p(xi)); when every child is rejected, or the row has none, the bonus token is sampled
from p. qi is the distribution xi was drawn from given its earlier siblings (DraftTree's q).

Entry point for the engine: `accept_trees` over `PackedTrees` — one compiled call on the CPU
(`accept_kernels`), tensor ops on an accelerator (`accept_device`) with two ints per request coming
back. `greedy_accept` / `stochastic_accept` are the one-tree forms (tests, tools).

Randomness: every sampled request draws ``N + 1`` uniforms per step from its own generator
(`draw_uniforms`): one per node (used when that node is tried) and one for the bonus token, so a seed
reproduces a request whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specserve.verify.accept_kernels import accept_packed, sample_rows
from specserve.verify.packed import PackedTrees, pack_trees
from specserve.verify.result import VerifyResult
from specserve.verify.tree import DraftTree

__all__ = ["RESIDUAL_EPS", "accept_trees", "draw_uniforms", "greedy_accept", "sample_plain", "stochastic_accept"]

# Below this total mass the residual max(0, p - q) is treated as rounding noise: the residual mass
# equals TV(p, q), the probability that a draw from q is rejected against p, so a residual this small
# is reached with probability <= RESIDUAL_EPS and is mostly float error (p == q up to an ulp, where
# exact arithmetic would always accept). There the walk falls back to p with the rejected token zeroed
# (the one-hot residual: it never re-emits that token), and to p itself if that is empty too
# (unreachable: p is then one-hot at x, so q(x) = 1 and x is always accepted). This can move the
# output distribution by at most RESIDUAL_EPS in total variation per child tried.
RESIDUAL_EPS = 1e-5
_NO_PROBS = np.zeros((1, 1), dtype=np.float32)


def draw_uniforms(trees_or_packed: PackedTrees | Sequence[DraftTree], greedy: Sequence[bool],
                  generators: Sequence[torch.Generator | None]) -> np.ndarray:
    """float64[N + B]: for each sampled request, one uniform per node (global node index) and one for
    its bonus (index N + b), from its own generator; zeros for greedy requests."""
    packed = trees_or_packed if isinstance(trees_or_packed, PackedTrees) else pack_trees(trees_or_packed)
    cu = packed.cu_nodes
    out = np.zeros(packed.num_nodes + packed.num_requests, dtype=np.float64)
    for b, (g, gen) in enumerate(zip(greedy, generators)):
        if g:
            continue
        if gen is None:
            raise ValueError(f"request {b} is sampled (greedy=False) but has no generator")
        u = torch.rand(int(cu[b + 1] - cu[b]) + 1, generator=gen, dtype=torch.float64).numpy()
        out[cu[b]:cu[b + 1]] = u[:-1]
        out[packed.num_nodes + b] = u[-1]
    return out


def accept_trees(
    trees: Sequence[DraftTree],
    packed: PackedTrees,
    greedy: np.ndarray,
    argmax: torch.Tensor,
    probs: torch.Tensor | None,
    prob_index: np.ndarray,
    uniforms: np.ndarray,
) -> list[VerifyResult]:
    """Accept every request of a step (greedy and sampled requests may be mixed).

    trees, packed: the step's trees and `pack_trees(trees)`.
    greedy:     bool[B].
    argmax:     int64[R] the target's argmax at every verify row (read for greedy requests).
    probs:      float32[R_s, V] processed target distributions (temperature / top-k / top-p / min-p
                applied, rows sum to 1) of the sampled requests' rows; None when all are greedy.
    prob_index: int64[R] the row of `probs` holding each verify row, -1 for greedy requests' rows.
    uniforms:   float64[N + B] from `draw_uniforms`.
    Tensors on the CPU go through one compiled call; on an accelerator through tensor ops there.
    """
    accept = _accept_on_cpu if argmax.device.type == "cpu" else _accept_on_device
    paths, bonus, bad = accept(trees, packed, greedy, argmax, probs, prob_index, uniforms)
    if bad >= 0:
        b = int(np.searchsorted(packed.cu_nodes, bad, side="right") - 1)
        node = bad - int(packed.cu_nodes[b])
        raise ValueError(f"draft node {node} of request {b} has token {int(packed.tokens[bad])} with draft "
                         f"probability 0: it cannot have been drawn from its q (a drafter bug)")
    tokens, first_node = packed.tokens.tolist(), packed.cu_nodes.tolist()  # a request's local node i: global first + i
    return [VerifyResult(tuple(path), tuple(tokens[first_node[b] + i] for i in path), int(t), tree.num_nodes)
            for b, (tree, path, t) in enumerate(zip(trees, paths, bonus))]


def _accept_on_cpu(trees: Sequence[DraftTree], packed: PackedTrees, greedy: np.ndarray, argmax: torch.Tensor,
                   probs: torch.Tensor | None, prob_index: np.ndarray,
                   uniforms: np.ndarray) -> tuple[list[list[int]], list[int], int]:
    """`accept_trees` in one compiled call: (each request's accepted path, local nodes root→leaf; its bonus token;
    -1, or the global node of a drafter bug — the paths and tokens then empty)."""
    num_requests = packed.num_requests
    length = np.empty(num_requests, dtype=np.int64)
    bonus = np.empty(num_requests, dtype=np.int64)
    path = np.empty((num_requests, max(packed.max_depth, 1)), dtype=np.int64)
    bad = accept_packed(greedy, packed.cu_rows, packed.cu_nodes, packed.tokens, packed.parent_row, packed.first_child,
                        packed.next_sibling, packed.depth, argmax.numpy(), prob_index,
                        probs.numpy() if probs is not None else _NO_PROBS, packed.q_ids.numpy(), packed.q_probs.numpy(),
                        uniforms, RESIDUAL_EPS, length, path, bonus)
    if bad >= 0:
        return [], [], bad
    return [nodes[:n] for nodes, n in zip(path.tolist(), length.tolist())], bonus.tolist(), -1


def _accept_on_device(trees: Sequence[DraftTree], packed: PackedTrees, greedy: np.ndarray, argmax: torch.Tensor,
                      probs: torch.Tensor | None, prob_index: np.ndarray,
                      uniforms: np.ndarray) -> tuple[list[list[int]], list[int], int]:
    """`_accept_on_cpu` as tensor ops where the rows are (`accept_device`): only each request's deepest accepted
    node and bonus token come back, and the path is read from its tree."""
    from specserve.verify.accept_device import accept_on_device

    last, bonus, bad = accept_on_device(packed, greedy, argmax, probs, prob_index, uniforms, RESIDUAL_EPS)
    if bad >= 0:
        return [], [], bad
    return [tree.path_to(int(n)) if n >= 0 else [] for tree, n in zip(trees, last)], bonus.tolist(), -1


def sample_plain(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """The tokens of sampled requests that verify no tree (plain decoding), on the CPU: probs float32[M, V] their
    rows' processed distributions, one generator each. Exactly what `accept_trees` emits for an empty tree —
    the same uniform from the request's generator (`draw_uniforms`: one per empty tree), the same draw
    (`accept_kernels.sample_rows`) — without packing trees: a plain sampled step is the common case."""
    uniforms = np.empty(len(generators), dtype=np.float64)
    for i, gen in enumerate(generators):
        uniforms[i] = torch.rand(1, generator=gen, dtype=torch.float64).item()
    tokens = np.empty(len(generators), dtype=np.int64)
    sample_rows(probs.numpy(), uniforms, tokens)
    return tokens.tolist()


# ---- one tree at a time ---------------------------------------------------------------------------


def greedy_accept(tree: DraftTree, target_tokens: torch.Tensor) -> VerifyResult:
    """Greedy acceptance of one tree. target_tokens: int64[N+1], the target's argmax at each verify row
    (row 0 = root, row i+1 = node i)."""
    n = tree.num_nodes
    if target_tokens.dim() != 1 or target_tokens.shape[0] != n + 1:
        raise ValueError(f"target_tokens must be int64[N+1={n + 1}], got {tuple(target_tokens.shape)}")
    if target_tokens.dtype != torch.int64:
        raise TypeError(f"target_tokens must be int64, got {target_tokens.dtype}")
    packed = pack_trees([tree])
    return accept_trees([tree], packed, np.array([True]), target_tokens, None, np.full(n + 1, -1, dtype=np.int64),
                        np.zeros(n + 1))[0]


def stochastic_accept(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> VerifyResult:
    """Lossless rejection sampling over one tree: the emitted tokens follow the target exactly.

    target_probs: float[N+1, V], the target's processed distribution at each verify row (rows sum to 1);
    generator: the only source of randomness (N + 1 uniforms per call), so a seed reproduces a run.
    Raises ValueError on bad shapes, a draft token outside the vocabulary, or a node whose own token
    has zero draft probability (a drafter bug).
    """
    n = tree.num_nodes
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must be float[N+1={n + 1}, V], got {tuple(target_probs.shape)}")
    if not target_probs.is_floating_point():
        raise TypeError(f"target_probs must be a floating tensor, got {target_probs.dtype}")
    vocab = target_probs.shape[1]
    if n and int(tree.tokens.max()) >= vocab:
        raise ValueError(f"draft token {int(tree.tokens.max())} is outside the vocabulary (V={vocab})")
    if tree.probs is not None and tree.probs.shape[1] != vocab:
        raise ValueError(f"tree.probs has vocab {tree.probs.shape[1]}, target_probs has {vocab}")
    packed = pack_trees([tree], target_probs.device)
    uniforms = draw_uniforms(packed, [False], [generator])
    argmax = torch.zeros(n + 1, dtype=torch.int64, device=target_probs.device)
    return accept_trees([tree], packed, np.array([False]), argmax, target_probs.float().contiguous(),
                        np.arange(n + 1, dtype=np.int64), uniforms)[0]
