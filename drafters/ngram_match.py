"""Numba kernels for n-gram (prompt-lookup) drafting over a request's own context.

Vocabulary (``ctx`` is the request's int64 token array of length ``L``; ``ctx[L-1]`` is the root):

- an **occurrence** of the suffix n-gram ``ctx[L-n:L]`` is a start ``i`` with ``ctx[i:i+n] == ctx[L-n:L]``
  that ends strictly before the last token (``i + n <= L - 1``);
- its **continuation** starts at ``j = i + n`` and is ``ctx[j : min(j + depth, L)]`` (never empty, and
  allowed to overlap the suffix itself).

Every occurrence of the suffix ``n``-gram ending at ``j - 1`` is also an occurrence of every shorter
suffix, so one number per continuation start describes all of them: ``match_len[j]``, the length of the
longest common suffix of ``ctx[:j]`` and ``ctx`` (capped at ``max_n``). The occurrences at level ``n``
are exactly the starts with ``match_len >= n``.

All kernels are module-level ``@njit(cache=True)``: they compile once per process (and are cached on disk
across processes).
"""

from __future__ import annotations

import numba
import numpy as np

_HASH_MUL = 0x100000001B3  # FNV-64 prime; int64 arithmetic wraps in numba (no overflow checks)


@numba.njit(cache=True, nogil=True)
def match_candidates(ctx, min_n, max_n):
    """Continuation starts of suffix n-gram occurrences, grouped by match length.

    ctx: int64[L]. Returns ``(starts int64[M], lens int64[M])`` for every start ``j`` in ``1..L-1`` whose
    preceding ``lens[k] >= min_n`` tokens equal the context's last ``lens[k]`` tokens (``lens`` capped at
    ``max_n``), ordered by ``lens`` descending, then by ``starts`` descending (most recent first). The
    occurrences at level ``n`` are therefore the prefix of rows with ``lens >= n``.
    """
    L = ctx.shape[0]
    if L < 2 or max_n < 1 or min_n > max_n:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    last = ctx[L - 1]
    # Bucket counts per match length (0..max_n), then a counting sort: no general sort needed.
    lens_all = np.zeros(L, np.int64)  # lens_all[j]: match length of the occurrence ending at j-1
    counts = np.zeros(max_n + 1, np.int64)
    for e in range(L - 1):  # occurrence ends at e <= L-2; its continuation starts at e+1
        if ctx[e] != last:
            continue
        k = 1
        while k < max_n and k <= e and ctx[e - k] == ctx[L - 1 - k]:
            k += 1
        if k >= min_n:
            lens_all[e + 1] = k
            counts[k] += 1
    total = 0
    for n in range(min_n, max_n + 1):
        total += counts[n]
    starts = np.empty(total, np.int64)
    lens = np.empty(total, np.int64)
    # offset of each length bucket in the output, longest first
    offsets = np.zeros(max_n + 2, np.int64)
    pos = 0
    for n in range(max_n, min_n - 1, -1):
        offsets[n] = pos
        pos += counts[n]
    # walk starts from the most recent so each bucket comes out in descending order of start
    for j in range(L - 1, 0, -1):
        n = lens_all[j]
        if n >= min_n:
            p = offsets[n]
            starts[p] = j
            lens[p] = n
            offsets[n] = p + 1
    return starts, lens


@numba.njit(cache=True, nogil=True)
def _continuation_hash(ctx, j, length):
    h = np.int64(length) * _HASH_MUL + 0x345678
    for t in range(length):
        h = (h ^ ctx[j + t]) * _HASH_MUL
    return h


@numba.njit(cache=True, nogil=True)
def _same_continuation(ctx, a, b, length_a, length_b):
    if length_a != length_b:
        return False
    for t in range(length_a):
        if ctx[a + t] != ctx[b + t]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def rank_continuations(ctx, starts, depth):
    """Group continuation starts into distinct continuations and rank them.

    starts: int64[m] continuation starts (distinct). Two starts are the same continuation when
    ``ctx[j : min(j+depth, L)]`` are equal sequences (length included). Returns ``(rep int64[g],
    count int64[g])``: for each distinct continuation its most recent start and how many starts share it,
    ordered by count descending, then by most recent start descending.
    """
    L = ctx.shape[0]
    m = starts.shape[0]
    if m == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    lengths = np.empty(m, np.int64)
    hashes = np.empty(m, np.int64)
    for k in range(m):
        j = starts[k]
        ln = min(depth, L - j)
        lengths[k] = ln
        hashes[k] = _continuation_hash(ctx, j, ln)
    order = np.argsort(hashes, kind="mergesort")
    rep = np.empty(m, np.int64)
    count = np.zeros(m, np.int64)
    g = 0
    k = 0
    while k < m:
        # run of equal hashes [k, r): group exactly inside it (collisions are all but impossible)
        r = k + 1
        while r < m and hashes[order[r]] == hashes[order[k]]:
            r += 1
        first_group = g
        for q in range(k, r):
            s = order[q]
            j = starts[s]
            found = -1
            for gg in range(first_group, g):
                if _same_continuation(ctx, rep[gg], j, min(depth, L - rep[gg]), lengths[s]):
                    found = gg
                    break
            if found < 0:
                rep[g] = j
                count[g] = 1
                g += 1
            else:
                count[found] += 1
                if j > rep[found]:
                    rep[found] = j
        k = r
    rep = rep[:g]
    count = count[:g]
    # rank: count desc, then most recent desc (reps are distinct starts, so the key is unique)
    key = np.empty(g, np.int64)
    for q in range(g):
        key[q] = -(count[q] * (L + 1) + rep[q])
    rank = np.argsort(key)
    return rep[rank], count[rank]


@numba.njit(cache=True, nogil=True)
def build_ngram_tree(ctx, min_n, max_n, branching, depth, cap):
    """The n-gram draft tree of one context, as ``(tokens int64[N], parents int64[N])``, N <= cap.

    Levels n = max_n .. min_n are visited longest first; within a level, distinct continuations are
    inserted into a trie in `rank_continuations` order. The tree never has more than ``branching``
    leaves (root→leaf paths):

    - a continuation the trie already contains adds nothing;
    - one that only extends an existing leaf (e.g. a longer version of a continuation that was
      truncated by the end of the context) deepens that path and needs no new leaf;
    - one that would branch off (its first new node's parent already has children) needs a new leaf,
      and is skipped once the tree has ``branching`` leaves.

    Insertion stops when the trie holds ``cap`` nodes (the continuation being inserted is truncated
    there). Nodes are numbered in insertion order, so higher-priority continuations keep lower indices
    (they are tried first as siblings) and ``parents[i] < i``.
    """
    tokens = np.empty(max(cap, 0), np.int64)
    parents = np.empty(max(cap, 0), np.int64)
    if cap <= 0 or branching <= 0 or depth <= 0:
        return tokens[:0], parents[:0]
    starts, lens = match_candidates(ctx, min_n, max_n)
    m = starts.shape[0]
    if m == 0:
        return tokens[:0], parents[:0]
    L = ctx.shape[0]
    has_child = np.zeros(cap + 1, np.bool_)  # by verify row: 0 = root, node i = row i + 1
    num = 0
    leaves = 1  # the empty tree's only leaf is the root
    prev_cnt = 0
    for n in range(max_n, min_n - 1, -1):
        # level n's occurrences are the prefix of rows with lens >= n
        cnt = 0
        while cnt < m and lens[cnt] >= n:
            cnt += 1
        if cnt == prev_cnt:
            # the same occurrences as the longer level (or none): the same continuations in the
            # same order, each already inserted, contained or refused a leaf, so nothing to add
            continue
        prev_cnt = cnt
        reps, _ = rank_continuations(ctx, starts[:cnt], depth)
        for q in range(reps.shape[0]):
            j = reps[q]
            ln = min(depth, L - j)
            # follow the part of the continuation the trie already holds
            parent = -1
            t = 0
            while t < ln:
                tok = ctx[j + t]
                child = -1
                for node in range(num):
                    if parents[node] == parent and tokens[node] == tok:
                        child = node
                        break
                if child < 0:
                    break
                parent = child
                t += 1
            if t == ln:
                continue  # already contained
            if has_child[parent + 1]:
                if leaves >= branching:
                    continue  # would branch off: no leaf left
                leaves += 1
            while t < ln and num < cap:
                tokens[num] = ctx[j + t]
                parents[num] = parent
                has_child[parent + 1] = True
                parent = num
                num += 1
                t += 1
            if num >= cap:
                return tokens[:num], parents[:num]
    return tokens[:num], parents[:num]
