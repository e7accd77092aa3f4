"""Numba kernels for the ``suffix`` drafter: a hashed n-gram → next-token count index and its tree builder.

Vocabulary:

- a **window** is ``k`` consecutive tokens (``1 <= k <= max_match``) of some indexed sequence that is
  followed by one more token of that sequence, the window's **next token**;
- an **index** counts, for every window of every sequence added to it, how often each next token
  followed it. Its arrays (see `new_index`):

  ``ctx_keys/ctx_head/ctx_tail/ctx_total`` — open-addressing table of windows (key 0 = empty slot):
      first/last entry of the window's list of distinct next tokens, and the window's total count;
  ``pair_keys/pair_ent`` — open-addressing table of (window, next token) → entry;
  ``e_tok/e_cnt/e_next`` — entries: next token, its count, the window's next entry (a linked list in
      first-seen order);
  ``meta`` — int64[4]: windows used, pairs used, entries used, live entries (count > 0).

  Adding a token to a sequence updates ``max_match`` windows: O(max_match) = O(1) per token, amortised
  over the tables' doubling (`grow`). Removing a sequence (eviction) decrements the same counts; entries
  at zero stay in their lists until the owner rebuilds the index (the Python side does, once they
  outnumber the live ones).

Windows are identified by a 64-bit hash of their tokens built from the end backwards (``key_k`` extends
``key_{k-1}`` by one older token), so all windows ending at one position cost ``max_match`` mixes.
Hash collisions would merge two windows' counts (a wrong draft, never a wrong output: drafts are
verified); at 64 bits they do not happen in practice.
"""

from __future__ import annotations

import numba
import numpy as np

_MUL = 0x100000001B3  # FNV-64 prime; int64 arithmetic wraps in numba
_SEED = 0x345678ABCDEF
_GOLD = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64


@numba.njit(cache=True, nogil=True, inline="always")
def _mix(h, t):
    return (h ^ (t + 0x5BD1E995)) * _MUL


@numba.njit(cache=True, nogil=True, inline="always")
def _finish(h, k):
    x = (h ^ (k * 0x27D4EB2F165667C5)) * _GOLD
    x ^= (x >> 31) & 0x1FFFFFFFF
    return x if x != 0 else 1


@numba.njit(cache=True, nogil=True, inline="always")
def _pair_key(window_key, tok):
    x = (window_key ^ ((tok + 1) * _GOLD)) * _MUL
    x ^= (x >> 29) & 0x7FFFFFFFF
    return x if x != 0 else 1


@numba.njit(cache=True, nogil=True, inline="always")
def _slot0(key, mask):
    return ((key * _GOLD) >> 20) & mask


def new_index(windows: int = 64, entries: int = 64):
    """Empty index arrays with room for about ``windows`` windows and ``entries`` entries."""
    c = 16
    while c < 2 * windows:
        c *= 2
    p = 16
    while p < 2 * entries:
        p *= 2
    e = max(16, entries)
    return (np.zeros(c, np.int64), np.full(c, -1, np.int64), np.full(c, -1, np.int64), np.zeros(c, np.int64),
            np.zeros(p, np.int64), np.full(p, -1, np.int64),
            np.zeros(e, np.int64), np.zeros(e, np.int64), np.full(e, -1, np.int64),
            np.zeros(4, np.int64))


@numba.njit(cache=True, nogil=True)
def _find(keys, key):
    mask = keys.shape[0] - 1
    s = _slot0(key, mask)
    while True:
        k = keys[s]
        if k == key or k == 0:
            return s
        s = (s + 1) & mask


@numba.njit(cache=True, nogil=True)
def grow(ctx_keys, ctx_head, ctx_tail, ctx_total, pair_keys, pair_ent, e_tok, e_cnt, e_next, meta, extra):
    """The index with room for ``extra`` more windows, pairs and entries (the tables at most half full):
    the same arrays when they already have it, else doubled ones (rehashed)."""
    need_c = meta[0] + extra
    need_p = meta[1] + extra
    need_e = meta[2] + extra
    c = ctx_keys.shape[0]
    while 2 * need_c > c:
        c *= 2
    if c != ctx_keys.shape[0]:
        nk = np.zeros(c, np.int64)
        nh = np.full(c, -1, np.int64)
        nt = np.full(c, -1, np.int64)
        ntot = np.zeros(c, np.int64)
        for s in range(ctx_keys.shape[0]):
            if ctx_keys[s] != 0:
                d = _find(nk, ctx_keys[s])
                nk[d] = ctx_keys[s]
                nh[d] = ctx_head[s]
                nt[d] = ctx_tail[s]
                ntot[d] = ctx_total[s]
        ctx_keys, ctx_head, ctx_tail, ctx_total = nk, nh, nt, ntot
    p = pair_keys.shape[0]
    while 2 * need_p > p:
        p *= 2
    if p != pair_keys.shape[0]:
        nk = np.zeros(p, np.int64)
        ne = np.full(p, -1, np.int64)
        for s in range(pair_keys.shape[0]):
            if pair_keys[s] != 0:
                d = _find(nk, pair_keys[s])
                nk[d] = pair_keys[s]
                ne[d] = pair_ent[s]
        pair_keys, pair_ent = nk, ne
    e = e_tok.shape[0]
    while need_e > e:
        e *= 2
    if e != e_tok.shape[0]:
        nt = np.zeros(e, np.int64)
        nc = np.zeros(e, np.int64)
        nn = np.full(e, -1, np.int64)
        n = meta[2]
        nt[:n] = e_tok[:n]
        nc[:n] = e_cnt[:n]
        nn[:n] = e_next[:n]
        e_tok, e_cnt, e_next = nt, nc, nn
    return ctx_keys, ctx_head, ctx_tail, ctx_total, pair_keys, pair_ent, e_tok, e_cnt, e_next, meta


@numba.njit(cache=True, nogil=True)
def add_positions(ctx_keys, ctx_head, ctx_tail, ctx_total, pair_keys, pair_ent, e_tok, e_cnt, e_next, meta,
                  seq, start, end, max_match, sign):
    """Count (sign=+1) or uncount (sign=-1) the windows of ``seq`` whose next token is at ``start..end-1``.

    Each next-token position ``i`` has windows ``seq[i-k:i]`` for ``k = 1..min(max_match, i)``. The caller
    has made room (`grow` with ``extra = (end - start) * max_match``) before counting."""
    for i in range(max(start, 1), end):
        nxt = seq[i]
        h = np.int64(_SEED)
        for k in range(1, min(max_match, i) + 1):
            h = _mix(h, seq[i - k])
            wkey = _finish(h, k)
            cs = _find(ctx_keys, wkey)
            if ctx_keys[cs] == 0:
                if sign < 0:
                    continue
                ctx_keys[cs] = wkey
                meta[0] += 1
            pkey = _pair_key(wkey, nxt)
            ps = _find(pair_keys, pkey)
            if pair_keys[ps] == 0:
                if sign < 0:
                    continue
                ent = meta[2]
                meta[2] += 1
                e_tok[ent] = nxt
                e_cnt[ent] = 0
                e_next[ent] = -1
                if ctx_tail[cs] < 0:
                    ctx_head[cs] = ent
                else:
                    e_next[ctx_tail[cs]] = ent
                ctx_tail[cs] = ent
                pair_keys[ps] = pkey
                pair_ent[ps] = ent
                meta[1] += 1
            ent = pair_ent[ps]
            if sign > 0:
                if e_cnt[ent] == 0:
                    meta[3] += 1
                e_cnt[ent] += 1
                ctx_total[cs] += 1
            elif e_cnt[ent] > 0:
                e_cnt[ent] -= 1
                ctx_total[cs] -= 1
                if e_cnt[ent] == 0:
                    meta[3] -= 1


@numba.njit(cache=True, nogil=True)
def _window_total(ctx_keys, ctx_total, wkey):
    s = _find(ctx_keys, wkey)
    return ctx_total[s] if ctx_keys[s] != 0 else 0


@numba.njit(cache=True, nogil=True)
def _collect(ctx_keys, ctx_head, e_tok, e_cnt, e_next, wkey, toks, cnts, n):
    """Append the window's (next token, count > 0) pairs to ``toks/cnts[n:]``, merging tokens already there."""
    s = _find(ctx_keys, wkey)
    if ctx_keys[s] == 0:
        return n
    ent = ctx_head[s]
    base = n
    while ent >= 0:
        c = e_cnt[ent]
        if c > 0:
            t = e_tok[ent]
            found = -1
            if base > 0:  # merging into what the other index gave
                for q in range(base):
                    if toks[q] == t:
                        found = q
                        break
            if found >= 0:
                cnts[found] += c
            else:
                if n == toks.shape[0]:
                    return n  # full (callers size the buffers for every distinct token)
                toks[n] = t
                cnts[n] = c
                n += 1
        ent = e_next[ent]
    return n


@numba.njit(cache=True, nogil=True)
def _window_keys(tail, tail_len, max_match, keys):
    """keys[k-1] = hash of the last k tokens of ``tail[:tail_len]`` (k = 1..min(max_match, tail_len))."""
    h = np.int64(_SEED)
    m = min(max_match, tail_len)
    for k in range(1, m + 1):
        h = _mix(h, tail[tail_len - k])
        keys[k - 1] = _finish(h, k)
    return m


@numba.njit(cache=True, nogil=True)
def _lookup(a_keys, a_head, a_total, a_tok, a_cnt, a_next, b_keys, b_head, b_total, b_tok, b_cnt, b_next,
            tail, tail_len, min_match, max_match, keys, toks, cnts):
    """Longest match of ``tail`` in the two indexes and its next tokens (merged counts), unsorted.

    Returns ``(k, n, total)``: the longest window length ``k`` in [min_match, max_match] that ends
    ``tail`` and was followed by some token in either index (0 when none), and ``n`` distinct next tokens
    in ``toks/cnts[:n]`` whose counts sum to ``total``."""
    m = _window_keys(tail, tail_len, max_match, keys)
    for k in range(m, min_match - 1, -1):
        wkey = keys[k - 1]
        ta = _window_total(a_keys, a_total, wkey)
        tb = _window_total(b_keys, b_total, wkey)
        if ta + tb > 0:
            n = _collect(a_keys, a_head, a_tok, a_cnt, a_next, wkey, toks, cnts, 0)
            n = _collect(b_keys, b_head, b_tok, b_cnt, b_next, wkey, toks, cnts, n)
            return k, n, ta + tb
    return 0, 0, 0


@numba.njit(cache=True, nogil=True)
def _rank(toks, cnts, n):
    """Order of ``toks/cnts[:n]``: count descending, then token ascending."""
    order = np.arange(n)
    for i in range(1, n):  # insertion sort: n is small after the caller's cut
        j = i
        while j > 0:
            a = order[j - 1]
            b = order[j]
            if cnts[b] > cnts[a] or (cnts[b] == cnts[a] and toks[b] < toks[a]):
                order[j - 1] = b
                order[j] = a
                j -= 1
            else:
                break
    return order


@numba.njit(cache=True, nogil=True)
def _top(toks, cnts, n, keep):
    """The ``keep`` best of ``toks/cnts[:n]`` (count desc, token asc), in that order, as index arrays."""
    if n <= keep:
        return _rank(toks, cnts, n)
    # partial selection: repeatedly take the best remaining (keep is small)
    taken = np.zeros(n, np.bool_)
    out = np.empty(keep, np.int64)
    for r in range(keep):
        best = -1
        for q in range(n):
            if taken[q]:
                continue
            if best < 0 or cnts[q] > cnts[best] or (cnts[q] == cnts[best] and toks[q] < toks[best]):
                best = q
        taken[best] = True
        out[r] = best
    return out


@numba.njit(cache=True, nogil=True)
def lookup(a_keys, a_head, a_total, a_tok, a_cnt, a_next, b_keys, b_head, b_total, b_tok, b_cnt, b_next,
           tail, min_match, max_match):
    """The longest match of the whole of ``tail`` (k, 0 if none) and its next tokens with merged counts,
    ranked count descending then token ascending: ``(k, toks int64[n], cnts int64[n])``."""
    keys = np.empty(max(max_match, 1), np.int64)
    cap = a_tok.shape[0] + b_tok.shape[0]
    toks = np.empty(cap, np.int64)
    cnts = np.empty(cap, np.int64)
    k, n, _ = _lookup(a_keys, a_head, a_total, a_tok, a_cnt, a_next, b_keys, b_head, b_total, b_tok, b_cnt,
                      b_next, tail, tail.shape[0], min_match, max_match, keys, toks, cnts)
    order = _rank(toks, cnts, n)
    return k, toks[order], cnts[order]


@numba.njit(cache=True, nogil=True)
def build_suffix_tree(a_keys, a_head, a_total, a_tok, a_cnt, a_next, b_keys, b_head, b_total, b_tok, b_cnt,
                      b_next, ctx, min_match, max_match, depth, cap, spec_factor, min_prob):
    """The draft tree of one context, best first: ``(tokens int64[N], parents int64[N], scores float32[N])``.

    Each node's children are the next tokens of the longest match (`_lookup`) of ``ctx`` + the node's
    path; a child's score is its parent's times ``count / total`` of that match (the root's is 1). The
    tree grows by repeatedly adding the best-scoring candidate (ties: the earliest-made candidate;
    siblings are made in rank order), up to ``cap`` nodes and ``depth`` levels. ``scores`` are the log
    of those products (never above a parent's). Only each node's ``cap`` best children can ever be
    added, so only they become candidates.

    Two cuts keep weak evidence from filling the budget (SuffixDecoding's): with ``spec_factor > 0`` the
    tree has at most ``spec_factor * k`` nodes, ``k`` the root's match length, unless the match is
    ``max_match`` long (the index cannot tell how much longer it is: a passage being copied, which is
    worth a chain as deep as the drafter's ``depth``); a candidate whose score is below ``min_prob`` is
    not made."""
    tokens = np.empty(max(cap, 0), np.int64)
    parents = np.empty(max(cap, 0), np.int64)
    scores = np.empty(max(cap, 0), np.float32)
    L = ctx.shape[0]
    if cap <= 0 or depth <= 0 or L < 1:
        return tokens[:0], parents[:0], scores[:0]
    buf = a_tok.shape[0] + b_tok.shape[0]
    toks = np.empty(buf, np.int64)
    cnts = np.empty(buf, np.int64)
    keys = np.empty(max(max_match, 1), np.int64)
    tail = np.empty(max_match + depth, np.int64)
    node_depth = np.empty(max(cap, 0), np.int64)
    # candidates
    max_c = cap * (cap + 1)
    c_tok = np.empty(max_c, np.int64)
    c_par = np.empty(max_c, np.int64)
    c_score = np.empty(max_c, np.float64)
    c_live = np.zeros(max_c, np.bool_)
    nc = 0
    num = 0
    parent = -1
    parent_score = 1.0
    parent_depth = 0
    while True:
        # expand `parent`: its tail is the last max_match tokens of ctx + its path
        if parent_depth < depth and num < cap:
            plen = parent_depth
            take_ctx = min(L, max_match - min(plen, max_match))
            tl = take_ctx + plen
            for q in range(take_ctx):
                tail[q] = ctx[L - take_ctx + q]
            node = parent
            pos = tl - 1
            while node >= 0:
                tail[pos] = tokens[node]
                pos -= 1
                node = parents[node]
            tstart = max(0, tl - max_match)
            k, n, total = _lookup(a_keys, a_head, a_total, a_tok, a_cnt, a_next, b_keys, b_head, b_total, b_tok,
                                  b_cnt, b_next, tail[tstart:tl], tl - tstart, min_match, max_match, keys, toks, cnts)
            if parent < 0 and spec_factor > 0 and k < max_match:
                cap = min(cap, spec_factor * k)
            if n > 0:
                order = _top(toks, cnts, n, cap)
                for r in range(order.shape[0]):
                    q = order[r]
                    if parent_score * (cnts[q] / total) < min_prob:
                        break  # the rest score lower still
                    c_tok[nc] = toks[q]
                    c_par[nc] = parent
                    c_score[nc] = parent_score * (cnts[q] / total)
                    c_live[nc] = True
                    nc += 1
        if num >= cap:
            break
        best = -1
        for q in range(nc):
            if c_live[q] and (best < 0 or c_score[q] > c_score[best]):
                best = q
        if best < 0:
            break
        c_live[best] = False
        tokens[num] = c_tok[best]
        parents[num] = c_par[best]
        scores[num] = np.log(c_score[best])
        node_depth[num] = 1 if c_par[best] < 0 else node_depth[c_par[best]] + 1
        parent = num
        parent_score = c_score[best]
        parent_depth = node_depth[num]
        num += 1
    return tokens[:num], parents[:num], scores[:num]
