"""The adaptive budget policy on synthetic costs and acceptance: what it decides and why.

High cost → plain decoding; rising acceptance → bigger trees; a bigger batch → fewer nodes per
request; probes bring a plain request back; every request finishes; calibration runs (its time is a figure of
`specserve bench startup`, not an assertion).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaptive_policy import FixedVerifyCost, FreeDrafting
from specserve import LLM, SamplingParams
from specserve.budget import RequestStepRecord, StepRecord
from specserve.speculation import AdaptiveBudget
from specserve.speculation.adaptive import NEARLY_FREE_SHARE, PROBE_FIRST, PROBE_NODES, REPLAN, SAMPLED_MARGIN, TREE_HISTORY
from specserve.speculation.cost_model import DraftCost, VerifyCost, calibrate_tree_cost
from specserve.speculation.node_values import NodeValueModel, fallback_scores, path_products
from specserve.verify import DraftTree


class _Req:
    """What the policy reads of a request."""

    def __init__(self, request_id: str, temperature: float = 0.0, length: int = 10) -> None:
        self.request_id = request_id
        self.params = SamplingParams(temperature=temperature)
        self.token_ids = np.zeros(length, dtype=np.int64)


def _cost(per_row: float, batch: int = 1) -> FixedVerifyCost:
    """One unit per step up to `batch` rows, `per_row` units per row past them."""
    far = batch + 4096
    return FixedVerifyCost([1, batch, far], [1.0, 1.000001, 1.0 + per_row * (far - batch)])


def _chain_tree(depth: int, scores: list[float] | None = None) -> DraftTree:
    tree = DraftTree.chain(list(range(1, depth + 1)))
    if scores is None:
        return tree
    return DraftTree(tree.tokens, tree.parents, scores=torch.tensor(scores, dtype=torch.float32))


def _fan(width: int) -> DraftTree:
    """`width` children of the root, each with a chain of 3 below it."""
    paths = [[10 * w + d for d in range(1, 5)] for w in range(width)]
    return DraftTree.from_paths(paths)


def _observe(policy: AdaptiveBudget, requests, trees, accepted: int) -> None:
    """A step in which every request's verified tree had its first `accepted` chain nodes accepted."""
    policy.observe(StepRecord(
        requests=tuple(RequestStepRecord(r.request_id, 1, t.num_nodes, t.max_depth, min(accepted, t.num_nodes),
                                         tuple(range(min(accepted, t.num_nodes)))) for r, t in zip(requests, trees)),
        num_tokens=len(requests) + sum(t.num_nodes for t in trees), num_prefill_tokens=0, draft_s=0.0, verify_s=0.0))


def _run(policy: AdaptiveBudget, requests, accepted: int, steps: int, depth: int = 6):
    """Plan, draft a chain per drafting request, cut, observe — `steps` times; returns the cut trees."""
    cut = []
    for _ in range(steps):
        plan = policy.plan(requests, len(requests))
        trees = [_chain_tree(depth) if b else DraftTree.empty() for b in plan.budgets]
        cut, _ = policy.cut(requests, trees, plan.budgets, len(requests), 0.0)
        _observe(policy, requests, cut, accepted)
    return cut


def test_verify_cost_interpolates_and_learns():
    cost = VerifyCost([1, 2, 4], [1.0, 2.0, 3.0])
    assert cost(3) == pytest.approx(2.5) and cost(6) == pytest.approx(4.0)  # extrapolated along the last segment
    for _ in range(200):
        cost.observe(3, 5.0)
    assert cost(3) == pytest.approx(5.0, rel=0.05)
    assert all(np.diff(cost.seconds) >= 0)  # never cheaper to verify more


def test_verify_cost_learns_what_further_sequences_add_apart_from_the_rows_curve():
    """A batch's steps teach an offset for that many sequences and leave one sequence's curve alone: the marginal
    cost of a draft row at batch 8 is the curve's (a new 4-row pass here), not zero. (Learned into the curve, eight
    decodes' 21 ms steps had lifted every knot from 8 rows up to 21 ms: the first draft rows looked free.)"""
    staircase = [7.8, 8.8, 8.9, 8.9, 10.6, 11.9, 12.3, 12.6, 14.8, 16.4, 16.8, 17.2]  # ms, one sequence, 1-12 rows
    cost = VerifyCost(list(range(1, 13)), [1e-3 * s for s in staircase])
    for _ in range(300):  # eight decodes' plain steps: 8 rows, 21 ms
        cost.observe(8, 21e-3, sequences=8)
    assert cost(8, 8) == pytest.approx(21e-3, rel=1e-3)
    assert cost.curve(8) == pytest.approx(12.6e-3) and cost.curve(9) == pytest.approx(14.8e-3)  # untouched
    assert cost(9, 8) - cost(8, 8) == pytest.approx((14.8 - 12.6) * 1e-3)  # the ninth row opens a pass
    assert cost(1) == pytest.approx(7.8e-3)  # one sequence costs what it did
    # A count never seen: between the nearest seen (1 costs nothing), in proportion beyond the largest.
    assert cost.offset(4) == pytest.approx((21 - 12.6) * 1e-3 * 3 / 7, rel=1e-3)
    assert cost.offset(15) == pytest.approx((21 - 12.6) * 1e-3 * 2, rel=1e-3)
    first = VerifyCost([1, 2], [1e-3, 2e-3])
    first.observe(2, 5e-3, sequences=2)  # a count's first step sets its offset outright
    assert first(2, 2) == pytest.approx(5e-3)


def test_a_batch_does_not_verify_rows_its_own_steps_made_look_free():
    """Eight decodes whose plain steps take 21 ms, one sequence's rows the staircase below: a draft node worth 0.3
    tokens per request does not pay (8.3 tokens in 23.2 ms, 8 in 21 ms plain), however many requests have one."""
    staircase = [7.8, 8.8, 8.9, 8.9, 10.6, 11.9, 12.3, 12.6, 14.8, 16.4, 16.8, 17.2, 18.9, 20.4, 20.6, 21.0]
    cost = VerifyCost(list(range(1, 17)), [1e-3 * s for s in staircase])
    policy = AdaptiveBudget(max_budget=4, max_depth=4, verify_cost=cost, draft_cost=FreeDrafting())
    requests = [_Req(str(i)) for i in range(8)]
    for _ in range(100):
        policy.observe(StepRecord(requests=tuple(RequestStepRecord(r.request_id, 0, 0, 0, 0) for r in requests),
                                  num_tokens=8, num_prefill_tokens=0, draft_s=0.0, verify_s=21e-3))
    kept, rate = policy._best_cut([np.array([0.3])] * 8, 8, 0.0)
    assert kept.tolist() == [0] * 8 and rate == pytest.approx(8 / 21e-3, rel=0.01)
    kept, _ = policy._best_cut([np.array([0.9, 0.8, 0.7])] * 8, 8, 0.0)  # worth it: 16 rows, two nodes each
    assert kept.sum() > 0


def test_calibration_knots_are_every_row_count_where_passes_step():
    from specserve.speculation.cost_model import calibration_knots

    assert calibration_knots(64) == list(range(1, 17)) + [20, 24, 28, 32, 64]
    assert calibration_knots(9) == list(range(1, 10))
    assert calibration_knots(40) == list(range(1, 17)) + [20, 24, 28, 32, 40]
    assert calibration_knots(1) == [1]


def test_draft_cost_learns_levels_and_backlog():
    cost = DraftCost()
    assert cost(3, 1, 0) == 0.0  # nothing measured: drafting looks free, so the first steps explore
    rng = np.random.default_rng(0)
    for _ in range(300):
        levels, requests, backlog = int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(0, 50))
        cost.observe(levels, requests, backlog, 1e-3 * levels + 2e-4 * levels * requests + 5e-5 * backlog)
    assert cost(4, 2, 10) == pytest.approx(4e-3 + 1.6e-3 + 5e-4, rel=0.05)


def test_draft_cost_is_recursive_least_squares_with_forgetting():
    # The reference: textbook RLS with forgetting factor λ, in numpy float64 (P ← (P - g pᵀ) / λ, g = P x / (λ + xᵀ P x),
    # θ ← max(θ + g (y - xᵀ θ), 0)), on a noisy random history; the policy's own is plain Python floats.
    lam, rng = DraftCost.FORGET, np.random.default_rng(1)
    theta, P = np.zeros(3), np.eye(3) * 1e4
    cost = DraftCost()
    cost.observe(1, 1, 0, 1.0)  # the first drafting step warms up and teaches nothing
    for step in range(400):
        levels, requests, backlog = int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(0, 50))
        seconds = (1e-3 * levels + 2e-4 * levels * requests + 5e-5 * backlog) * float(rng.uniform(0.8, 1.2))
        x = np.array([levels, levels * requests, backlog], dtype=np.float64)
        if step:
            seconds = min(seconds, max(float(np.maximum(x @ theta, 0.0)), 1e-5) * 3.0)  # outliers clipped at 3x
        px = P @ x
        gain = px / (lam + x @ px)
        theta = np.maximum(theta + gain * (seconds - x @ theta), 0.0)
        P = (P - np.outer(gain, px)) / lam
        if np.trace(P) > 1e8:
            P *= 1e8 / np.trace(P)
        cost.observe(levels, requests, backlog, seconds)
        assert cost(levels, requests, backlog) == pytest.approx(max(float(x @ theta), 0.0), rel=1e-6, abs=1e-12)


def test_verify_cost_of_a_number_is_the_interpolation_of_an_array():
    cost = VerifyCost([1, 2, 4, 8, 16], [0.018, 0.022, 0.027, 0.04, 0.07])
    points = np.concatenate([np.linspace(0, 30, 301), [1, 2, 4, 8, 16]])
    expected = np.where(points > 16, 0.07 + (0.07 - 0.04) / 8 * (points - 16), np.interp(points, cost.knots, cost.seconds))
    assert np.allclose([cost(float(p)) for p in points], expected, rtol=1e-12, atol=0)
    assert np.allclose([cost(int(p)) for p in points if p == int(p)], expected[points == points.astype(int)], rtol=1e-12)
    assert np.allclose(cost(points), expected, rtol=1e-12, atol=0)


def test_node_values_are_calibrated_conditionally_and_monotone():
    model = NodeValueModel()
    terms, parents = np.array([-0.1, -0.1, -3.0]), np.array([-1, 0, -1])  # a chain of two, and a sibling
    for step in range(400):  # overconfident drafter: a -0.1 node is accepted half the time its parent was
        first = step % 2 == 0
        second = first and step % 4 == 0
        model.observe(terms, parents, np.array([first, second, False]), sampled=False)
    conditional = model.conditional(terms, sampled=False)
    assert conditional[0] == pytest.approx(0.5, abs=0.06)  # depth 1 and depth 2 feed one bin
    assert conditional[0] >= conditional[2]
    values = path_products(conditional, parents)
    assert values[1] == pytest.approx(values[0] * conditional[1])
    assert model.conditional(terms, sampled=True)[0] > 0.8  # sampled requests keep their own table (prior here)


def test_fallback_scores_rank_depth_and_sibling_order():
    scores = fallback_scores(np.array([-1, -1, 0, 1]))
    assert scores.tolist() == [-1.0, -2.0, -2.0, -3.0]  # node 3: under node 1 (-2), its first child


def test_high_cost_means_plain_decoding():
    policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=5.0), draft_cost=FreeDrafting())
    requests = [_Req("a")]
    _run(policy, requests, accepted=2, steps=3)  # explore once, learn
    plan = policy.plan(requests, 1)
    assert plan.budgets == [0]


def test_a_catch_up_without_drafting_clears_the_backlog():
    """A request's backlog (what its drafter must feed before drafting, priced into a probe) grows by each step's
    tokens while it sits out, and falls to that step's tokens when its drafter caught up without drafting
    (prefix caching's `Drafter.catch_up`)."""
    policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=5.0), draft_cost=FreeDrafting())
    policy.plan([_Req("a", length=40)], 1)

    def sits_out(caught_up: bool) -> int:
        policy.observe(StepRecord(requests=(RequestStepRecord("a", 0, 0, 0, 0, (), caught_up),), num_tokens=1,
                                  num_prefill_tokens=0, draft_s=0.0, verify_s=0.0))
        return policy._requests["a"].backlog

    assert sits_out(False) == 41 and sits_out(False) == 42
    assert sits_out(True) == 1 and sits_out(False) == 2


def test_budget_grows_with_acceptance():
    def kept_after(accepted: int) -> int:
        policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=0.25), draft_cost=FreeDrafting())
        requests = [_Req("a")]
        cut = _run(policy, requests, accepted=accepted, steps=60)
        return cut[0].num_nodes

    low, high = kept_after(0), kept_after(6)
    assert low < high and high >= 4


def test_bigger_batch_means_fewer_nodes_per_request():
    def nodes_per_request(batch: int) -> float:
        # Rows are free up to 8 (a kernel's tile), then cost: one request keeps its whole tree, 16 do not.
        cost = FixedVerifyCost([1, 8, 8 + 4096], [1.0, 1.000001, 1.0 + 0.5 * 4096])
        policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=cost, draft_cost=FreeDrafting())
        requests = [_Req(f"r{i}") for i in range(batch)]
        cut = _run(policy, requests, accepted=3, steps=40)
        return sum(t.num_nodes for t in cut) / batch

    assert nodes_per_request(1) > nodes_per_request(16)


def test_cut_keeps_an_ancestor_closed_prefix_of_siblings():
    policy = AdaptiveBudget(max_budget=32, max_depth=4, verify_cost=_cost(per_row=0.2), draft_cost=FreeDrafting())
    requests = [_Req("s", temperature=1.0)]
    policy._typical[True] = (np.ones(1), np.full(1, -1), np.ones(1, dtype=np.int64))  # skip exploring
    tree = _fan(4)
    cut, predicted = policy.cut(requests, [tree], [32], 1, 0.0)
    kept = cut[0]
    assert 0 < kept.num_nodes < tree.num_nodes and predicted[0] > 0
    parents = kept.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))  # closed under ancestors (valid tree)
    roots = [tuple(kept.tokens[i:i + 1].tolist()) for i, p in enumerate(parents) if p == -1]
    assert roots == [(10 * w + 1,) for w in range(len(roots))]  # the first siblings, in order


def test_probing_revives_a_plain_request():
    policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=0.3), draft_cost=FreeDrafting())
    requests = [_Req("a")]
    _run(policy, requests, accepted=0, steps=20)  # nothing accepted: plain decoding
    assert policy.plan(requests, 1).budgets == [0]
    revived_at = None
    for step in range(4 * PROBE_FIRST):  # the text turns predictable: probes see everything accepted
        plan = policy.plan(requests, 1)
        trees = [_chain_tree(6) if b else DraftTree.empty() for b in plan.budgets]
        cut, _ = policy.cut(requests, trees, plan.budgets, 1, 0.0)
        _observe(policy, requests, cut, accepted=6)
        if policy._requests["a"].drafting:  # a full plan decided to draft again (a probe alone is not it)
            revived_at = step
            break
    assert revived_at is not None


def test_a_probe_is_judged_on_its_own_tree_not_on_trees_from_before_the_pause():
    """A request that drafted well, then guessed poorly through a hard passage, decodes plainly; when a probe then
    drafts a good tree, the next plan judges it on that tree: the trees from before the pause describe text it has
    left (kept, seven poor ones outvoted the probe's and it stayed plain until the next probe, 64 steps on)."""
    policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=0.3), draft_cost=FreeDrafting())
    requests = [_Req("a")]
    good, poor = [-0.05 * (d + 1) for d in range(6)], [-3.0 * (d + 1) for d in range(6)]
    for step in range(60):  # good guesses, all accepted; then unlikely ones, none accepted, until it stops
        plan = policy.plan(requests, 1)
        if step >= 16 and not plan.budgets[0]:
            break
        cut, _ = policy.cut(requests, [_chain_tree(6, good if step < 16 else poor)], plan.budgets, 1, 0.0)
        _observe(policy, requests, cut, accepted=cut[0].num_nodes if step < 16 else 0)
    assert len(policy._requests["a"].trees) == TREE_HISTORY
    assert policy.plan(requests, 1).budgets == [0]
    for _ in range(4 * PROBE_FIRST):
        plan = policy.plan(requests, 1)
        if plan.budgets[0]:
            break
    assert policy._requests["a"].probing
    cut, _ = policy.cut(requests, [_chain_tree(6, good)], plan.budgets, 1, 0.0)
    _observe(policy, requests, cut, accepted=cut[0].num_nodes)
    assert len(policy._requests["a"].trees) == 1  # the probe's tree alone
    assert policy.plan(requests, 1).budgets == [6]  # the plan right after a probe drafts again


def test_sampled_requests_draft_only_for_a_clear_predicted_gain():
    """A one-node tree accepted 2 times in 5 pays 1.4 tokens for a step of 1.3 plain steps (+7.7 %): a greedy request
    drafts it every step, a sampled one decodes plainly (a plan chosen on a request's good-looking trees is optimistic,
    and a sampled node's acceptance is a draw: the gain must beat SAMPLED_MARGIN). Accepted 3 times in 5 (+23 %), both
    draft."""
    assert 1.4 / 1.3 - 1 < SAMPLED_MARGIN < 1.6 / 1.3 - 1

    def drafting_steps(temperature: float, accepted_of_5: int, steps: int = 120) -> int:
        policy = AdaptiveBudget(max_budget=1, max_depth=1, verify_cost=_cost(per_row=0.3), draft_cost=FreeDrafting())
        requests = [_Req("a", temperature=temperature)]
        drafted = late = 0
        for step in range(steps):
            plan = policy.plan(requests, 1)
            tree = _chain_tree(1, [math.log(accepted_of_5 / 5)]) if plan.budgets[0] else DraftTree.empty()
            cut, _ = policy.cut(requests, [tree], plan.budgets, 1, 0.0)
            _observe(policy, requests, cut, accepted=int(drafted % 5 < accepted_of_5))
            if plan.budgets[0]:
                drafted += 1
                late += step >= steps // 2
        return late  # drafting steps in the second half, once calibrated

    assert drafting_steps(0.0, 2) == 60 and drafting_steps(1.0, 2) == 0
    assert drafting_steps(0.0, 3) == 60 and drafting_steps(1.0, 3) == 60


class _PricedDrafting(DraftCost):
    """Drafting that costs `share` of a (one-unit) plain step per request."""

    def __init__(self, share: float) -> None:
        super().__init__()
        self.share = share

    def __call__(self, levels: int, requests: int, backlog: int = 0) -> float:
        return self.share * requests if levels > 0 and requests > 0 else 0.0


def test_a_nearly_free_whole_tree_drafter_drafts_through_a_cold_start():
    """n-gram and suffix draft whole trees for almost nothing: a cold start's useless trees must not turn them
    off until a late probe (the cut alone decides what is verified); a drafter whose drafting is priced above
    NEARLY_FREE_SHARE of a step is still switched off as before."""
    def budgets_after_cold_start(share: float) -> list[int]:
        policy = AdaptiveBudget(max_budget=8, max_depth=8, whole_trees=True, verify_cost=_cost(per_row=0.3),
                                draft_cost=_PricedDrafting(share))
        requests = [_Req("a")]
        cut = _run(policy, requests, accepted=0, steps=20, depth=8)
        return [policy.plan(requests, 1).budgets[0] for _ in range(3 * REPLAN)], cut

    free, cut = budgets_after_cold_start(NEARLY_FREE_SHARE / 4)
    assert free == [8] * len(free)
    assert cut[0].num_nodes == 0  # nothing accepted: the cut verifies nothing, so drafting stays free
    priced, _ = budgets_after_cold_start(NEARLY_FREE_SHARE * 4)
    assert set(priced) == {0}


def test_a_probe_drafts_the_whole_tree_so_the_plan_sees_long_chains():
    """A probe verifies few nodes but drafts the drafter's whole tree: the plan that follows prices the
    long chain a predictable text offers, not the two nodes verified (which alone would not pay here)."""
    policy = AdaptiveBudget(max_budget=8, max_depth=8, verify_cost=_cost(per_row=0.3), draft_cost=FreeDrafting(),
                            tree_s=0.5)
    requests = [_Req("a")]
    _run(policy, requests, accepted=0, steps=20, depth=8)
    assert policy.plan(requests, 1).budgets == [0]
    for _ in range(4 * PROBE_FIRST):
        plan = policy.plan(requests, 1)
        if plan.budgets[0]:
            break
    assert plan.budgets == [8] and plan.depth == 8 and policy._requests["a"].probing
    cut, _ = policy.cut(requests, [_chain_tree(8)], plan.budgets, 1, 0.0)
    assert cut[0].num_nodes >= PROBE_NODES
    assert len(policy._predicted(policy._requests["a"])[-1][0]) == 8  # the next plan prices all 8 nodes


def test_a_level_drafter_explores_one_level_deeper_before_each_plan():
    """A plan sees only the depths its last trees had: the step before each full plan drafts one level
    more than planned, so a depth that was lowered can grow back."""
    policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=0.3), draft_cost=FreeDrafting())
    requests = [_Req("a")]
    _run(policy, requests, accepted=1, steps=30, depth=6)  # little accepted: a shallow plan
    planned = policy._plan_depth
    assert 0 < planned < 6
    depths = [policy.plan(requests, 1).depth for _ in range(REPLAN)]
    # Until the next full plan the planned depth stands, but for the step before it, which drafts one level more
    # (what the full plan then does with that tree, drafted deeper, is the plan's to decide).
    first = next(i for i, d in enumerate(depths) if d != planned)
    assert depths[first] == planned + 1 and set(depths[:first]) == {planned}
    whole = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=0.3), draft_cost=FreeDrafting(),
                           whole_trees=True)
    _run(whole, requests, accepted=1, steps=30, depth=6)
    assert whole._plan_depth == 6  # drafting every level at once costs nothing more: the cut sizes it


def test_accuracy_factor_settles_where_predictions_match_acceptance():
    """A request whose drafter is better than the batch-wide calibration says: its factor rises until
    what the policy predicts for its trees is what they get accepted (then stays)."""
    policy = AdaptiveBudget(max_budget=4, max_depth=4, verify_cost=_cost(per_row=0.01), draft_cost=FreeDrafting())
    requests = [_Req("a")]
    predictions = []
    for _ in range(200):
        plan = policy.plan(requests, 1)
        tree = _chain_tree(4, [-2.0, -4.0, -6.0, -8.0]) if plan.budgets[0] else DraftTree.empty()
        cut, predicted = policy.cut(requests, [tree], plan.budgets, 1, 0.0)
        if cut[0].num_nodes:  # the first node is always accepted, the others never
            predictions.append(predicted[0])
        _observe(policy, requests, cut, accepted=1)
        policy.node_values = NodeValueModel()  # keep the calibration at its prior: the factor must do it
    assert np.mean(predictions[-20:]) == pytest.approx(1.0, abs=0.15)


def test_draft_cost_without_levels_or_backlog():
    """Drafters that draft a whole tree at once and have no catch-up (n-gram, suffix, Medusa): depth and
    backlog are no part of their cost, and least squares is not given them to misattribute time to."""
    cost = DraftCost(levels=False, backlog=False)
    rng = np.random.default_rng(0)
    for _ in range(100):
        requests = int(rng.integers(1, 9))
        cost.observe(int(rng.integers(1, 9)), requests, int(rng.integers(0, 500)), 1e-4 + 5e-5 * requests)
    assert cost(8, 2, 400) == pytest.approx(cost(1, 2, 0)) == pytest.approx(2e-4, rel=0.05)


def test_tree_overhead_is_calibrated_from_tree_and_plain_forwards():
    calls = []

    def time_forward(rows):
        calls.append(("plain", rows))
        return 1e-3 * rows

    def time_tree(nodes):
        calls.append(("tree", nodes))
        return 1e-3 * (nodes + 1) + 4e-4

    assert calibrate_tree_cost(time_forward, time_tree, 8) == pytest.approx(4e-4)
    assert ("plain", 9) in calls and calls[:2] == [("tree", 8), ("tree", 8)]  # warmed up first


def _contended(cost, busy_calls: range, extra: float):
    """A timing function whose calls number `busy_calls` (0-based, over every call made) take `extra` longer: a
    few milliseconds of another process, as on a shared host."""
    count = [0]

    def timed(n):
        count[0] += 1
        return cost(n) + (extra if count[0] - 1 in busy_calls else 0.0)
    return timed


def test_calibration_survives_a_moment_of_contention():
    """Contention over a few consecutive timings must not reach the calibrated costs: timings are interleaved,
    knots take their fastest round and the tree overhead the median of paired differences. (Timing each knot's
    repeats back to back gave a 6.6 ms tree overhead on the default model, which kept speculation off.)"""
    from specserve.speculation.cost_model import calibrate_verify_cost

    def rows_cost(rows):
        return 1e-3 * rows

    busy = range(2, 6)  # right after the warm-ups: the first timings of the first knots
    time_forward = _contended(rows_cost, busy, 5e-3)
    verify = calibrate_verify_cost(time_forward, 16)
    assert verify.seconds.tolist() == pytest.approx([rows_cost(k) for k in verify.knots])
    clock = [0]  # one call counter over both functions: contention is a moment, whatever is timed in it

    def shared(cost):
        def timed(n):
            clock[0] += 1
            return cost(n) + (5e-3 if clock[0] - 1 in busy else 0.0)
        return timed

    tree_overhead = calibrate_tree_cost(shared(rows_cost), shared(lambda nodes: rows_cost(nodes + 1) + 4e-4), 8)
    assert tree_overhead == pytest.approx(4e-4)


def test_drafting_steps_teach_row_cost_net_of_tree_overhead_but_probes_do_not():
    cost = VerifyCost([1, 8], [1e-3, 8e-3])
    policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=cost, draft_cost=FreeDrafting(), tree_s=1e-3)
    requests = [_Req("a")]
    policy._state("a").probing = True
    record = StepRecord(requests=(RequestStepRecord("a", 6, 6, 6, 0, ()),), num_tokens=7, num_prefill_tokens=0,
                        draft_s=0.0, verify_s=20e-3)
    policy.observe(record)
    assert cost(7) == pytest.approx(7e-3)  # a probe: nothing learned
    policy._state("a").probing = False
    for _ in range(300):
        policy.observe(record)
    assert cost(7) == pytest.approx(19e-3, rel=0.02)  # 20 ms measured, 1 ms of it the tree's


def test_no_request_starves_and_output_is_plain_greedy(llama_dir):
    """Adaptive speculation (the default) on 12 requests of different lengths: all finish, all equal plain."""
    prompts = ["def f(x):", "class A:", "import os\n", "x = [1, 2, 3]\n" * 4] * 3
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(llama_dir, drafter=None).generate(prompts, params)
    llm = LLM(llama_dir, drafter="ngram")
    assert llm.speculation == "adaptive"
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" for o in spec)


def test_calibration_runs_on_the_embedded_model():
    """The cost model's own forwards run and price a verify row. How long they take is a figure, not an
    assertion (a wall-time bound flakes on a busy machine): `specserve bench startup` prints it."""
    llm = LLM("tiny", drafter="draft")
    assert isinstance(llm.engine.speculator.policy, AdaptiveBudget)
    assert llm.engine.calibration_s > 0
    assert llm.engine.speculator.policy.verify_cost(1) > 0


def test_a_new_request_borrows_the_latest_tree_of_its_own_kind():
    """Greedy and sampled acceptance differ a lot: a sampled request that has not drafted yet is priced
    from the latest sampled request's tree, not a greedy one's."""
    policy = AdaptiveBudget(max_budget=4, max_depth=4, verify_cost=_cost(per_row=0.3), draft_cost=FreeDrafting())
    greedy, sampled = _Req("g"), _Req("s", temperature=1.0)
    for req, depth in ((greedy, 4), (sampled, 1)):
        policy.plan([req], 1)
        policy.cut([req], [_chain_tree(depth)], [4], 1, 0.0)
    newcomer = _Req("n", temperature=1.0)
    policy.plan([newcomer], 1)
    assert [len(v) for v, _, _ in policy._predicted(policy._requests["n"])] == [1]


def test_a_new_request_probes_a_tree_of_its_own_first():
    """Another request's latest tree says drafting does not pay; a new request is still probed on its
    first plain step (its expected length covers the probe), then judged on its own tree."""
    policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=0.3), draft_cost=FreeDrafting())
    _run(policy, [_Req("old")], accepted=0, steps=20)
    assert policy.plan([_Req("old")], 1).budgets == [0]
    newcomer = _Req("new")
    newcomer.params = SamplingParams(temperature=0.0, max_tokens=64)
    plan = policy.plan([newcomer], 1)
    assert plan.budgets == [6] and policy._requests["new"].probing
    cut, _ = policy.cut([newcomer], [_chain_tree(6)], plan.budgets, 1, 0.0)
    _observe(policy, [newcomer], cut, accepted=cut[0].num_nodes)  # its own text is predictable
    assert policy.plan([newcomer], 1).budgets == [6] and policy._requests["new"].drafting  # planned right after
    assert not policy._requests["new"].fresh


def test_plan_predicts_from_recent_trees_not_only_the_last():
    """An n-gram request whose latest step found no match, after three that did, keeps drafting: the plan
    prices the expected best nodes of its last trees, not the empty one alone."""
    policy = AdaptiveBudget(max_budget=6, max_depth=6, verify_cost=_cost(per_row=0.05), draft_cost=FreeDrafting(),
                            whole_trees=True)
    requests = [_Req("a")]
    for tree in [_chain_tree(6)] * 3 + [DraftTree.empty()]:
        plan = policy.plan(requests, 1)
        cut, _ = policy.cut(requests, [tree], [6], 1, 0.0)
        _observe(policy, requests, cut, accepted=cut[0].num_nodes)
    policy._since_plan = REPLAN  # a full plan now
    assert policy.plan(requests, 1).budgets == [6]
    assert len(policy._requests["a"].trees) == 4


def test_a_level_is_priced_by_the_trees_that_drafted_it():
    """A plan prices depth d from the recent trees drafted at least d deep: trees the plan kept shallower have no
    nodes there, which says nothing about their worth (counted as zeros they priced a level at the share of steps
    that explored it). With none that deep, every tree prices it."""
    from specserve.speculation.adaptive import _expected_best

    deep = (np.array([0.8, 0.6, 0.5]), np.array([1, 2, 3]), 3)
    shallow = (np.array([0.8]), np.array([1]), 1)
    history = [shallow] * 7 + [deep]
    np.testing.assert_allclose(_expected_best(history, 3), [0.8, 0.6, 0.5])
    np.testing.assert_allclose(_expected_best(history, 1), [0.8])  # every tree drafted depth 1
    np.testing.assert_allclose(_expected_best([shallow] * 8, 2), [0.8])  # none drafted depth 2: all of them price it
