"""The adaptive budget policy: each step, draft and verify what maximises the batch's tokens per second.

Model (all measured on this machine, see `cost_model` and `node_values`):

    tokens(step)  = decodes + Σ over verified nodes of value(node)        (value = P(node accepted))
    seconds(step) = overhead + draft_cost(depth, drafting requests, backlog) + verify_cost(rows, requests)
                    + tree_cost × trees verified

**Plan** (before drafting): for every depth L = 0 (plain decoding) .. the drafter's depth, predict
each request's nodes from its previous tree (calibrated values × the request's own accuracy factor;
a new request borrows the latest tree of any request), cut them as below, and keep the L with the most
tokens per second. Requests that would verify nothing do not draft (budget 0); now and then such a
request is probed with a small budget, so text that turns predictable gets speculation back.

**Cut** (after drafting): all drafted nodes of the batch, best value first, are added while the step's
tokens per second still grows — a node's marginal tokens against the marginal verify rows it costs, the
drafting already paid. Values never grow from parent to child and ties go to the lower node index, so
each request keeps an ancestor-closed tree whose sampled siblings are a prefix of the draws. Which nodes
are kept depends on scores (for sampled requests, sibling ranks only) and on past steps, never on the
values this step drew: the policy changes how much is verified, never what is emitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from specserve.budget import DraftPlan, StepRecord
from specserve.request import Request
from specserve.speculation.cut import best_cut
from specserve.speculation.cost_model import DraftCost, VerifyCost, calibrate_tree_cost, calibrate_verify_cost
from specserve.speculation.node_values import NodeValueModel, fallback_scores, own_terms, path_products
from specserve.verify import DraftTree

# A request not drafting is probed after at least PROBE_FIRST steps, and only once the time it spent
# decoding plainly since its last probe is PROBE_SHARE⁻¹ times what the probe is predicted to cost (a
# probe pays the drafter's catch-up over everything committed since it last drafted — the whole prompt
# the first time): probing costs at most ~1.5 % of a plain-decoding request's time. Each probe that does
# not bring speculation back doubles the minimum wait, up to PROBE_MAX. A probe drafts the drafter's
# whole tree (so the next plan prices the long chains a predictable text offers, not just the nodes
# verified) and verifies the cut of it, at least its PROBE_NODES best nodes (so it always learns).
PROBE_FIRST = 32
PROBE_MAX = 128
PROBE_NODES = 2
PROBE_SHARE = 0.015
NO_LIMIT_HORIZON = 256  # a request without max_tokens is priced as this long for its first probe
# The full plan (every depth priced) runs every REPLAN steps or when a request without a decision
# arrives; in between the last decision stands (the cut still adapts every drafting step). Pricing
# every depth each step cost ~0.3 ms — 15 % of a plain step on the embedded model.
REPLAN = 8
# ... and every REPLAN_PLAIN steps after a plan that found speculation clearly losing (its best rate
# under CLEAR_LOSS × plain decoding's): the common case on a CPU, where each full plan (~1 ms on two
# cores) would otherwise cost a few percent of plain decoding.
REPLAN_PLAIN = 32
CLEAR_LOSS = 0.9
# A plan drafts for sampled requests only where it predicts a clear gain: their acceptance is a draw per node, and a
# plan that drafts when a request's last trees looked good is chosen on its own optimism (at temperature 1 on the
# default model, traced over 12 chat answers: plans that drafted predicted 0.70 accepted tokens a step and got 0.52,
# for a predicted gain of ~1 % over plain decoding and a realised loss of 14 % a step; probes, which are not chosen
# on their prediction, predicted 0.46 and got 0.67). The plan's best speculative rate must beat plain decoding's by
# this share, weighted by the batch's share of sampled requests (greedy requests: no margin).
SAMPLED_MARGIN = 0.10
# A request's accuracy factor scales its calibrated conditional rates; each verified tree moves it by
# FACTOR_RATE × the relative error of its prediction (accepted vs predicted tokens), within FACTOR_RANGE.
FACTOR_RATE = 0.2
FACTOR_RANGE = (0.1, 4.0)
# A request that resumes drafting first pays its drafter's catch-up over everything committed since it
# last drafted (its backlog); the plan spreads that over this many steps of drafting, so short pauses
# are cheap to end and a long-idle request resumes only for a clear gain (hysteresis, measured).
AMORTIZE_STEPS = 4
# A plan predicts a request's next tree from its trees since the previous plan (their expected best-k
# values, k = 1, 2, ...): from the last tree alone, an n-gram or suffix request whose latest step found
# no match was switched to plain decoding for the rest of an answer that kept paying 1.5 tokens a step.
TREE_HISTORY = REPLAN
# The per-tree overhead is calibrated on a chain this long.
TREE_CALIBRATION_NODES = 8
# A drafter that drafts whole trees (n-gram, suffix) and whose measured drafting costs at most this share
# of a plain step is nearly free: every request drafts every step and the cut alone decides what is
# verified (an empty or fully cut tree costs nothing more). Deciding per request instead turned such a
# drafter off after the first empty trees of a cold start, until a probe 64 steps later (BENCHMARKS.md,
# "Plain decoding at one and two threads": τ 1.02 where static drafting gave 5.08).
NEARLY_FREE_SHARE = 0.02


class _DraftedTree(NamedTuple):
    """A drafted tree as the plan prices the next: before any request's accuracy factor."""

    conditional: np.ndarray  # float64[N] each node's calibrated P(accepted | its parent accepted)
    parents: np.ndarray  # int64[N]
    depths: np.ndarray  # int64[N]
    drafted: int  # the depth the step drafted to (its plan's, or one more when exploring)

    @staticmethod
    def empty(drafted: int) -> "_DraftedTree":
        """A step where the drafter found nothing."""
        return _DraftedTree(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), drafted)


@dataclass
class _RequestState:
    # Its latest TREE_HISTORY drafted trees (empty ones included: a step where the drafter found nothing is
    # evidence too).
    trees: deque = field(default_factory=lambda: deque(maxlen=TREE_HISTORY))
    sampled: bool = False  # temperature > 0
    factor: float = 1.0
    idle: int = 0
    # A new request's first plain step probes when its expected length covers the probe (PROBE_SHARE of
    # it, see `_probe_pays`), so it is judged on a tree of its own: a request that only borrowed the
    # latest tree of another (a prompt with nothing to copy) never drafted in 64 tokens on an editing
    # workload where its own text paid 2.6 tokens a step.
    fresh: bool = True
    horizon: int = 0  # tokens it may still generate (its max_tokens, or NO_LIMIT_HORIZON)
    backlog: int | None = None  # tokens committed since its drafter last drafted (None: never seen)
    probe_every: int = PROBE_FIRST
    probing: bool = False
    decided: bool = False  # has a full plan included or excluded it yet
    drafting: bool = False  # the last full plan's decision
    pending: tuple | None = None  # (own terms, parents, sampled, predicted) of the nodes verified this step


@dataclass
class AdaptiveBudget:
    """max_budget / max_depth: the drafter's own caps (upper bounds here). verify_cost: calibrated by
    the engine at start (`specserve.speculation.cost_model.calibrate_verify_cost`)."""

    max_budget: int
    max_depth: int
    # The drafter drafts its whole tree at once (n-gram, suffix, Medusa): depth costs it nothing, so it
    # is always asked for all of it and the cut alone sizes the tree. Otherwise (level drafters) the
    # plan chooses a depth.
    whole_trees: bool = False
    verify_cost: VerifyCost | None = None
    draft_cost: DraftCost = field(default_factory=DraftCost)
    node_values: NodeValueModel = field(default_factory=NodeValueModel)
    overhead_s: float = 0.0  # per-step time outside drafting and verify (scheduling, commit, streaming)
    # What a verified tree costs beyond its rows: the tree-masked attention, packing, tree acceptance
    # instead of a plain argmax. Calibrated at start, warm (`calibrate_tree_cost`).
    tree_s: float = 0.0

    wants_calibration = True

    def __post_init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        # The latest drafted tree of any greedy (False) / sampled (True) request: what a request that has
        # not drafted yet is predicted to get. Kept per kind: acceptance differs a lot between them, and a
        # sampled request that borrowed a greedy request's tree drafted where it could not pay.
        self._typical: dict[bool, _DraftedTree] = {}
        self._depth = 0  # this step's plan depth
        self._plan_depth = 0  # the last full plan's depth
        self._since_plan = REPLAN
        self._replan_every = REPLAN

    def calibrate(self, time_forward, max_rows: int, time_tree=None) -> None:
        """Measure the target forward at a few row counts (the engine's `time_forward(rows) -> s`) and,
        given `time_tree(nodes) -> s` (a verify step of one chain of draft nodes), what a tree adds."""
        self.verify_cost = calibrate_verify_cost(time_forward, max_rows)
        if time_tree is not None:
            nodes = min(self.max_budget, TREE_CALIBRATION_NODES, max_rows - 1)
            self.tree_s = calibrate_tree_cost(time_forward, time_tree, nodes)

    # ---- before drafting ------------------------------------------------------------------------

    def plan(self, requests: list[Request], fixed_rows: int) -> DraftPlan:
        if not requests or self.max_budget <= 0:
            self._depth = 0
            return DraftPlan([0] * len(requests), 0)
        states = [self._state(r.request_id) for r in requests]
        for s, r in zip(states, requests):
            if s.backlog is None:
                s.backlog = len(r.token_ids)
                s.sampled = r.params.temperature > 0
                s.horizon = r.params.max_tokens or NO_LIMIT_HORIZON
        plain_shape = fixed_rows == len(requests)
        if self.verify_cost is None or not self._typical:
            if not plain_shape:  # explore in a decode-only step, where what is measured is typical
                self._depth = 0
                return DraftPlan([0] * len(requests), 0)
            self._depth = self.max_depth  # nothing known yet: draft fully and measure
            return DraftPlan([self.max_budget] * len(requests), self.max_depth)
        self._since_plan += 1
        # Steps with prompt chunks are not planned: their forward is big and short-lived, a decision
        # made there would not describe the steps after it, and planning every such step (a whole
        # batch arriving prefills for dozens of steps) cost several percent at batch 64. Requests keep
        # the last decode-only step's decision; new ones decode plainly until one is made.
        if not plain_shape:
            drafting = [s.decided and s.drafting for s in states]
            return self._budgets(states, drafting, self._plan_depth, fixed_rows, probes=False)
        if self._since_plan < self._replan_every and all(s.decided for s in states):
            drafting = [s.drafting for s in states]
            return self._budgets(states, drafting, self._plan_depth, fixed_rows)
        self._since_plan = 0
        histories = [self._predicted(s) for s in states]
        backlogs = np.array([s.backlog for s in states], dtype=np.float64) / AMORTIZE_STEPS
        plain_rate = len(requests) / self._seconds(0.0, fixed_rows, len(requests))
        best_depth, best_rate, best_kept, best_spec_rate = 0, plain_rate, None, 0.0
        needed = plain_rate * (1.0 + SAMPLED_MARGIN * sum(s.sampled for s in states) / len(states))
        for depth in [self.max_depth] if self.whole_trees else range(1, self.max_depth + 1):
            values = [_expected_best(history, depth) for history in histories]
            has = np.array([len(v) > 0 for v in values])
            cost = self.draft_cost(depth, int(has.sum()), backlogs[has].sum())
            kept, rate = self._best_cut(values, fixed_rows, cost)
            keeps = kept > 0
            if 0 < keeps.sum() < has.sum():  # only those that keep nodes draft: re-price with fewer
                cost = self.draft_cost(depth, int(keeps.sum()), backlogs[keeps].sum())
                kept, rate = self._best_cut(values, fixed_rows, cost)
            best_spec_rate = max(best_spec_rate, rate if keeps.any() else 0.0)
            if rate > best_rate and rate > needed:
                best_depth, best_rate, best_kept = depth, rate, kept
        drafting = [best_kept is not None and best_kept[i] > 0 for i in range(len(states))]
        if self._nearly_free(len(states), fixed_rows):
            drafting, best_depth = [True] * len(states), self.max_depth
        for s, d in zip(states, drafting):
            s.decided, s.drafting = True, d
        self._plan_depth = best_depth
        self._replan_every = REPLAN_PLAIN if best_depth == 0 and best_spec_rate < CLEAR_LOSS * plain_rate else REPLAN
        return self._budgets(states, drafting, best_depth, fixed_rows)

    def _budgets(self, states: list[_RequestState], drafting: list[bool], depth: int, fixed_rows: int,
                 probes: bool = True) -> DraftPlan:
        """The plan's budgets: drafting requests get the drafter's whole candidate tree (the cut keeps
        what pays); the others decode plainly, except a probe now and then (not in prefill steps)."""
        budgets = []
        for s, d in zip(states, drafting):
            s.probing = False
            if d:
                s.idle, s.probe_every, s.fresh = 0, PROBE_FIRST, False
                budgets.append(self.max_budget)
                continue
            s.idle += 1
            # A new request's first chance is priced against the steps it may still run, later ones against
            # the plain steps since its last probe — every 8th step only: it is the common plain path.
            due, steps = (True, s.horizon) if s.fresh else (s.idle >= s.probe_every and s.idle % 8 == 0, s.idle)
            pays = probes and due and self._probe_pays(s, steps, fixed_rows, len(states))
            if probes and due:
                s.fresh = False
            if pays:
                s.idle, s.probe_every, s.probing = 0, min(2 * s.probe_every, PROBE_MAX), True
                # The trees it drafted before decoding plainly describe text it has since left: the next plan
                # judges it on what the probe drafts (with them, seven stale trees outvoted the probe's one,
                # and a request stopped by a hard passage stayed plain for the rest of its answer).
                s.trees.clear()
                self._since_plan = self._replan_every  # the next step plans with what the probe drafted
                budgets.append(self.max_budget)
            else:
                budgets.append(0)
        if depth == 0 and any(budgets):
            depth = self.max_depth  # probes alone: their whole trees
        elif 0 < depth < self.max_depth and self._since_plan == self._replan_every - 1:
            # Explore: the step before a full plan drafts one level deeper than planned, so the plan
            # prices that level from a tree actually drafted (a plan sees only the depths its last
            # trees had; without this a depth, once lowered, never grew back). The cut still keeps
            # only what pays; the cost is one drafter level every REPLAN steps.
            depth += 1
        self._depth = depth
        return DraftPlan(budgets, depth)

    def _nearly_free(self, requests: int, fixed_rows: int) -> bool:
        """Whether drafting for every request costs at most NEARLY_FREE_SHARE of a plain step (whole-tree
        drafters only: a level drafter's empty levels still cost a forward each)."""
        plain_s = self._seconds(0.0, fixed_rows, requests)
        return self.whole_trees and self.draft_cost(self.max_depth, requests, 0) <= NEARLY_FREE_SHARE * plain_s

    def _probe_pays(self, state: _RequestState, steps: int, fixed_rows: int, requests: int) -> bool:
        """Whether this request's share of `steps` plain steps covers a probe's predicted cost (the whole
        batch waits for a probe: with n requests each probing, the probes' share of the time stays under
        PROBE_SHARE when each waits n times longer than it would alone)."""
        cost = self.draft_cost(self.max_depth, 1, state.backlog or 0) + self.tree_s
        cost += self.verify_cost.curve(fixed_rows + PROBE_NODES) - self.verify_cost.curve(fixed_rows)
        return steps * self._seconds(0.0, fixed_rows, requests) / requests * PROBE_SHARE >= cost

    # ---- after drafting -------------------------------------------------------------------------

    def cut(self, requests: list[Request], trees: list[DraftTree], budgets: list[int], fixed_rows: int,
            draft_s: float) -> tuple[list[DraftTree], list[float | None]]:
        if not any(budgets):  # a plain step (the common case when speculation does not pay): keep it lean
            return trees, [None] * len(trees)
        values, terms_of = [], []
        for r, tree, budget in zip(requests, trees, budgets):
            if not budget or not tree.num_nodes:
                if budget:
                    self._state(r.request_id).trees.append(_DraftedTree.empty(self._depth))
                values.append(np.zeros(0))
                terms_of.append(None)
                continue
            depths, parents = tree.depths.numpy(), tree.parents.numpy()
            scores = tree.scores.numpy() if tree.scores is not None else fallback_scores(parents)
            terms = own_terms(scores, parents)
            conditional = self.node_values.conditional(terms, r.params.temperature > 0)
            state = self._state(r.request_id)
            latest = self._typical[r.params.temperature > 0] = _DraftedTree(conditional, parents, depths, self._depth)
            state.trees.append(latest)
            # No cut by depth here: the plan's depth caps what level drafters spend drafting (they honour
            # it), and nodes past it that cost no drafting (a hybrid's suffix part) are priced by rows below.
            v = _factored(latest, state.factor)
            values.append(v)
            terms_of.append(terms)
        if self.verify_cost is None:
            kept = np.array([int((v >= 0).sum()) for v in values])
        else:
            kept, _ = self._best_cut([v[v >= 0] for v in values], fixed_rows, draft_s)
        out, predictions = [], []
        for i, (r, tree) in enumerate(zip(requests, trees)):
            v = values[i]
            state = self._requests.get(r.request_id)
            if terms_of[i] is None:
                out.append(tree)
                predictions.append(None)
                if state is not None:
                    state.pending = None
                continue
            k = int(kept[i])
            if state.probing:
                k = max(k, min(PROBE_NODES, int((v >= 0).sum())))  # or it might learn nothing
            if not k:
                out.append(DraftTree.empty())
                predictions.append(None)
                state.pending = None
                continue
            keep = np.sort(_top(v, k))
            kept_tree = tree.subtree(keep)
            predicted = float(v[keep].sum())
            out.append(kept_tree)
            predictions.append(predicted)
            # (a kept node's own term is unchanged: the cut is ancestor-closed, its parent kept too)
            state.pending = (terms_of[i][keep], kept_tree.parents.numpy(), r.params.temperature > 0, predicted)
        return out, predictions

    def _best_cut(self, values: list[np.ndarray], fixed_rows: int, fixed_s: float) -> tuple[np.ndarray, float]:
        """Nodes kept per request and the tokens per second of the best cut. values: per request, its
        candidate nodes' values (any order). Nodes are taken best first across requests (`cut.best_cut`)."""
        counts = [len(v) for v in values]
        total = sum(counts)
        if not total:
            return np.zeros(len(values), dtype=np.int64), len(values) / self._seconds(fixed_s, fixed_rows, len(values))
        flat = np.concatenate(values).astype(np.float64, copy=False)
        owner = np.repeat(np.arange(len(values), dtype=np.int64), counts)
        seconds = self.verify_cost(fixed_rows + np.arange(total + 1), len(values))
        return best_cut(flat, owner, len(values), seconds, self.overhead_s + fixed_s, self.tree_s)

    def _seconds(self, fixed_s: float, rows: int, requests: int) -> float:
        return self.overhead_s + fixed_s + self.verify_cost(rows, requests)

    # ---- learning -------------------------------------------------------------------------------

    def observe(self, record: StepRecord) -> None:
        trees = sum(rec.drafted > 0 for rec in record.requests)
        sequences = max(len(record.requests), 1)
        # (A step with prompt chunks beside several decodes teaches nothing either: its rows are mostly prompt,
        # whose cost is the curve's far end, not what the decodes' sequences add.)
        if (self.verify_cost is not None and record.num_tokens and not (trees and self._probes_only(record))
                and not (record.num_prefill_tokens and sequences > 1)):
            # Every step teaches the row cost at its rows, a drafting step net of its trees' calibrated
            # overhead: calibration alone was off by up to 0.5 ms at the row counts only trees reach
            # (7 rows at batch 1), and learning a per-tree overhead from what steps took beyond the
            # row model instead folded that error into every tree, whatever its size. Steps whose only
            # trees were probes teach nothing: a probe is a lone tree step amid plain ones and runs
            # the tree path cold (1-2 ms more than in steady drafting, measured).
            self.verify_cost.observe(record.num_tokens, record.verify_s - trees * self.tree_s, sequences)
        drafted = {rec.request_id for rec in record.requests if rec.budget > 0}
        if drafted:  # probes too: the backlog term carries their catch-up
            backlog = sum(self._requests[i].backlog or 0 for i in drafted if i in self._requests)
            self.draft_cost.observe(record.draft_depth, len(drafted), backlog, record.draft_s)
        if record.step_s and not trees:
            other = max(record.step_s - record.draft_s - record.verify_s, 0.0)
            self.overhead_s += 0.05 * (other - self.overhead_s)
        for rec in record.requests:
            state = self._requests.get(rec.request_id)
            if state is None:
                continue
            if state.backlog is not None:
                fed = rec.request_id in drafted or rec.caught_up  # its drafter is current up to this step's root
                state.backlog = rec.accepted + 1 + (0 if fed else state.backlog)
            if state.pending is None:
                continue
            terms, parents, sampled, predicted = state.pending
            state.pending = None
            accepted = np.zeros(len(terms), dtype=bool)
            accepted[list(rec.accepted_nodes)] = True
            self.node_values.observe(terms, parents, accepted, sampled)
            # Multiplicative, so the factor settles where predictions made with it match what is accepted.
            step = FACTOR_RATE * (rec.accepted - predicted) / max(predicted, 1.0)
            state.factor = min(max(state.factor * (1.0 + step), FACTOR_RANGE[0]), FACTOR_RANGE[1])

    def _probes_only(self, record: StepRecord) -> bool:
        """Whether every tree verified in this step was a probe."""
        states = [self._requests.get(rec.request_id) for rec in record.requests if rec.drafted > 0]
        return all(s is not None and s.probing for s in states)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---- helpers --------------------------------------------------------------------------------

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState()
        return state

    def _predicted(self, state: _RequestState) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """(node values, depths, drafted depth) of this request's recent trees under its factor (a request
        that has drafted none borrows the latest tree of a request of its kind)."""
        trees = state.trees or [self._typical.get(state.sampled) or next(iter(self._typical.values()))]
        return [(_factored(tree, state.factor), tree.depths, tree.drafted) for tree in trees]


def _expected_best(history: list[tuple[np.ndarray, np.ndarray, int]], depth: int) -> np.ndarray:
    """Expected values of a request's next tree, best first, cut to `depth`: element k is the mean over
    its recent trees of their (k+1)-th best node value (0 where a tree had fewer nodes). Keeping the k
    best is ancestor-closed in every tree, so a cut of k here prices a real cut of each.

    Only trees drafted at least `depth` deep price it (all of them when none was): a tree the plan kept to
    fewer levels says nothing about the deeper ones, and counting its missing nodes as worthless priced a
    level at the share of steps that explored it — a level drafter's depth, once lowered, stayed low (Medusa
    heads that read their parent's token: plans of depth 3 priced its nodes at ~0.02 where they were
    accepted 0.2-0.4 of the time)."""
    priced = [(v, d, drafted) for v, d, drafted in history if drafted >= depth] or history
    best = [np.sort(v[d <= depth])[::-1] for v, d, _ in priced]
    out = np.zeros(max(len(b) for b in best))
    for b in best:
        out[:len(b)] += b
    return out / len(best)


def _factored(tree: _DraftedTree, factor: float) -> np.ndarray:
    """Node values of a drafted tree under a request's accuracy factor. The factor scales each conditional
    rate and values stay products, so a child is never worth more than its parent and every cut by value is
    ancestor-closed."""
    return path_products(np.minimum(tree.conditional * factor, 1.0), tree.parents)


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best values (ties: the lower index), among those >= 0."""
    order = np.argsort(-values, kind="stable")
    return order[:k]
