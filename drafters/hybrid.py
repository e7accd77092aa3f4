"""The ``hybrid`` drafter: several drafters propose into one tree per request.

``--drafter hybrid:suffix+eagle`` (parts are drafter specs joined by ``+``; a part may name its
directory: ``hybrid:suffix+eagle:DIR``). Each step the cheap parts (n-gram, suffix: whole trees from
an index) draft first; the costly ones (EAGLE, a draft model: a model forward per level, catch-up on
the context) draft for a request only where the cheap parts' tree expects fewer than ``fallback_below``
accepted tokens — SuffixDecoding's hybrid rule, which keeps a strong match from paying for a head it
does not need. The trees are merged into one trie (a token path proposed by several parts is one node,
its children the union of theirs), each node is valued, and the best ``budget`` nodes are kept.

Values. A part's tree carries ``scores``, its guess at log P(node accepted) (cumulative along the path).
A tree without them (n-gram's; Medusa's sampled trees, whose scores must not depend on the draws) is
scored by its shape, as the adaptive policy scores such a tree (`fallback_scores`: a level down, and each
earlier sibling, cost a factor e). From the scores each node gets the part's *conditional* guess
``c = P(accepted | parent accepted) = exp(score - parent's score)``. Parts are calibrated against what
the verifier accepts: a per-part factor ``f = (accepted + 1) / (guessed + 1)`` (decayed sums over the
children of accepted nodes, the nodes whose outcome is observed whatever the engine cut), so the
EAGLE head's overconfident log-probabilities and a suffix index's frequencies end up on one scale. A
node's value is its parent's value times ``max over its parts of min(1, f * c)``: never above its
parent's, so keeping the ``budget`` best (ties: lower index, parents come first) is closed under
ancestors. The value's log is the merged tree's ``scores``, which the adaptive policy calibrates and
cuts again like any drafter's.

Lossless. Greedy requests: any set of paths is. Sampled requests: sampled siblings must be the first
draws of one draft distribution, each carrying q given its earlier siblings (`verify/tree.py`). So a
sampled request takes the sampled nodes of ONE part that samples (the first listed) and the
deterministic proposals of the one-hot parts (n-gram, suffix) — never a second sampling part's. The
sampling part's nodes come first among their siblings; a deterministic proposal equal to a sampled
sibling merges into it (a deterministic proposal's presence may depend on earlier draws; its q, one-hot,
stays exactly the distribution it was proposed from), else it is appended with a one-hot q. Values are
monotone in sibling rank for a sampling part (its scores depend on rank only), so the cut keeps a
sampled node's earlier siblings.

Stats: the merged tree names each node's part(s) (`DraftTree.sources`), and a request's ``spec`` stats
count accepted tokens by drafter (``accepted_by_drafter``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.drafters.base import (CommitInfo, DraftRequest, Drafter, TargetInfo, check_int_option, create_drafter,
                                     parse_drafter_spec, register)
from specserve.speculation.node_values import fallback_scores, own_terms, path_products
from specserve.verify import DraftTree, VerifyResult

# The costly parts draft for a request when the cheap parts' tree expects fewer accepted tokens than this:
# SuffixDecoding's hybrid rule (use the suffix tree when its match is strong, else the model drafter).
DEFAULT_FALLBACK_BELOW = 2.0
# Calibration memory: sums decay by this per observed node (about the last 500 observations count).
CALIBRATION_DECAY = 0.998
MIN_VALUE = 1e-9


@dataclass
class _Proposal:
    """The merged tree last proposed for a request, for calibration when its outcome comes back.

    tokens/parents: the merged tree before the cut (its nodes carry every part's guesses); guesses:
    float[N, P] each part's conditional guess (0 where the part did not propose the node).
    """

    tokens: np.ndarray
    parents: np.ndarray
    guesses: np.ndarray


@register("hybrid")
class HybridDrafter(Drafter):
    """Several drafters' trees merged per request (see the module docstring).

    Options:
      max_budget:    most nodes per merged tree, >= 1 (default: the sum of the parts' own).
      fallback_below: the costly parts (those that run a model per level or catch up on the context:
                     EAGLE, a draft model) draft for a request only when the cheap parts' merged tree
                     (n-gram, suffix) expects fewer accepted tokens than this, >= 0 (default 2.0;
                     0: cheap parts alone; a large value: every part, every step).
      part_options:  {part name: that part's options}, e.g. ``{"suffix": {"shared_tokens": 0}}`` for a suffix
                     part that matches within each request only (default: every part with its defaults).
    """

    def __init__(self, target: TargetInfo, path: str | None = None, *, max_budget: int | None = None,
                 fallback_below: float = DEFAULT_FALLBACK_BELOW, part_options: dict | None = None) -> None:
        if not path:
            raise ValueError("the hybrid drafter needs its parts: 'hybrid:suffix+eagle' (drafter specs joined by '+')")
        specs = [spec.strip() for spec in path.split("+")]
        names = [parse_drafter_spec(spec)[0] for spec in specs]
        if len(specs) < 2:
            raise ValueError(f"a hybrid drafter merges two or more drafters, got {path!r}")
        if len(set(names)) != len(names) or "hybrid" in names:
            raise ValueError(f"hybrid drafter parts must be distinct drafters other than hybrid, got {names}")
        part_options = {} if part_options is None else part_options
        if not isinstance(part_options, dict) or not all(isinstance(v, dict) for v in part_options.values()):
            raise ValueError(f"hybrid drafter option part_options must map part names to option objects, got {part_options!r}")
        strangers = sorted(set(part_options) - set(names))
        if strangers:
            raise ValueError(f"hybrid drafter option part_options names {strangers}, which are not parts of {names}")
        self.parts: list[Drafter] = [create_drafter(spec, target, part_options.get(name)) for spec, name in zip(specs, names)]
        self.part_names = tuple(names)
        parts = self.parts
        self.needs_hidden_states = any(p.needs_hidden_states for p in parts)
        self.hidden_layers = tuple(sorted({layer for p in parts if p.needs_hidden_states for layer in p.hidden_layers}))
        self.gives_probs = any(p.gives_probs for p in parts)
        # Costly: parts with a model of their own that catch up on the context and run a forward per level (EAGLE,
        # a draft model). Medusa's heads also draft by level, but a level is one small product: a cheap part, as
        # it was before it drafted by level (as a fallback only, the suffix+medusa hybrid fell from 1.19x to 1.11x).
        costly = [p.catches_up for p in parts]
        # With a cheap part, the hybrid itself decides when its costly parts run (fallback_below) and they
        # draft at their own depth: to the budget policy it is a whole-tree drafter whose measured cost
        # averages the steps that ran them and those that did not. Costly parts alone: theirs.
        only_costly = all(costly)
        self.catches_up = only_costly and any(p.catches_up for p in parts)
        self.drafts_by_level = only_costly and any(p.drafts_by_level for p in parts)
        self.wants_row_argmax = any(p.wants_row_argmax for p in parts)
        self.learns_across_requests = any(p.learns_across_requests for p in parts)
        self.depth = max(p.depth for p in parts)
        full = sum(p.max_budget for p in parts)
        self.max_budget = full if max_budget is None else min(check_int_option("hybrid", "max_budget", max_budget, 1), full)
        self.kv_slots_past_root = max(p.kv_slots_past_root for p in parts)
        if isinstance(fallback_below, bool) or not isinstance(fallback_below, (int, float)) or not fallback_below >= 0:
            raise ValueError(f"hybrid drafter option fallback_below must be a number >= 0, got {fallback_below!r}")
        self.fallback_below = float(fallback_below)
        self._costly = costly
        # A node's `sources` by the bitmask of the parts that proposed it.
        self._source_names = ["+".join(n for k, n in enumerate(names) if bits >> k & 1) for bits in range(1 << len(names))]
        self._guessed = np.zeros(len(parts))
        self._accepted = np.zeros(len(parts))
        self._last: dict[str, _Proposal] = {}

    # ---- the protocol: forwarded to every part ---------------------------------------------------

    def kv_bytes_per_slot(self) -> int:
        return sum(p.kv_bytes_per_slot() for p in self.parts)

    def attach_kv(self, allocator) -> None:
        for p in self.parts:
            p.attach_kv(allocator)

    @property
    def kv_lookahead(self) -> int:
        return max(p.kv_lookahead for p in self.parts)

    def cached_prefix_len(self, request_id: str) -> int:
        """The least of the parts that keep KV (a costly part that sat a request out lags behind)."""
        kept = [p.cached_prefix_len(request_id) for p in self.parts if p.kv_bytes_per_slot() > 0]
        return min(kept) if kept else 0

    def catch_up(self, requests: list[DraftRequest]) -> None:
        for p in self.parts:  # parts that keep no KV do nothing
            p.catch_up(requests)

    def start_from_prefix(self, request_id: str, num_tokens: int) -> None:
        for p in self.parts:
            p.start_from_prefix(request_id, num_tokens)

    def release(self, request_id: str) -> None:
        self._last.pop(request_id, None)
        for p in self.parts:
            p.release(request_id)

    def forget_shared(self) -> None:
        for p in self.parts:
            p.forget_shared()

    def describe(self) -> dict:
        out = super().describe()
        out["parts"] = {name: part.describe() for name, part in zip(self.part_names, self.parts)}
        out["calibration_factors"] = dict(zip(self.part_names, np.round(self.factors, 3).tolist()))
        return out

    @property
    def factors(self) -> np.ndarray:
        """float[P]: each part's calibration factor (accepted / guessed, with one of each as a prior)."""
        return (self._accepted + 1.0) / (self._guessed + 1.0)

    # ---- drafting -------------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest], budgets: list[int], depth: int | None = None) -> list[DraftTree]:
        budgets = [int(b) for b in budgets]
        chosen = [[r.parts is None or name in r.parts for name in self.part_names] for r in requests]  # [A][P]
        # A sampled request's sampled nodes come from ONE part: the first sampling part it uses.
        samplers = [next((k for k, p in enumerate(self.parts) if p.gives_probs and use[k]), None) if r.temperature > 0
                    else None for r, use in zip(requests, chosen)]
        factors = self.factors
        part_trees: list[list[DraftTree] | None] = [None] * len(self.parts)
        # Cheap parts first: where their tree is already good enough, the costly parts sit the request out.
        # (Without a costly part the second round has nothing to decide: the merge is not priced twice.)
        for costly_round in (False, True) if any(self._costly) else (False,):
            if costly_round:
                empty = [DraftTree.empty()] * len(self.parts)
                for i, r in enumerate(requests):
                    trees = [part_trees[k][i] if part_trees[k] is not None else empty[k] for k in range(len(self.parts))]
                    expected = self._merge(trees, r.temperature > 0, samplers[i], factors, budgets[i])[2]
                    if expected >= self.fallback_below:
                        chosen[i] = [use and not costly for use, costly in zip(chosen[i], self._costly)]
            for k, part in enumerate(self.parts):
                if self._costly[k] != costly_round:
                    continue
                # A part that sits a request out (not chosen; a second sampling part for a sampled request;
                # a costly part where the cheap ones suffice) still sees it, with budget 0: it may have
                # features to queue.
                sits_out = [not use[k] or (r.temperature > 0 and part.gives_probs and k != sampler)
                            for r, use, sampler in zip(requests, chosen, samplers)]
                part_budgets = [0 if out else min(b, part.max_budget) for b, out in zip(budgets, sits_out)]
                # The policy's depth caps drafting cost: it binds parts that pay per level (EAGLE, a draft
                # model); parts that draft whole trees at once give theirs, and the cut prices its rows.
                part_trees[k] = part.propose(requests, part_budgets, depth if part.drafts_by_level else None)
        out = []
        for i, req in enumerate(requests):
            trees = [part_trees[k][i] for k in range(len(self.parts))]
            merged, proposal, _ = self._merge(trees, req.temperature > 0, samplers[i], factors, budgets[i])
            if proposal is not None:
                self._last[req.request_id] = proposal
            out.append(merged)
        return out

    def _merge(self, trees: list[DraftTree], sampled: bool, sampler: int | None, factors: np.ndarray,
               budget: int) -> tuple[DraftTree, _Proposal | None, float]:
        """One request's part trees → the merged tree cut to ``budget`` nodes, what calibration needs, and
        the tree's expected accepted tokens (the sum of its nodes' values).
        sampler: the part whose sampled nodes a sampled request takes (they come first among siblings)."""
        order = list(range(len(trees)))
        if sampler is not None:
            order.remove(sampler)
            order.insert(0, sampler)
        tokens: list[int] = []
        parents: list[int] = []
        guesses = np.zeros((sum(tree.num_nodes for tree in trees), len(trees)))  # [at most every node, P]
        q_rows: list[tuple[np.ndarray, np.ndarray] | None] = []
        index: dict[tuple[int, int], int] = {}
        for k in order:
            tree = trees[k]
            if not tree.num_nodes:
                continue
            cond = _conditional_guesses(tree)
            q = tree.compact_q if sampled else None
            local = np.empty(tree.num_nodes, dtype=np.int64)
            for n, (tok, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
                parent = -1 if par < 0 else int(local[par])
                key = (parent, tok)
                node = index.get(key)
                if node is None:
                    node = index[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(parent)
                    q_rows.append(None if q is None else (q[0][n].cpu().numpy(), q[1][n].float().cpu().numpy()))
                guesses[node, k] = max(guesses[node, k], cond[n])
                local[n] = node
        if not tokens:
            return DraftTree.empty(), None, 0.0
        tok_arr, par_arr = np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64)
        guess_arr = guesses[:len(tokens)]  # [N, P]
        # Each node's own guess: the best calibrated part's; its value: the product down its path.
        own = np.maximum(np.max(np.minimum(1.0, guess_arr * factors), axis=1), MIN_VALUE)
        if all(row is None for row in q_rows):
            values = path_products(own, par_arr)
        else:
            values = np.empty(len(tokens))
            last_sampled: dict[int, float] = {}  # parent -> value of its latest sampled child
            for n, par in enumerate(parents):  # parents come first, siblings in order
                values[n] = own[n] * (values[par] if par >= 0 else 1.0)
                if q_rows[n] is not None:  # a sampled node never outranks an earlier sampled sibling
                    values[n] = last_sampled[par] = min(values[n], last_sampled.get(par, np.inf))
        keep = np.sort(np.argsort(-values, kind="stable")[:budget])  # the best; ties: the lower index
        proposed_by = (guess_arr[keep] > 0) @ (1 << np.arange(len(trees)))  # int[K]: a bit per part
        sources = tuple(self._source_names[b] for b in proposed_by.tolist())
        q_ids = q_probs = None
        if sampled and any(row is not None for row in q_rows):
            width = max(len(row[0]) for row in q_rows if row is not None)
            q_ids = np.full((len(keep), width), -1, dtype=np.int64)
            q_probs = np.zeros((len(keep), width), dtype=np.float32)
            for j, n in enumerate(keep):
                if q_rows[n] is None:  # a deterministic proposal: one-hot q
                    q_ids[j, 0], q_probs[j, 0] = tokens[n], 1.0
                else:
                    q_ids[j, :len(q_rows[n][0])], q_probs[j, :len(q_rows[n][1])] = q_rows[n]
        remap = np.full(len(tokens), -1, dtype=np.int64)
        remap[keep] = np.arange(len(keep))
        kept_parents = np.where(par_arr[keep] >= 0, remap[np.maximum(par_arr[keep], 0)], -1)
        tree = DraftTree(torch.from_numpy(tok_arr[keep]), torch.from_numpy(kept_parents),
                         q_ids=None if q_ids is None else torch.from_numpy(q_ids),
                         q_probs=None if q_probs is None else torch.from_numpy(q_probs),
                         scores=torch.from_numpy(np.log(values[keep]).astype(np.float32)), sources=sources)
        return tree, _Proposal(tok_arr, par_arr, guess_arr), float(values[keep].sum())

    # ---- commits: calibration, and each part's own view of what was kept -------------------------

    def on_commit(self, commits: list[CommitInfo]) -> None:
        for c in commits:
            proposal = self._last.pop(c.request_id, None)
            if proposal is not None:
                self._calibrate(proposal, c.result)
        for part in self.parts:
            part.on_commit(commits)

    def _calibrate(self, proposal: _Proposal, result: VerifyResult) -> None:
        """Score each part's guesses on the children of the accepted path's nodes (root included): the
        nodes whose fate is known. The walk follows tokens, so the engine's own cut does not matter."""
        children: dict[int, list[int]] = {}
        for n, par in enumerate(proposal.parents.tolist()):
            children.setdefault(par, []).append(n)
        parent = -1
        accepted_tokens = list(result.accepted_tokens)
        for depth in range(len(accepted_tokens) + 1):
            level = children.get(parent, [])
            if not level:
                break
            nxt = accepted_tokens[depth] if depth < len(accepted_tokens) else None
            hit = next((n for n in level if int(proposal.tokens[n]) == nxt), None)
            guesses = proposal.guesses[level]  # [siblings, P]
            self._guessed *= CALIBRATION_DECAY ** len(level)
            self._accepted *= CALIBRATION_DECAY ** len(level)
            self._guessed += guesses.sum(axis=0)
            if hit is not None:
                self._accepted += proposal.guesses[hit] > 0
            if hit is None:
                break
            parent = hit


def _conditional_guesses(tree: DraftTree) -> np.ndarray:
    """float[N]: a part's guess that each node is accepted given its parent was, from its scores, or from its
    shape where it has none. A flat guess for every node of a scoreless tree (0.5, before) made a sampled
    request's Medusa draws tie with one another in the merged tree, so the policy's value model pooled the
    first draw (a one-node tree accepted 0.39 of the time at temperature 1 on the default model) with its later
    siblings and priced every draw alike (BENCHMARKS.md, "Temperature 1: the hybrid ranks a sampled request's
    draws")."""
    parents = tree.parents.numpy()
    scores = fallback_scores(parents) if tree.scores is None else tree.scores.float().cpu().numpy()
    return np.clip(np.exp(own_terms(scores.astype(np.float64), parents)), MIN_VALUE, 1.0)

