"""Greedy and lossless stochastic acceptance of draft trees (design.md §4).

Vocabulary (see ``tree.py`` for rows and nodes):

- **accepted tokens**: draft nodes on one root→node path that the target agrees with;
- **bonus token**: one token drawn from the target at the last accepted row (greedy: its argmax;
  stochastic: a sample from the *residual* distribution when children were rejected there, or from
  the untouched target row when the row has no children). Every step emits ``accepted + 1`` tokens.

Entry points:

- :func:`greedy_accept` — one tree, target argmax per row.
- :func:`stochastic_accept` — one tree, processed target probabilities per row, lossless
  (multi-draft recursive rejection sampling, as in SpecInfer / vLLM's rejection sampler).
- :func:`split_verify_rows` + :func:`accept_batch` — the engine's batched hand-off: one host
  transfer per step, greedy and sampled requests mixed in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.verify.result import VerifyResult
from specserve.verify.tree import DraftTree

__all__ = [
    "RESIDUAL_EPS",
    "accept_batch",
    "greedy_accept",
    "split_verify_rows",
    "stochastic_accept",
]

# Below this total mass the residual max(0, p - q) is treated as rounding noise (see _residual).
RESIDUAL_EPS = 1e-5


# ---- greedy --------------------------------------------------------------------------------------


def greedy_accept(tree: DraftTree, target_tokens: torch.Tensor) -> VerifyResult:
    """Accept the deepest root→node path whose every token equals the target's argmax.

    tree:          the request's draft tree with N nodes.
    target_tokens: int64[N+1] on the CPU, the target's argmax at each verify row
                   (row 0 = root, row i+1 = node i).

    Node i *matches* when ``tokens[i] == target_tokens[parents[i] + 1]``; it is *acceptable* when it
    and all its ancestors match. The deepest acceptable node wins (ties: lowest node index, which
    only matters for trees with duplicate sibling tokens). The bonus token is the argmax at the
    winner's row (row 0 when nothing matched). The result equals plain greedy decoding's next
    ``num_accepted + 1`` tokens. Vectorised over nodes (no Python loop over the tree).
    """
    n = tree.num_nodes
    if target_tokens.dim() != 1 or target_tokens.shape[0] != n + 1:
        raise ValueError(f"target_tokens must be int64[N+1={n + 1}], got {tuple(target_tokens.shape)}")
    if target_tokens.dtype != torch.int64:
        raise TypeError(f"target_tokens must be int64, got {target_tokens.dtype}")
    if n == 0:
        return VerifyResult((), (), int(target_tokens[0]), 0)

    match = tree.tokens == target_tokens[tree.parents + 1]  # bool[N]
    row_ok = torch.cat([torch.ones(1, dtype=torch.bool), match])  # bool[N+1], the root always "matches"
    # Node i is acceptable iff no row on its root→node path (ancestor_mask row i+1) fails to match.
    acceptable = ~(tree.ancestor_mask[1:] & ~row_ok).any(dim=1)  # bool[N]
    # One key ordering (depth desc, index asc); -1 marks unacceptable nodes.
    index = torch.arange(n, dtype=torch.int64)
    key = torch.where(acceptable, tree.depths * (n + 1) + (n - index), torch.full_like(index, -1))
    best_key, best = (int(v) for v in torch.max(key, dim=0))
    if best_key < 0:
        return VerifyResult((), (), int(target_tokens[0]), n)

    path = torch.nonzero(tree.ancestor_mask[best + 1, 1:]).flatten()  # int64[depth], root→node order
    return VerifyResult(
        accepted_nodes=tuple(path.tolist()),
        accepted_tokens=tuple(tree.tokens[path].tolist()),
        bonus_token=int(target_tokens[best + 1]),
        num_drafted=n,
    )


# ---- stochastic ----------------------------------------------------------------------------------


def stochastic_accept(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> VerifyResult:
    """Lossless rejection sampling over a draft tree: the emitted tokens follow the target exactly.

    tree:         the request's draft tree with N nodes; ``tree.probs`` (float[N, V]) is the
                  distribution each node was drawn from given its earlier siblings, or None for
                  deterministic (one-hot) drafts.
    target_probs: float32[N+1, V] on the CPU, the target's *processed* distribution at each verify row
                  (temperature / top-k / top-p / min-p applied, rows sum to 1); row r is the
                  distribution of the token that follows row r.
    generator:    CPU torch.Generator; the only source of randomness, so a seed reproduces a run.

    At the current row r (starting at the root) with residual p = target_probs[r], try the children
    x1..xm of r in sibling order: accept xi with probability min(1, p(xi) / qi(xi)) and move to its
    row; on rejection set p <- normalize(max(0, p - qi)) (one-hot qi: zero p(xi), renormalise) and
    try the next sibling. When every child is rejected, or r has no children, the bonus token is
    sampled from p and the walk stops.

    Raises ValueError on bad shapes, a draft token outside the vocabulary, or qi(xi) == 0 (a node
    drawn from a distribution that cannot produce it: a drafter bug).
    """
    n = tree.num_nodes
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must be float[N+1={n + 1}, V], got {tuple(target_probs.shape)}")
    if not target_probs.is_floating_point():
        raise TypeError(f"target_probs must be a floating tensor, got {target_probs.dtype}")
    if target_probs.dtype not in (torch.float32, torch.float64):
        target_probs = target_probs.float()  # half precision is too coarse for residual arithmetic
    vocab = target_probs.shape[1]
    draft_probs = tree.probs
    if draft_probs is not None:
        if draft_probs.shape[1] != vocab:
            raise ValueError(f"tree.probs has vocab {draft_probs.shape[1]}, target_probs has {vocab}")
        draft_probs = draft_probs.to(target_probs.dtype)
    if n and int(tree.tokens.max()) >= vocab:
        raise ValueError(f"draft token {int(tree.tokens.max())} is outside the vocabulary (V={vocab})")

    tokens = tree.tokens.tolist()
    first_child, next_sibling = (t.tolist() for t in tree.first_child_next_sibling)
    accepted: list[int] = []
    row = 0
    p = target_probs[0]  # [V] residual target distribution at the current row
    while True:
        node = first_child[row]
        while node != -1:  # the children of `row`, in sibling order (tree.children(row))
            x = tokens[node]
            q = None if draft_probs is None else draft_probs[node]  # [V] or one-hot
            qx = 1.0 if q is None else float(q[x])
            if not qx > 0.0:
                raise ValueError(
                    f"draft node {node} has token {x} with draft probability {qx}: it cannot have been "
                    f"drawn from tree.probs[{node}]"
                )
            u = float(torch.rand((), generator=generator, dtype=torch.float64))  # in [0, 1)
            if u < float(p[x]) / qx:  # P(u < ratio) = min(1, ratio)
                break
            p = _residual(p, x, q)
            node = next_sibling[node]
        if node == -1:  # no child, or every child rejected: stop at this row
            break
        accepted.append(node)
        row = node + 1
        p = target_probs[row]

    bonus = int(torch.multinomial(p, 1, generator=generator))
    return VerifyResult(
        accepted_nodes=tuple(accepted),
        accepted_tokens=tuple(tokens[i] for i in accepted),
        bonus_token=bonus,
        num_drafted=n,
    )


def _residual(p: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """normalize(max(0, p - q)) after rejecting token x drawn from q (None: one-hot at x).

    p: float[V], the current (normalised) residual target; q: float[V] or None. Returns float[V].

    The residual mass equals TV(p, q), which is also the probability that a draw from q is rejected
    against p. So a residual of mass <= RESIDUAL_EPS is reached with probability <= RESIDUAL_EPS and
    is mostly rounding noise (e.g. p == q up to float error, where exact arithmetic would always
    accept). There we fall back to p with x zeroed (the one-hot residual: it still never re-emits
    the rejected token), and to p itself if that is empty too (unreachable: then p is one-hot at
    x, so q(x) = 1 and x is always accepted). The fallback can move the output distribution by at
    most RESIDUAL_EPS in total variation per child tried, and only through this near-impossible
    branch; for one-hot q it is exactly the normal residual.
    """
    r = p.clone()
    if q is None:
        r[x] = 0.0
    else:
        r.sub_(q).clamp_(min=0.0)
    mass = float(r.sum())
    if mass > RESIDUAL_EPS:
        return r / mass
    r = p.clone()
    r[x] = 0.0
    mass = float(r.sum())
    return r / mass if mass > 0.0 else p


# ---- batched hand-off for the engine -------------------------------------------------------------


def split_verify_rows(
    trees: Sequence[DraftTree],
    greedy: Sequence[bool],
    row_offsets: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the greedy and of the sampled requests' verify rows in the batch's flat row space.

    The verify forward lays request k's N_k + 1 rows at ``[row_offsets[k], row_offsets[k] + N_k + 1)``
    of its flat output (default: packed back to back, ``row_offsets = cumsum([0] + [N_k + 1])``; pass
    explicit offsets when the engine pads rows, e.g. for shape buckets).

    Returns (greedy_rows int64[R_g], sampled_rows int64[R_s]), CPU, ascending: request order, then row
    order. The engine gathers with them on the device, before its single transfer::

        target_tokens = logits[greedy_rows].argmax(-1)            # int64[R_g]
        target_probs  = process(logits[sampled_rows], params)     # float32[R_s, V]
        results = accept_batch(trees, greedy, target_tokens, target_probs, generators)
    """
    if len(greedy) != len(trees):
        raise ValueError(f"greedy has {len(greedy)} entries for {len(trees)} trees")
    sizes = [t.num_nodes + 1 for t in trees]
    if row_offsets is None:
        row_offsets = [0]
        for s in sizes[:-1]:
            row_offsets.append(row_offsets[-1] + s)
    elif len(row_offsets) != len(trees):
        raise ValueError(f"row_offsets has {len(row_offsets)} entries for {len(trees)} trees")
    empty = torch.empty(0, dtype=torch.int64)
    g_parts = [torch.arange(o, o + s) for o, s, is_g in zip(row_offsets, sizes, greedy) if is_g]
    s_parts = [torch.arange(o, o + s) for o, s, is_g in zip(row_offsets, sizes, greedy) if not is_g]
    return (torch.cat(g_parts) if g_parts else empty, torch.cat(s_parts) if s_parts else empty)


def accept_batch(
    trees: Sequence[DraftTree],
    greedy: Sequence[bool],
    target_tokens: torch.Tensor | None,
    target_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> list[VerifyResult]:
    """Accept every request of a step; greedy and sampled requests may be mixed.

    trees:         one DraftTree per request (N_k nodes each).
    greedy:        bool per request: True -> greedy_accept, False -> stochastic_accept.
    target_tokens: int64[R_g], any device: the target argmax at the greedy requests' rows, packed in
                   request order (request k contributes N_k + 1 rows). None when no request is greedy.
    target_probs:  float32[R_s, V], any device: processed target probabilities at the sampled requests'
                   rows, packed the same way. None when every request is greedy.
    generators:    per request; a CPU torch.Generator for each sampled request, ignored for greedy ones.

    Tensors on an accelerator are copied to the host together with ONE synchronisation (pinned
    buffers, non-blocking copies); `split_verify_rows` gives the row indices to gather them with.
    Returns one VerifyResult per request, in request order.
    """
    if not (len(trees) == len(greedy) == len(generators)):
        raise ValueError(
            f"trees, greedy and generators must have one entry per request, got "
            f"{len(trees)}, {len(greedy)}, {len(generators)}"
        )
    need_g = sum(t.num_nodes + 1 for t, g in zip(trees, greedy) if g)
    need_s = sum(t.num_nodes + 1 for t, g in zip(trees, greedy) if not g)
    got_g = 0 if target_tokens is None else target_tokens.shape[0]
    got_s = 0 if target_probs is None else target_probs.shape[0]
    if got_g != need_g:
        raise ValueError(f"target_tokens must have {need_g} rows (greedy requests' rows), got {got_g}")
    if got_s != need_s:
        raise ValueError(f"target_probs must have {need_s} rows (sampled requests' rows), got {got_s}")
    for k, (g, gen) in enumerate(zip(greedy, generators)):
        if not g and gen is None:
            raise ValueError(f"request {k} is sampled (greedy=False) but has no generator")

    target_tokens, target_probs = _to_host(target_tokens, target_probs)
    results: list[VerifyResult] = []
    off_g = off_s = 0
    for tree, g, gen in zip(trees, greedy, generators):
        rows = tree.num_nodes + 1
        if g:
            results.append(greedy_accept(tree, target_tokens[off_g : off_g + rows]))
            off_g += rows
        else:
            results.append(stochastic_accept(tree, target_probs[off_s : off_s + rows], gen))
            off_s += rows
    return results


def _to_host(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Copy tensors to the CPU with one synchronisation (CUDA: pinned buffers, non-blocking copies)."""
    if all(t is None or t.device.type == "cpu" for t in tensors):
        return tensors
    if not all(t is None or t.device.type in ("cpu", "cuda") for t in tensors):
        return tuple(None if t is None else t.cpu() for t in tensors)  # other backends: plain copies
    out: list[torch.Tensor | None] = []
    devices: set[torch.device] = set()
    for t in tensors:
        if t is None or t.device.type == "cpu":
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)  # queued on t's device's current stream
        devices.add(t.device)
        out.append(host)
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    for event in events:
        event.synchronize()  # the one host sync: the forward and the copies queued before it are done
    return tuple(out)
