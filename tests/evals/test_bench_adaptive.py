"""`specserve bench adaptive` on a tiny model: JSON structure, greedy outputs identical, plot, bad input."""

from __future__ import annotations

import json

import pytest

from specserve.cli import main
from specserve.evals.bench_adaptive import DEFAULT_SWEEP, _measure_cell, parse_sweep


def test_bench_adaptive_smoke(llama_dir, tmp_path, capsys):
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    draft = f"draft:{llama_dir}"  # the target as its own draft model: no checkpoint needed
    rc = main(["bench", "adaptive", "--model", str(llama_dir), "--drafters", f"ngram,{draft}", "--batch-sizes", "1,2",
               "--temperatures", "0,1", "--max-tokens", "8", "--prompt-chars", "120", "--repeats", "1",
               "--sweep", "ngram=2x2,24x6", "--sweep", "draft=1x1", "--device", "cpu",
               "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "ad/max" in printed and "greedy outputs identical to plain decoding: yes" in printed
    result = json.loads(out.read_text())
    assert result["outputs_identical"] is True and result["mismatches"] == []
    assert {"platform", "threads", "torch", "device"} <= set(result["machine"])
    assert result["settings"]["batch_sizes"] == [1, 2] and result["settings"]["temperatures"] == [0.0, 1.0]
    assert set(result["drafters"]) == {"ngram", draft}
    ngram = result["drafters"]["ngram"]
    # 24x6 is ngram's default (budget 24, depth 6): skipped, not measured twice.
    assert set(ngram["configs"]) == {"plain", "plain:control", "static:default", "static:b2d2", "adaptive"}
    assert len(ngram["sweep_skipped"]) == 1 and "static:b24d6" in ngram["sweep_skipped"][0]
    assert ngram["configs"]["static:b2d2"]["max_budget"] == 2 and ngram["configs"]["static:b2d2"]["depth"] == 2
    assert set(result["drafters"][draft]["configs"]) == {"plain", "plain:control", "static:default", "static:b1d1",
                                                         "adaptive"}
    for entry in result["drafters"].values():
        cells = entry["cells"]
        assert [(c["batch"], c["temperature"]) for c in cells] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
        for c in cells:
            assert c["outputs_identical"] is (True if c["temperature"] == 0 else None)
            assert c["best_static"] in entry["configs"] and c["best_static"].startswith("static:")
            # The verdicts, recomputed from the cell's own figures by the rule evals/bench_adaptive.py
            # documents: goals adaptive >= 1.00 x plain and adaptive >= 0.97 x max(plain, best static);
            # "met" at or above the goal, "missed" (beyond noise) below goal x (1 - noise), else "within noise".
            adaptive = c["configs"]["adaptive"]["tokens_per_s"]
            best_static = c["configs"][c["best_static"]]["tokens_per_s"]
            for goal, ratio, target in (("vs_plain", adaptive / c["plain_tokens_per_s"], 1.00),
                                        ("vs_max_plain_best_static", adaptive / max(c["plain_tokens_per_s"], best_static), 0.97)):
                expected = "met" if ratio >= target else "missed" if ratio < target * (1 - c["noise"]) else "within noise"
                assert c["goals"][goal] == expected, (goal, ratio, c["noise"], c["goals"])
            assert c["adaptive_speedup"] == pytest.approx(adaptive / c["plain_tokens_per_s"])
            control = c["configs"]["plain:control"]["tokens_per_s"] / c["plain_tokens_per_s"]
            assert c["noise"] == pytest.approx(abs(1 - control))  # one round: no spread; the control's distance
            plain = c["configs"]["plain"]
            assert plain["speedup"] == 1.0 and plain["tokens_per_s"] == c["plain_tokens_per_s"] > 0
            for name, cfg in c["configs"].items():
                assert cfg["tokens_per_s"] > 0 and cfg["per_request_p50_tokens_per_s"] > 0
                assert len(cfg["tokens_per_s_rounds"]) == 1
            best = c["configs"][c["best_static"]]["tokens_per_s"]
            assert c["adaptive_vs_max_plain_best_static"] == pytest.approx(
                c["configs"]["adaptive"]["tokens_per_s"] / max(c["plain_tokens_per_s"], best))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_auto_is_a_drafter_spec_of_its_own():
    from specserve.evals.bench_adaptive import parse_drafters

    assert parse_drafters("auto,ngram,auto") == [("auto", "auto"), ("ngram", "ngram")]


def test_default_sweep_and_overrides():
    assert parse_sweep(None, ["ngram", "eagle"]) == {"ngram": list(DEFAULT_SWEEP["ngram"]), "eagle": list(DEFAULT_SWEEP["eagle"])}
    assert parse_sweep(["4x4", "eagle=1x1,2X2", "ngram="], ["ngram", "eagle", "draft"]) == {
        "ngram": [], "eagle": [(1, 1), (2, 2)], "draft": [(4, 4)]}


class _FakeLLM:
    """Answers every request with fixed tokens and records the order configurations ran in."""

    def __init__(self, name: str, log: list[str], tokens: list[int]) -> None:
        self.name, self.log, self.tokens = name, log, tokens

    def generate(self, prompts, params):
        from specserve.request import RequestOutput, SpecStats

        self.log.append(self.name)
        return [RequestOutput(f"r{i}", list(p), list(self.tokens), "", "length", SpecStats(), 0.001, 0.002)
                for i, p in enumerate(prompts)]


def test_cell_rotates_the_order_and_catches_a_greedy_mismatch():
    import torch

    log: list[str] = []
    names = ["plain", "static:default", "static:b2d2", "adaptive"]
    llms = {n: _FakeLLM(n, log, [7, 8, 9] if n == "adaptive" else [7, 8, 8]) for n in names}
    cell = _measure_cell(llms, [[1, 2], [3, 4]], 0.0, 3, 3, torch.device("cpu"))
    assert [log[4 * r] for r in range(3)] == ["plain", "static:default", "static:b2d2"]  # a new first each round
    assert cell["outputs_identical"] is False and cell["mismatched_configs"] == ["adaptive"]
    assert cell["best_static"] in ("static:default", "static:b2d2")
    sampled = _measure_cell(llms, [[1, 2]], 1.0, 3, 1, torch.device("cpu"))
    assert sampled["outputs_identical"] is None and sampled["mismatched_configs"] == []


class _BatchLog(_FakeLLM):
    """Records each generate call's prompts and per-request seeds."""

    def generate(self, prompts, params):
        seeds = [p.seed for p in params] if isinstance(params, list) else None
        self.log.append((len(prompts), seeds))
        return _FakeLLM(self.name, [], self.tokens).generate(prompts, params)


def test_a_cell_times_its_prompts_in_batches_of_its_size():
    """A B=1 cell over 3 prompts runs three one-prompt batches per configuration and round, each sampled request
    with its own seed, and counts every request's tokens."""
    import torch

    names = ["plain", "static:default", "adaptive"]
    logs: dict[str, list] = {n: [] for n in names}
    llms = {n: _BatchLog(n, logs[n], [7, 8, 9]) for n in names}
    cell = _measure_cell(llms, [[1], [2], [3]], 1.0, 3, 2, torch.device("cpu"), batch=1)
    for n in names:
        assert logs[n] == [(1, [0]), (1, [1]), (1, [2]), (1, [1000]), (1, [1001]), (1, [1002])]
    assert cell["configs"]["plain"]["per_request_p50_tokens_per_s"] == 3 / 0.002  # every request counted
    for n in names:
        logs[n].clear()
    greedy = _measure_cell(llms, [[1], [2], [3]], 0.0, 3, 1, torch.device("cpu"), batch=2)
    assert logs["plain"] == [(2, None), (1, None)] and greedy["outputs_identical"] is True


@pytest.mark.parametrize("args, message", [
    (["--drafters", "ngram,bogus"], "unknown drafter 'bogus'"),
    (["--batch-sizes", "0,2"], "--batch-sizes must be integers >= 1"),
    (["--temperatures", "0,hot"], "--temperatures expects comma-separated numbers"),
    (["--temperatures", "-1"], "--temperatures must be finite numbers >= 0"),
    (["--sweep", "ngram=4"], "--sweep expects"),
    (["--sweep", "eagle=4x4"], "not in --drafters"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--drafters", "auto"], "has no default drafter"),  # a model of no measured default: nothing to compare
])
def test_bench_adaptive_bad_input(llama_dir, capsys, args, message):
    rc = main(["bench", "adaptive", "--model", str(llama_dir), "--drafters", "ngram", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_a_hybrid_without_a_depth_option_sweeps_its_budgets(llama_dir, tmp_path, capsys):
    # A hybrid (what `auto` is on the default model) takes max_budget but no depth: its sweep settings run at its own
    # depth ("static:bB") instead of being skipped as options it cannot take.
    out = tmp_path / "h.json"
    rc = main(["bench", "adaptive", "--model", str(llama_dir), "--drafters", "hybrid:ngram+suffix", "--batch-sizes", "1",
               "--temperatures", "0", "--max-tokens", "8", "--prompt-chars", "120", "--repeats", "1",
               "--sweep", "hybrid=2x2", "--device", "cpu", "--json", str(out)])
    capsys.readouterr()
    assert rc == 0
    entry = json.loads(out.read_text())["drafters"]["hybrid:ngram+suffix"]
    assert entry["sweep_skipped"] == []
    assert set(entry["configs"]) == {"plain", "plain:control", "static:default", "static:b2", "adaptive"}
    assert entry["configs"]["static:b2"]["max_budget"] == 2
