"""`specserve bench overhead`: null forwards replay the real run exactly (same trees, same tokens), the
phases add up to the step, and a replay that departs from the real run is caught, not timed."""

from __future__ import annotations

import dataclasses

import pytest

from specserve.evals import bench_overhead
from specserve.evals.bench_overhead import PHASES, NullForwards, measure

PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def push(self, x):"]


@pytest.mark.parametrize("drafter", [None, "ngram", "draft", "eagle"])
def test_null_forward_replays_draft_and_emit_what_the_real_run_did(drafter):
    cell, llm = measure(drafter, batch=2, max_tokens=10, repeats=1, prompts=PROMPTS)
    ms = cell["host_ms_per_step"]
    assert cell["steps"] > 0 and cell["tokens"] == 2 * 10
    assert all(ms[p] >= 0 for p in PHASES) and ms["step"] > 0
    assert ms["step"] == pytest.approx(sum(ms[p] for p in PHASES) + ms["other"], abs=1e-3)
    if drafter in ("draft", "eagle"):  # forwards of their own were replaced too
        assert len(bench_overhead.forward_targets(llm)) > 1


def test_a_replay_that_departs_from_the_real_run_is_refused(monkeypatch):
    """Perturb one recorded target forward before the checked replay: its argmax moves, the replay emits
    other tokens, and the benchmark refuses the cell instead of reporting its time."""
    real_replay = NullForwards.replay

    def perturbed_replay(self):
        out = self.recorded[0][-3]  # a decode step of the target
        logits = out.logits.clone()
        logits[0, int(logits[0].argmin())] = float(logits[0].max()) + 10.0
        self.recorded[0][-3] = dataclasses.replace(out, logits=logits)
        monkeypatch.setattr(NullForwards, "replay", real_replay)  # once
        real_replay(self)

    monkeypatch.setattr(NullForwards, "replay", perturbed_replay)
    with pytest.raises(RuntimeError, match="diverged"):
        measure(None, batch=1, max_tokens=8, repeats=1, prompts=PROMPTS)


def test_a_cold_replay_streams_the_targets_weights_before_each_of_its_forwards_and_leaves_that_time_out():
    cell, llm = measure("ngram", batch=1, max_tokens=10, repeats=2, prompts=PROMPTS, cold=True)
    ms = cell["host_ms_per_step"]
    assert cell["tokens"] == 10  # the checked replay still emitted what the real run did
    assert cell["cold_bytes"] == llm.model.bytes_read_per_token() > 0
    assert cell["cold_streams"] == cell["steps"]  # one stream per replayed target forward (one per step)
    assert all(ms[p] >= 0 for p in PHASES)  # the streams' time came out of the batch phase, not below zero
    assert ms["step"] == pytest.approx(sum(ms[p] for p in PHASES) + ms["other"], abs=1e-3)
    warm, _ = measure("ngram", batch=1, max_tokens=10, repeats=2, prompts=PROMPTS)
    assert warm["cold_bytes"] == warm["cold_streams"] == 0
