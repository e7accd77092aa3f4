"""Batched acceptance of a step's draft trees in one compiled call, for targets whose rows live on the CPU.

`accept_packed` runs every request of the step: greedy requests take the deepest node whose whole
root→node path matches the target's argmax; sampled requests walk their tree by lossless recursive
rejection sampling (verify/accept.py explains the algorithm and its vocabulary). All randomness comes
in as pre-drawn uniforms: u[g] for trying global node g, u[N + b] for request b's bonus token.

Arithmetic of the sampled walk: the residual target p is kept unnormalised in float64 with its running
total, so rejecting a child touches only the K entries of that child's compact q:
``accept x  iff  u * q(x) * total < p[x]``; on rejection ``p <- max(0, p - q * total)`` on q's support.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _sample(p, total, u):
    """Inverse-CDF draw from unnormalised p (float64[V]) with total mass `total`; never a zero entry."""
    target = u * total
    acc = 0.0
    last = -1
    for i in range(p.shape[0]):
        if p[i] > 0.0:
            acc += p[i]
            last = i
            if acc > target:
                return i
    return last  # rounding: u * total reached past the accumulated sum


@numba.njit(cache=True, nogil=True)
def sample_rows(probs, uniforms, out):
    """out[i] = the token drawn from row i of probs (float32[M, V], processed distributions) with uniforms[i]:
    exactly the bonus token `accept_packed` draws for an empty tree (the same float64 widening, sum and
    inverse CDF), for steps where no request verifies a tree."""
    for i in range(probs.shape[0]):
        p = probs[i].astype(np.float64)
        total = p.sum()
        out[i] = _sample(p, total, uniforms[i])


@numba.njit(cache=True, nogil=True)
def accept_packed(greedy, cu_rows, cu_nodes, tokens, parent_row, first_child, next_sibling, depth,
                  argmax, prob_index, probs, q_ids, q_probs, uniforms, residual_eps,
                  out_len, out_path, out_bonus):
    """Accept every request; fill out_len [B], out_path [B, D] (local node indices) and out_bonus [B].

    greedy:     bool[B]; argmax: int64[R] the target's argmax at every row (read for greedy requests).
    prob_index: int64[R] row of `probs` (float32[R_s, V], processed target distributions) holding each
                sampled request's row, -1 for greedy requests' rows.
    The rest: `PackedTrees` arrays (q as numpy). Returns -1, or a global node whose own token has zero
    draft probability (a drafter bug the caller reports).
    """
    num_requests = greedy.shape[0]
    num_nodes = tokens.shape[0]
    for b in range(num_requests):
        r0, n0, n1 = cu_rows[b], cu_nodes[b], cu_nodes[b + 1]
        if greedy[b]:
            ok = np.zeros(n1 - n0, np.bool_)
            best, best_depth = -1, 0
            for g in range(n0, n1):  # topological order: a parent's verdict is final before its children
                pr = parent_row[g]
                parent_ok = pr == r0 or ok[pr - r0 - 1]
                if parent_ok and tokens[g] == argmax[pr]:
                    ok[g - n0] = True
                    if depth[g] > best_depth:  # strictly deeper: ties keep the lowest index
                        best, best_depth = g - n0, depth[g]
            out_len[b] = best_depth
            node = best
            for d in range(best_depth - 1, -1, -1):
                out_path[b, d] = node
                node = parent_row[n0 + node] - r0 - 1
            out_bonus[b] = argmax[r0 + 1 + best if best >= 0 else r0]
            continue
        row = r0
        p = probs[prob_index[row]].astype(np.float64)
        total = p.sum()
        length = 0
        while True:
            node = first_child[row]
            chosen = -1
            while node != -1:
                x = tokens[node]
                qx = 0.0
                for j in range(q_ids.shape[1]):
                    if q_ids[node, j] == x:
                        qx += q_probs[node, j]
                if not qx > 0.0:
                    return node
                if uniforms[node] * qx * total < p[x]:
                    chosen = node
                    break
                # Rejected: p <- normalize(max(0, p - q)), kept unnormalised (see the module docstring).
                new_total = total
                for j in range(q_ids.shape[1]):
                    t = q_ids[node, j]
                    if t >= 0:
                        new_total -= p[t] - max(0.0, p[t] - q_probs[node, j] * total)
                if new_total > residual_eps * total:
                    for j in range(q_ids.shape[1]):
                        t = q_ids[node, j]
                        if t >= 0:
                            p[t] = max(0.0, p[t] - q_probs[node, j] * total)
                    total = new_total
                elif total - p[x] > 0.0:
                    # The residual is rounding noise (p == q up to float error): drop x alone, as a
                    # one-hot residual would (verify/accept.py, RESIDUAL_EPS).
                    total -= p[x]
                    p[x] = 0.0
                node = next_sibling[node]
            if chosen == -1:
                break
            out_path[b, length] = chosen - n0
            length += 1
            row = r0 + 1 + (chosen - n0)
            p = probs[prob_index[row]].astype(np.float64)
            total = p.sum()
        out_len[b] = length
        out_bonus[b] = _sample(p, total, uniforms[num_nodes + b])
    return -1
