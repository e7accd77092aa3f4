"""EAGLE-2 dynamic draft trees, built for a whole batch of requests with tensor ops (no loop over nodes).

Per request, with ``k = topk``:

- level 1: the root's ``k`` best children (greedy: the top-k tokens of the draft distribution q;
  sampled: ``k`` tokens drawn from q without replacement, `sample_siblings`);
- every level ``d = 2 .. depth``: the **frontier** — the ``k`` best nodes of level ``d - 1`` — each
  get ``k`` children, so a level has ``k * k`` candidates;
- finally every generated node is **reranked** by its score and the best ``budget`` are kept.

Scores are cumulative: a child's score is its parent's plus its own term, so a node never scores
above its parent and the kept set is closed under ancestors (ties go to the lower node index, and a
parent always has a lower index than its children). Greedy requests (temperature 0) score a child
by its draft log-probability, as EAGLE-2 does. Sampled requests score the j-th drawn sibling by
``log 0.8 + j log 0.2`` — a guess at the chance the verifier walks through it that does not look at
the drawn value: which nodes exist, which are expanded and which survive the cut then depend on
the budget and sibling ranks only, never on the values drawn, and the kept siblings of a node are
always its first draws. That is what keeps stochastic verification lossless (see
drafters/draft_model.py), with each node's exact q (given its earlier siblings) in ``probs``.

Node numbering during construction ("generation index"): level 1 holds ``0 .. k-1``; level
``d >= 2`` holds ``k + (d-2) k^2 + f k + j`` for child ``j`` of frontier slot ``f``. Frontier slots
are the frontier nodes in score order (ties: lower index). Output trees list the kept nodes in
generation order, which puts parents before children.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.drafters.siblings import SAMPLED_SIBLING_LOGP, sample_siblings



@dataclass
class Frontier:
    """The nodes whose children come next, ``k`` slots per request (rows of `requests`).

    requests: int64[A'] the requests that generated this level (indices into the tree's batch).
    nodes:    int64[A', k] generation indices; tokens: int64[A', k] draft-vocabulary ids;
    parent_slot: int64[A', k] the frontier slot (of the previous level) of each node's parent — the
              row of the previous feed whose output feature this node is fed with (0 at level 1);
    valid:    bool[A', k] slots holding a real node (a request can run out of tokens with q > 0).
    """

    requests: torch.Tensor
    nodes: torch.Tensor
    tokens: torch.Tensor
    parent_slot: torch.Tensor
    valid: torch.Tensor


class DynamicTree:
    """Dynamic trees of ``A`` requests under construction.

    sampled: bool[A] (temperature > 0: draw siblings; else take the top-k); generators: one per
    request (used for sampled ones); vocab: the draft vocabulary size.
    """

    def __init__(self, topk: int, depth: int, sampled: list[bool], generators: list[torch.Generator | None],
                 vocab: int, device: torch.device | str = "cpu") -> None:
        self.k, self.depth = topk, depth
        self.num = len(sampled)
        self.size = topk + (depth - 1) * topk * topk  # generated nodes of a full tree
        self.device = torch.device(device)
        self.sampled = torch.tensor(sampled, dtype=torch.bool)
        self.generators = generators
        self.vocab = vocab
        self._sampled_logp = torch.tensor(SAMPLED_SIBLING_LOGP[:topk])  # score terms of sibling draws 0..k-1
        a, g = self.num, self.size
        self.scores = torch.full((a, g), -math.inf, device=self.device)
        self.tokens = torch.zeros(a, g, dtype=torch.int64, device=self.device)
        self.parents = torch.full((a, g), -1, dtype=torch.int64, device=self.device)
        # q of sampled requests' nodes, rows by sampled request: [A_s, G, V] (allocated on first use)
        self.sampled_row = torch.cumsum(self.sampled.long(), 0) - 1
        self.probs: torch.Tensor | None = None
        self.level = 0
        self.frontier: Frontier | None = None
        # Ancestors among fed frontier slots, for tail masks: [A, S, S] over slots of levels 1..depth-1.
        self.fed = max(depth - 1, 0) * topk
        self.anc = torch.zeros(a, self.fed, self.fed, dtype=torch.bool)

    def _offset(self, level: int) -> int:
        return 0 if level == 1 else self.k + (level - 2) * self.k * self.k

    def add_level(self, logq: torch.Tensor, requests: torch.Tensor | None = None) -> Frontier:
        """Give the current frontier's nodes (the root at level 1) ``k`` children each; return the next frontier.

        logq: float[A', F, V] log q at each frontier slot of the requests ``requests`` (int64[A'],
        default all; a subset of the previous level's), F = 1 at level 1 and k later; for sampled
        requests q must already carry the temperature. Rows of invalid frontier slots are ignored.
        """
        level, k = self.level + 1, self.k
        if level > self.depth:
            raise ValueError(f"the tree has depth {self.depth}: no level {level}")
        if requests is None:
            requests = torch.arange(self.num)
        if logq.dim() == 2:
            logq = logq[:, None]
        n, width, vocab = logq.shape
        if n != len(requests) or width != (1 if level == 1 else k) or vocab != self.vocab:
            raise ValueError(f"level {level}: logq has shape {tuple(logq.shape)}, expected [{len(requests)}, "
                             f"{1 if level == 1 else k}, {self.vocab}]")
        self.level = level
        if level == 1:
            parent_nodes = torch.full((n, 1), -1, dtype=torch.int64)
            parent_scores = torch.zeros(n, 1, device=self.device)
        else:
            prev = self.frontier
            pos = _positions_in(prev.requests, requests)
            parent_nodes = prev.nodes[pos]  # [n, k]
            parent_scores = self.scores[requests[:, None], parent_nodes]
            parent_scores = torch.where(prev.valid[pos], parent_scores, -math.inf)
        rows = logq.reshape(n * width, vocab)
        row_req = requests.repeat_interleave(width)
        sampled = self.sampled[row_req]
        ids = rows.topk(k, dim=-1).indices  # greedy: the k most likely, best first  [R, k]
        child_logq = rows.gather(-1, ids)
        valid = torch.isfinite(child_logq)
        if bool(sampled.any()):
            srows = sampled.nonzero().flatten()
            gens = [self.generators[int(row_req[r])] for r in srows]
            tok_s, valid_s, probs = sample_siblings(rows[srows].exp(), gens, k)  # probs [R_s, k, V]
            ids[srows], valid[srows] = tok_s, valid_s
            child_logq[srows] = self._sampled_logp.to(rows.device).expand(len(srows), k)
            self._store_probs(row_req[srows], srows, probs, level, width)
        scores = parent_scores.reshape(-1, 1) + torch.where(valid, child_logq, -math.inf)  # [R, k]
        # Place the children: row r = (request, frontier slot f) holds nodes offset + f k + j.
        base = self._offset(level)
        nodes = base + torch.arange(width * k).view(1, width * k).expand(n, -1)  # [n, F k]
        req_col = requests[:, None]
        self.scores[req_col, nodes] = scores.view(n, width * k).to(self.scores.dtype)
        self.tokens[req_col, nodes] = ids.view(n, width * k)
        self.parents[req_col, nodes] = parent_nodes.repeat_interleave(k, dim=1)
        # The next frontier: the k best of this level (stable sort: ties to the lower index).
        level_scores = self.scores[req_col, nodes]
        order = torch.sort(-level_scores, dim=1, stable=True).indices[:, :k]  # [n, k] (positions in level)
        front_nodes = nodes.gather(1, order)
        front_valid = torch.isfinite(level_scores.gather(1, order))
        self.frontier = Frontier(requests, front_nodes, self.tokens[req_col, front_nodes], order // k, front_valid)
        if level < self.depth:
            self._record_ancestors(self.frontier, level)
        return self.frontier

    def _store_probs(self, reqs: torch.Tensor, srows: torch.Tensor, probs: torch.Tensor, level: int, width: int) -> None:
        if self.probs is None:
            self.probs = torch.zeros(int(self.sampled.sum()), self.size, self.vocab, device=self.device)
        k = self.k
        slot = srows % width  # frontier slot of each sampled row
        nodes = self._offset(level) + slot[:, None] * k + torch.arange(k)[None, :]  # [R_s, k]
        self.probs[self.sampled_row[reqs][:, None], nodes] = probs.to(self.probs.dtype)

    def _record_ancestors(self, front: Frontier, level: int) -> None:
        """Frontier slot f of level d is fed slot (d-1) k + f; it sees itself and its parent's ancestors."""
        k = self.k
        n = len(front.requests)
        mine = (level - 1) * k + torch.arange(k)
        rows = torch.zeros(n, k, self.fed, dtype=torch.bool)
        if level > 1:
            parent_fed = (level - 2) * k + front.parent_slot  # [n, k]
            rows = self.anc[front.requests[:, None], parent_fed]  # [n, k, S]
        rows[:, torch.arange(k), mine] = True
        self.anc[front.requests[:, None], mine[None, :].expand(n, k)] = rows

    def feed_mask(self, level: int, request: int) -> torch.Tensor:
        """bool[k, level * k]: which fed slots (levels 1..level) the frontier of ``level`` sees — a
        tail mask over the slots of levels 1..level-1 already in the cache, then the new ones."""
        k = self.k
        rows = slice((level - 1) * k, level * k)
        return self.anc[request, rows, : level * k]

    def finish(self, budgets: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Keep each request's ``budgets[a]`` best nodes; per request (tokens int64[N] draft ids,
        parents int64[N] in output numbering, probs float[N, V] or None), parents first."""
        budget = torch.as_tensor(budgets, dtype=torch.int64, device=self.device)
        order = torch.sort(-self.scores, dim=1, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(self.size, device=self.device).expand(self.num, -1))
        cap = torch.minimum(budget, torch.isfinite(self.scores).sum(1))
        keep = rank < cap[:, None]  # [A, G]
        new_index = keep.cumsum(1) - 1
        has_parent = self.parents >= 0
        parent_kept = keep.gather(1, self.parents.clamp(min=0)) | ~has_parent
        assert bool((parent_kept | ~keep).all()), "the cut must keep every kept node's ancestors"
        new_parent = torch.where(has_parent, new_index.gather(1, self.parents.clamp(min=0)), -1)
        out = []
        for a in range(self.num):
            sel = keep[a]
            probs = None
            if bool(self.sampled[a]):
                probs = self.probs[self.sampled_row[a], sel] if self.probs is not None else torch.zeros(0, self.vocab)
            out.append((self.tokens[a, sel], new_parent[a, sel], probs))
        return out


def _positions_in(haystack: torch.Tensor, needles: torch.Tensor) -> torch.Tensor:
    """Index in ``haystack`` (int64[n], ascending) of each of ``needles``; all must be present."""
    pos = torch.searchsorted(haystack, needles)
    if bool((pos >= len(haystack)).any()) or not bool((haystack[pos.clamp(max=len(haystack) - 1)] == needles).all()):
        raise ValueError("a level's requests must be a subset of the previous level's")
    return pos
