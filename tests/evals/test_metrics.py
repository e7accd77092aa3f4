"""Metrics from hand-built acceptance traces and timings (no models)."""

from __future__ import annotations

import pytest
import torch

from specserve.evals.metrics import Measurement, SpecCounts, identical_fraction, speedup, spread, tokens_per_s
from specserve.request import SpecStats
from specserve.verify import DraftTree, VerifyResult


def test_tau_acceptance_and_histogram_from_a_trace():
    # depth-4 chains: all accepted, none accepted, two accepted; then a plain step (empty tree).
    c = SpecCounts().add_step(4, 4).add_step(4, 0).add_step(4, 2).add_step(0, 0)
    assert c.steps == 4 and c.emitted == 5 + 1 + 3 + 1
    assert c.tau == pytest.approx(10 / 4)
    assert c.acceptance_per_position == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    assert c.accepted_length_counts == [2, 0, 1, 0, 1]
    assert c.accept_length_histogram == [0.5, 0.0, 0.25, 0.0, 0.25]
    assert c.drafted_per_step == 12 / 4 and c.accepted_per_step == pytest.approx(c.tau - 1)


def test_tree_steps_count_nodes_and_depth_separately():
    c = SpecCounts().add_step(depth=2, accepted=1, nodes=6)
    assert c.drafted_nodes == 6 and c.drafted_per_position == [1, 1] and c.accepted_per_position == [1, 0]
    with pytest.raises(ValueError):
        SpecCounts().add_step(depth=2, accepted=3)


def test_always_right_and_always_wrong_traces():
    right = SpecCounts()
    wrong = SpecCounts()
    for _ in range(5):
        right.add_step(3, 3)
        wrong.add_step(3, 0)
    assert right.tau == 4 and right.acceptance_per_position == [1.0, 1.0, 1.0]
    assert wrong.tau == 1 and wrong.acceptance_per_position == [0.0, 0.0, 0.0]
    assert SpecCounts().tau is None and SpecCounts().accept_length_histogram == []


def test_counts_from_spec_stats_match_the_trace():
    """SpecStats.record (what the engine calls) and a hand-written trace give the same counts."""
    stats = SpecStats()
    chain = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 1]))
    for accepted in (3, 1, 0):
        stats.record(chain, VerifyResult(tuple(range(accepted)), tuple([5, 6, 7][:accepted]), 1, 3))
    trace = SpecCounts().add_step(3, 3).add_step(3, 1).add_step(3, 0)
    from_stats = SpecCounts.total([stats])
    assert from_stats.summary() == trace.summary()
    assert SpecCounts.total([stats.to_dict()]).summary() == trace.summary()
    assert stats.accepted_length_counts == [1, 1, 0, 1]


def test_spread_and_tokens_per_s():
    assert spread([]) is None
    s = spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert spread([2.0])["q1"] == 2.0
    ms = [Measurement("a", 0, 0, 1.0, 10), Measurement("a", 0, 1, 1.0, 30), Measurement("a", 1, 0, 2.0, 40)]
    assert tokens_per_s(ms)["median"] == pytest.approx(20.0)  # both repeats run at 20 tokens/s


def test_speedup_uses_only_groups_both_finished():
    plain = [Measurement("plain", r, g, 2.0, 10) for r in range(2) for g in range(2)]
    fast = [Measurement("d", r, g, 1.0, 10) for r in range(2) for g in range(2)]
    fast.append(Measurement("d", 2, 0, 0.1, 10))  # plain never ran repeat 2: ignored
    sp = speedup(plain, fast)
    assert sp["median"] == pytest.approx(2.0) and sp["n"] == 2 and sp["per_prompt"]["n"] == 4
    mixed = [Measurement("d", 0, 0, 1.0, 10), Measurement("d", 0, 1, 4.0, 10)]
    sp = speedup(plain, mixed)  # repeat 0: 20 tokens in 5 s against 20 tokens in 4 s
    assert sp["median"] == pytest.approx(0.8)
    assert sp["per_prompt"]["min"] == pytest.approx(0.5) and sp["per_prompt"]["max"] == pytest.approx(2.0)
    assert speedup(plain, []) is None


def test_identical_fraction():
    assert identical_fraction([([1, 2], [1, 2]), ([1, 2], [1, 3])]) == 0.5
    assert identical_fraction([]) is None
