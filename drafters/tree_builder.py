"""The one dynamic tree builder of the learned drafters (EAGLE, draft model, Medusa's dynamic trees).

Trees of A requests grow level by level from a drafter's logits, in compiled code (one call per level,
no per-node Python), with ``k = topk`` children per expanded node and ``W = width`` nodes expanded per
level (EAGLE-2: W = k):

- level 1: the root's k best children (greedy: the top-k tokens; sampled: k tokens drawn without
  replacement from q — see below);
- level d >= 2: the **frontier** — the W best nodes of level d-1 — each get k children;
- `finish`: every generated node is **reranked** by its score and the best ``budget`` are kept.

Scores are cumulative: a child's score is its parent's plus its own term, so a node never scores above
its parent and the kept set is closed under ancestors (ties go to the lower generation index; a parent
always has a lower index than its children). Greedy requests (temperature 0) score a child by its draft
log-probability, as EAGLE-2 does. Sampled requests score the j-th drawn sibling by
``log 0.8 + j log 0.2`` — a guess at the chance the verifier walks through it that does not look at the
drawn value: which nodes exist, which are expanded and which survive the cut then depend on the budget
and sibling ranks only, never on the values drawn, and the kept siblings of a node are always its first
draws. That is what keeps stochastic verification lossless.

Draft distributions (sampled requests): a node's q is softmax(logits / T) restricted to its
``q_support`` most likely tokens and renormalised — the drafter's own (lossless) choice of draft
distribution, kept compact. Child j is drawn from q without children 0..j-1 (renormalised), and that is
the q it carries (`DraftTree.q_ids` / `q_probs`). Uniforms are pre-drawn per request.

Generation numbering: level 1 holds ``0 .. k-1``; level d >= 2 holds ``k + (d-2) W k + f k + j`` for
child j of frontier slot f. Frontier slots are the frontier's nodes in score order (ties: lower index).
A drafter feeds the frontier of level d at cache slots ``(d-1) W + f`` past its committed entries, each
slot seeing its fed ancestors and itself (`feed_mask`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from specserve.kernels.simd import LANES, vadd, vbroadcast, vexp, vload, vmax, vmax_lanes, vsub, vsum, vzero

# Expansion/rerank score of the j-th drawn sibling (log): with a good draft (q close to p) the first draw
# is accepted with probability near 1 whatever its q, and later siblings are only tried after rejections;
# so sibling j is scored as accepted with probability 0.8 * 0.2**j, never by its drawn value.
SAMPLED_SIBLING_LOGP = np.array([math.log(0.8) + j * math.log(0.2) for j in range(64)])

# Tokens in a sampled node's draft distribution: the rest of the draft's mass is dropped (renormalised).
DRAFT_Q_SUPPORT = 32


@dataclass(frozen=True)
class Frontier:
    """The nodes whose children come next, W slots per request (rows of `requests`).

    requests:    int64[A'] the requests that generated this level (indices into the builder's batch).
    nodes:       int64[A', W] generation indices (-1: no node); tokens: int64[A', W] draft-vocabulary ids;
    parent_slot: int64[A', W] the frontier slot (of the previous level) of each node's parent — the row
                 of the previous feed whose output a node is fed with (0 at level 1);
    valid:       bool[A', W] slots holding a real node.
    """

    requests: np.ndarray
    nodes: np.ndarray
    tokens: np.ndarray
    parent_slot: np.ndarray
    valid: np.ndarray


class TreeBuilder:
    """Dynamic trees of A requests under construction (see the module docstring).

    temperatures: float32[A] (0 = greedy); uniforms: float64[A, size] for sampled requests (one per
    generated node: child j of a row uses its own slot's), None when every request is greedy;
    vocab: the draft vocabulary size.
    """

    def __init__(self, topk: int, depth: int, width: int, temperatures: np.ndarray, uniforms: np.ndarray | None,
                 vocab: int, q_support: int = DRAFT_Q_SUPPORT) -> None:
        if not 1 <= topk <= 64 or depth < 1 or width < 1:
            raise ValueError(f"tree builder needs 1 <= topk <= 64, depth >= 1, width >= 1; got {topk}, {depth}, {width}")
        self.k, self.depth, self.width, self.vocab = topk, depth, width, vocab
        self.num = len(temperatures)
        self.temperatures = np.ascontiguousarray(temperatures, dtype=np.float32)
        self.sampled = self.temperatures > 0
        self.size = topk + (depth - 1) * width * topk  # generated nodes of a full tree
        a, g = self.num, self.size
        self.scores = np.full((a, g), -np.inf)
        self.tokens = np.zeros((a, g), dtype=np.int64)
        self.parents = np.full((a, g), -1, dtype=np.int64)
        self.q_support = max(q_support, topk)
        if self.sampled.any():
            if uniforms is None or uniforms.shape != (a, g):
                raise ValueError(f"sampled requests need uniforms of shape ({a}, {g})")
            self.uniforms = np.ascontiguousarray(uniforms, dtype=np.float64)
            self.q_ids = np.full((a, g, self.q_support), -1, dtype=np.int64)
            self.q_probs = np.zeros((a, g, self.q_support), dtype=np.float32)
        else:
            self.uniforms = np.zeros((a, 1))
            self.q_ids = np.zeros((a, 1, 1), dtype=np.int64)
            self.q_probs = np.zeros((a, 1, 1), dtype=np.float32)
        self.frontier_nodes = np.full((a, width), -1, dtype=np.int64)
        self.level = 0
        # Ancestors among fed frontier slots, for tail masks: [A, S, S] over slots of levels 1..depth-1.
        self.fed = max(depth - 1, 0) * width
        self.anc = np.zeros((a, max(self.fed, 1), max(self.fed, 1)), dtype=np.bool_)

    def add_level(self, logits: np.ndarray, requests: np.ndarray | None = None) -> Frontier:
        """Give the current frontier's nodes (the root at level 1) k children each; return the next frontier.

        logits: float32[A', F, V] the drafter's raw logits at each frontier slot of the requests
        `requests` (int64[A'], ascending; default all), F = 1 at level 1 and W later. Rows of slots
        without a node are ignored.
        """
        level, k, w = self.level + 1, self.k, self.width
        if level > self.depth:
            raise ValueError(f"the tree has depth {self.depth}: no level {level}")
        if requests is None:
            requests = np.arange(self.num, dtype=np.int64)
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim == 2:
            logits = logits[:, None]
        n, width, vocab = logits.shape
        if n != len(requests) or width != (1 if level == 1 else w) or vocab != self.vocab:
            raise ValueError(f"level {level}: logits have shape {tuple(logits.shape)}, expected "
                             f"[{len(requests)}, {1 if level == 1 else w}, {self.vocab}]")
        self.level = level
        frontier_tokens = np.zeros((n, w), dtype=np.int64)
        parent_slot = np.zeros((n, w), dtype=np.int64)
        _expand_level(np.ascontiguousarray(logits.reshape(n * width, vocab)), np.asarray(requests, dtype=np.int64),
                      width, level, k, w, self.depth, self.temperatures, self.uniforms, SAMPLED_SIBLING_LOGP,
                      self.scores, self.tokens, self.parents, self.q_ids, self.q_probs, self.frontier_nodes,
                      frontier_tokens, parent_slot, self.anc)
        nodes = self.frontier_nodes[requests].copy()
        return Frontier(np.asarray(requests), nodes, frontier_tokens, parent_slot, nodes >= 0)

    def feed_mask(self, level: int, request: int) -> np.ndarray:
        """bool[W, level * W]: which fed slots (levels 1..level) the frontier of ``level`` sees — a tail
        mask over the slots of levels 1..level-1 already in the cache, then the new ones."""
        w = self.width
        return self.anc[request, (level - 1) * w:level * w, :level * w]

    def finish(self, budgets) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray]]:
        """Keep each request's ``budgets[a]`` best nodes; per request (tokens int64[N] draft ids, parents
        int64[N] in output numbering, q_ids int64[N, K] and q_probs float32[N, K] or None for greedy
        requests, scores float32[N] — the nodes' cumulative scores, `DraftTree.scores`), parents first."""
        budgets = np.asarray(budgets, dtype=np.int64)
        kept = np.zeros((self.num, self.size), dtype=np.int64)
        counts = np.zeros(self.num, dtype=np.int64)
        new_parent = np.zeros((self.num, self.size), dtype=np.int64)
        _cut(self.scores, self.parents, budgets, kept, counts, new_parent)
        out = []
        for a in range(self.num):
            sel = kept[a, :counts[a]]
            q_ids = q_probs = None
            if self.sampled[a]:
                q_ids, q_probs = self.q_ids[a, sel], self.q_probs[a, sel]
            out.append((self.tokens[a, sel], new_parent[a, :counts[a]], q_ids, q_probs,
                        self.scores[a, sel].astype(np.float32)))
        return out


def mask_level(logits: np.ndarray, grammars: list, builder: TreeBuilder, front: Frontier | None,
               requests: np.ndarray | None = None, target_ids=lambda ids: ids,
               draft_allowed=lambda allowed: allowed) -> None:
    """Grammar-aware drafting: -inf (in place) at every token a constrained request's grammar forbids
    after each node whose children come next, so no forbidden token is drawn and a sampled node's q
    is the masked draft distribution.

    logits: float32[A', F, V] the level's draft-vocabulary logits, row i for builder request
    ``requests[i]`` (default: all); front: the frontier being expanded (None at level 1: each
    request's root, F = 1); grammars: per builder request, a `GrammarState` or None. target_ids maps
    draft ids to target ids, draft_allowed a bool[target V] mask to bool[V] (identity unless the
    drafter has a reduced vocabulary)."""
    for i, f, path, grammar in _frontier_rows(grammars, builder, front, requests, target_ids):
        allowed = grammar.allowed(path)
        if allowed is None:  # the path itself is forbidden (unreachable: its nodes were masked)
            logits[i, f] = -np.inf
        else:
            logits[i, f, ~draft_allowed(allowed)] = -np.inf


def adjust_level(logits: np.ndarray, adjusters: list, builder: TreeBuilder, front: Frontier | None,
                 requests: np.ndarray | None, target_ids, columns: np.ndarray) -> None:
    """Rules that edit the target's logits (penalties, logit bias) edit the draft's the same way, row by
    row along each frontier node's path, before anything is drawn (a sampled node's q is the adjusted
    draft distribution). Shapes as `mask_level`; adjusters: per builder request, a tuple of
    `specserve.step_hooks.DraftLogits` (empty: none); columns: int64[target ids] each target id's column
    in the logits, -1 where the draft vocabulary lacks it (`draft_columns`)."""
    for i, f, path, adjust in _frontier_rows([a or None for a in adjusters], builder, front, requests, target_ids):
        for rule in adjust:
            rule.adjust(logits[i, f], path, columns)


def to_target_ids(id_map: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    """Draft-vocabulary ids (any shape; -1 pads a compact q and stays -1) as target ids (None: the identity)."""
    if id_map is None:
        return ids
    return np.where(ids >= 0, id_map[np.maximum(ids, 0)], -1)


def allowed_columns(id_map: np.ndarray | None, allowed: np.ndarray, vocab: int) -> np.ndarray:
    """bool[target V] (a grammar's allowed tokens) -> bool[vocab] over a drafter's logit columns."""
    if id_map is not None:
        return allowed[id_map]
    if len(allowed) == vocab:
        return allowed
    out = np.zeros(vocab, dtype=np.bool_)
    n = min(len(allowed), vocab)
    out[:n] = allowed[:n]
    return out


def draft_columns(id_map: np.ndarray | None, vocab: int) -> np.ndarray:
    """int64[target ids]: each target id's column in a drafter's logits over `vocab` columns (draft id ->
    target id `id_map`, None: the identity), -1 where the draft vocabulary lacks it."""
    if id_map is None:
        return np.arange(vocab, dtype=np.int64)
    columns = np.full(int(id_map.max()) + 1, -1, dtype=np.int64)
    columns[id_map] = np.arange(len(id_map))
    return columns


def _frontier_rows(per_request: list, builder: TreeBuilder, front: Frontier | None, requests: np.ndarray | None,
                   target_ids):
    """(row i, frontier slot f, the slot's path from the root as target ids, the request's entry) for
    every valid frontier slot of the requests whose entry is not None."""
    if requests is None:
        requests = np.arange(len(per_request))
    slot_row = {} if front is None else {int(a): j for j, a in enumerate(front.requests)}
    for i, a in enumerate(requests):
        entry = per_request[a]
        if entry is None:
            continue
        j = slot_row.get(int(a))
        slots = [0] if front is None else np.flatnonzero(front.valid[j])
        for f in slots:
            path: list[int] = []
            node = -1 if front is None else int(front.nodes[j, f])
            while node >= 0:
                path.append(int(builder.tokens[a, node]))
                node = int(builder.parents[a, node])
            yield i, f, target_ids(np.array(path[::-1], dtype=np.int64)).tolist(), entry


@numba.njit(cache=True, nogil=True)
def log_normalizer(row):
    """log Σ exp(row) (row: float32[V] C-contiguous logits; -inf entries, masked columns, add nothing): what a greedy
    node's log-probability subtracts from its logit. 16 lanes at a time (`simd.vexp`, the lanes' sum added up in one
    fixed order), a short tail one by one: a draft vocabulary's 4,096 scalar exps took ~20 µs a row, five rows a
    Medusa drafting step (these are draft scores: the policy's guesses, never what is emitted)."""
    n = row.shape[0]
    whole = n - n % LANES
    top = vbroadcast(np.float32(-np.inf))
    for j in range(0, whole, LANES):
        top = vmax(top, vload(row, j))
    peak = vmax_lanes(top)
    for t in range(whole, n):
        peak = max(peak, row[t])
    if peak == -np.inf:
        return -np.inf
    shift = vbroadcast(peak)
    lanes = vzero()
    for j in range(0, whole, LANES):
        lanes = vadd(lanes, vexp(vsub(vload(row, j), shift)))
    total = np.float64(vsum(lanes))
    for t in range(whole, n):
        total += math.exp(row[t] - peak)
    return np.float64(peak) + math.log(total)


@numba.njit(cache=True, nogil=True)
def top_columns(row, count, ids, values):
    """The `count` largest entries of row (ties: the lower index first), best first, into ids/values."""
    for j in range(count):
        ids[j] = -1
        values[j] = -np.inf
    for t in range(row.shape[0]):
        v = row[t]
        if v > values[count - 1]:
            j = count - 1
            while j > 0 and v > values[j - 1]:
                values[j] = values[j - 1]
                ids[j] = ids[j - 1]
                j -= 1
            values[j] = v
            ids[j] = t


@numba.njit(cache=True, nogil=True)
def draw_siblings(row, temperature, count, uniforms, q_ids, q_probs, tokens, top_ids, top_vals, weights):
    """Draw `count` siblings without replacement from q = softmax(row / temperature) restricted to its
    `support` (= len(weights)) most likely tokens and renormalised. Sibling j's token goes to tokens[j]
    and the distribution it was drawn from (q without siblings 0..j-1, renormalised) to q_ids[j] /
    q_probs[j]; uniforms[j] drives its inverse-CDF draw. Returns how many could be drawn (fewer when the
    support runs out). top_ids / top_vals / weights: scratch of at least `support` entries."""
    support = weights.shape[0]
    top_columns(row, support, top_ids, top_vals)
    peak = top_vals[0]
    mass = 0.0
    for m in range(support):
        weights[m] = math.exp((top_vals[m] - peak) / temperature) if top_ids[m] >= 0 else 0.0
        mass += weights[m]
    for j in range(count):
        if not mass > 0.0:
            return j
        for m in range(support):
            q_ids[j, m] = top_ids[m]
            q_probs[j, m] = weights[m] / mass
        target = uniforms[j] * mass
        acc = 0.0
        pick = -1
        for m in range(support):
            if weights[m] > 0.0:
                acc += weights[m]
                pick = m
                if acc > target:
                    break
        tokens[j] = top_ids[pick]
        weights[pick] = 0.0
        # Re-summed, not decremented: subtracting leaves a rounding residue (~1e-17) once the support is
        # spent (common under a grammar mask: few allowed tokens), and the next draw would pick nothing.
        mass = 0.0
        for m in range(support):
            mass += weights[m]
    return count


@numba.njit(cache=True, nogil=True)
def _expand_level(logits, requests, width, level, k, w, depth, temperatures, uniforms, sampled_logp,
                  scores, tokens, parents, q_ids, q_probs, frontier_nodes, frontier_tokens, parent_slot, anc):
    base = 0 if level == 1 else k + (level - 2) * w * k
    size = k * width
    support = q_ids.shape[2]
    top_ids = np.empty(max(k, support), np.int64)
    top_vals = np.empty(max(k, support), np.float64)
    weights = np.empty(support, np.float64)  # (support is 1 when every request is greedy: unused then)
    for i in range(requests.shape[0]):
        a = requests[i]
        temp = temperatures[a]
        for f in range(width):
            row = logits[i * width + f]
            parent = -1 if level == 1 else frontier_nodes[a, f]
            if level > 1 and parent < 0:
                continue  # an empty frontier slot: its children do not exist
            parent_score = 0.0 if level == 1 else scores[a, parent]
            first = base + f * k
            if temp == 0.0:
                top_columns(row, k, top_ids, top_vals)
                lse = log_normalizer(row)
                for j in range(k):
                    g = first + j
                    parents[a, g] = parent
                    if top_ids[j] >= 0 and top_vals[j] > -np.inf:
                        tokens[a, g] = top_ids[j]
                        scores[a, g] = parent_score + (top_vals[j] - lse)
                continue
            # Sampled: k siblings drawn without replacement from the row's compact q.
            drawn = draw_siblings(row, temp, k, uniforms[a, first:first + k], q_ids[a, first:first + k],
                                  q_probs[a, first:first + k], tokens[a, first:first + k], top_ids, top_vals, weights)
            for j in range(k):
                parents[a, first + j] = parent
                if j < drawn:
                    scores[a, first + j] = parent_score + sampled_logp[j]
        # The next frontier: the W best of this level's nodes (stable: ties to the lower index).
        order = np.argsort(-scores[a, base:base + size], kind="mergesort")
        for f in range(w):
            if f < size and scores[a, base + order[f]] > -np.inf:
                node = base + order[f]
                frontier_nodes[a, f] = node
                frontier_tokens[i, f] = tokens[a, node]
                parent_slot[i, f] = order[f] // k
            else:
                frontier_nodes[a, f] = -1
                frontier_tokens[i, f] = 0
                parent_slot[i, f] = 0
        if level < depth:  # fed slot (level-1) W + f sees itself and its parent's fed ancestors
            mine = (level - 1) * w
            for f in range(w):
                if level > 1:
                    parent_fed = (level - 2) * w + parent_slot[i, f]
                    for s in range(mine):
                        anc[a, mine + f, s] = anc[a, parent_fed, s]
                anc[a, mine + f, mine + f] = True


@numba.njit(cache=True, nogil=True)
def _cut(scores, parents, budgets, kept, counts, new_parent):
    """Per request: the best `budget` nodes (score desc, index asc), listed in generation order."""
    num, size = scores.shape
    for a in range(num):
        order = np.argsort(-scores[a], kind="mergesort")
        keep = np.zeros(size, np.bool_)
        valid = 0
        for r in range(size):
            if valid >= budgets[a] or not scores[a, order[r]] > -np.inf:
                break
            keep[order[r]] = True
            valid += 1
        index = np.full(size, -1, np.int64)
        n = 0
        for g in range(size):
            if keep[g]:
                index[g] = n
                kept[a, n] = g
                p = parents[a, g]
                new_parent[a, n] = index[p] if p >= 0 else -1
                n += 1
        counts[a] = n
