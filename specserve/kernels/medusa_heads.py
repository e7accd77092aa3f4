"""Medusa heads' forward as ONE compiled call on the CPU: every head's root product, residual blocks and LM head.

Why one call: the heads run between two target forwards, whose weight stream has just emptied the caches, and
there every distinct Python, numpy and torch call a drafting step makes costs tens of microseconds (`specserve
bench overhead --cold`; BENCHMARKS.md, "Where a drafting step's time goes"). Run as nine `PackedLinear` calls with
torch glue between them, three heads' host work took ~0.3 ms of a drafting step beyond their weights' stream.

Per head k (`first` .. `first` + depth - 1), for rows x = the target's feature of each request (or of each tree
node a parent-token head expands: its request's feature and root, the node's own token as the parent):
    x = feat + R_k root          (root-token heads only: R_k root is a product, then one float32 add)
    x = x + P_k parent           (parent-token heads, k >= 1: the embedding of the node whose child k guesses)
    x = x + SiLU(W_kl x + b_kl)  for each of the head's blocks l
    logits_k = L_k x             (its own LM head), or the target's LM head over every head's x at once
Each product is `linear.linear_rows` (batch-invariant), the adds and SiLU row-wise: a request's logits do not
depend on which other requests share the call.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from specserve.kernels.linear import linear_rows
from specserve.numba_cache import CALLS_PARALLEL_KERNELS


@numba.njit(inline="always")
def _add_silu(x, y):
    """x += y * sigmoid(y), float32, element by element."""
    rows, width = x.shape
    one = np.float32(1.0)
    for a in range(rows):
        for i in range(width):
            v = y[a, i]
            x[a, i] += v * (one / (one + np.float32(math.exp(-v))))


@numba.njit(inline="always")
def _add(x, y):
    """x += y, float32, element by element (a product's output added to the heads' rows)."""
    rows, width = x.shape
    for a in range(rows):
        for i in range(width):
            x[a, i] += y[a, i]


@numba.njit(parallel=CALLS_PARALLEL_KERNELS, boundscheck=False, cache=True)
def medusa_heads(feats, roots, parents, first, root_w, root_s, root_b, parent_w, parent_s, parent_b, block_w, block_s,
                 block_b, blocks_per_head, lm_w, lm_s, lm_b, shared_lm_head, out):
    """out[a, j, :] = head (first + j)'s logits for row a, for j < out.shape[1] (the heads asked for).

    feats:    float32[A, H] each row's target feature; roots: float32[A, H] its root token's embedding, or
              float32[0, H] for heads that do not read the root; parents: float32[A, H] the embedding of the node
              each row expands (parent-token heads from head 1 on), or float32[0, H].
    root_*:   the heads' root products, stacked per head: weight [K, ...], scales [K, ...], bias float32[K, ...]
              (`PackedLinear` fields; [0, ...] without roots). parent_*: head k's parent product at k - 1.
    block_*:  the blocks, head k's block l at k * blocks_per_head + l.
    lm_*:     the heads' own LM heads stacked per head, or (shared_lm_head) the target's LM head as [1, ...],
              run once over every head's rows.
    out:      float32[A, depth, V'] (C-contiguous), written.
    """
    num_req, hidden = feats.shape
    depth, vocab = out.shape[1], out.shape[2]
    states = np.empty((depth * num_req, hidden), dtype=np.float32)  # head first + j's rows at j * A .. j * A + A - 1
    scratch = np.empty((num_req, hidden), dtype=np.float32)
    for j in range(depth):
        k = first + j
        x = states[j * num_req:(j + 1) * num_req]
        x[:] = feats
        if roots.shape[0]:
            linear_rows(roots, root_w[k], root_s[k], root_b[k], scratch, False)
            _add(x, scratch)
        if parents.shape[0] and k >= 1:
            linear_rows(parents, parent_w[k - 1], parent_s[k - 1], parent_b[k - 1], scratch, False)
            _add(x, scratch)
        for layer in range(blocks_per_head):
            b = k * blocks_per_head + layer
            linear_rows(x, block_w[b], block_s[b], block_b[b], scratch, False)
            _add_silu(x, scratch)
    if shared_lm_head:
        flat = np.empty((depth * num_req, vocab), dtype=np.float32)
        linear_rows(states, lm_w[0], lm_s[0], lm_b[0], flat, False)
        for j in range(depth):
            for a in range(num_req):
                out[a, j, :] = flat[j * num_req + a]
    else:
        logits = np.empty((num_req, vocab), dtype=np.float32)
        for j in range(depth):
            linear_rows(states[j * num_req:(j + 1) * num_req], lm_w[first + j], lm_s[first + j], lm_b[first + j],
                        logits, False)
            for a in range(num_req):
                out[a, j, :] = logits[a]
