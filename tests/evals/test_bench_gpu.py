"""`specserve bench gpu`: refuses without CUDA in one line; every section's code path runs on a tiny CPU model
(`--device cpu --shape tiny`, the hidden test mode) and writes finite figures, markdown and an agreement check."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from specserve.cli import main
from specserve.evals.bench_gpu import agreement, cuda_graphs, graph_replays

TINY = ["bench", "gpu", "--device", "cpu", "--shape", "tiny", "--repeats", "1", "--new-tokens", "8",
        "--prompt-tokens", "16"]


def _numbers(value, path="") -> list[tuple[str, float]]:
    """Every number in a JSON value with where it sits (bools and None are not numbers here)."""
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in _numbers(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [n for i, v in enumerate(value) for n in _numbers(v, f"{path}[{i}]")]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [(path, float(value))]
    return []


def test_agreement_counts_common_prefixes():
    got = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 9], [5, 6, 7, 8]])
    assert got == {"tokens_match": False, "fraction": 6 / 8, "first_divergence_per_row": [2, None]}
    assert agreement([[1, 2]], [[1, 2]])["tokens_match"]


def test_cuda_graphs_status():
    """Graph capture is reported, never fatal: off, absent in this stack, failing, done, or already done."""

    class Model:
        graphs = None

        def __init__(self, fail: bool = False) -> None:
            self.fail, self.calls = fail, []

        def use_cuda_graphs(self, cache, max_num_seqs, max_query_len, max_positions):
            self.calls.append((cache, max_num_seqs, max_query_len, max_positions))
            if self.fail:
                raise RuntimeError("capture\nfailed")
            self.graphs = SimpleNamespace(cache=cache, replays=0)

    cache = object()
    assert cuda_graphs(Model(), cache, False, 1, 1, 8) == "off"
    pass  # every LlamaModel has use_cuda_graphs now
    assert cuda_graphs(Model(fail=True), cache, True, 1, 1, 8) == "failed: RuntimeError: capture failed"
    model = Model()
    assert cuda_graphs(model, cache, True, 8, 65, 200) == "on" and model.calls == [(cache, 8, 65, 200)]
    assert cuda_graphs(model, cache, True, 8, 65, 200) == "on" and len(model.calls) == 1  # bound to this cache already
    assert graph_replays(model) == 0 and graph_replays(object()) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_needs_cuda(capsys):
    rc = main(["bench", "gpu"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0]


@pytest.mark.parametrize("args, message", [
    (["bench", "gpu", "--device", "cpu"], "only with --shape tiny"),
    (TINY + ["--sections", "1,6"], "--sections are numbers 1-5"),
    (TINY + ["--sections", "5"], "needs sections 2 and 3"),
    (TINY + ["--tau", "2,x"], "--tau expects comma-separated numbers"),
    (TINY + ["--new-tokens", "1"], "--new-tokens must be >= 2"),
])
def test_bad_input(capsys, args, message):
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_tiny_cpu_run(tmp_path, capsys):
    out, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    rc = main(TINY + ["--sections", "1,2,3,5", "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    result = json.loads(out.read_text())
    sections = result["sections"]
    assert set(sections) == {"plain_decode", "verify_cost", "eagle3_head", "projection"}
    meta = result["meta"]
    assert meta["torch"] == torch.__version__ and meta["transformers"] and meta["date"] and meta["device_name"]
    for name, body in sections.items():
        numbers = _numbers(body)
        assert numbers, name
        bad = [(p, v) for p, v in numbers if not math.isfinite(v) or v < 0]
        assert not bad, (name, bad)
    # Only first divergences and counts may be 0; every timing, rate and ratio is positive.
    for path, value in _numbers(sections):
        if any(key in path for key in ("ms", "tokens_per_s", "ratio", "speedup", "GBps", "floor")):
            assert value > 0, path

    decode = sections["plain_decode"]
    assert [b["batch"] for b in decode["batches"]] == [1, 8]
    for b in decode["batches"]:
        # fp32 on the CPU, the same weights: transformers' greedy tokens are ours, token for token.
        assert b["agreement"]["tokens_match"] and b["agreement"]["fraction"] == 1.0
        assert 0 < b["fraction_of_floor"] and b["transformers"]["specserve_speedup"] > 0
        assert b["transformers_compiled"]["status"].startswith("skipped")

    verify = sections["verify_cost"]["rows"]
    assert sorted({r["batch"] for r in verify}) == [1, 8, 32]
    assert sorted({r["nodes"] for r in verify}) == [0, 4, 8, 16, 32, 64]
    assert all(r["ratio"] > 0 for r in verify)
    assert all(r["ratio"] == 1.0 for r in verify if r["nodes"] == 0)

    head = sections["eagle3_head"]
    assert head["head_level"]["ratio"] > 0 and head["plain_target_step"]["ratio"] == 1.0

    projection = sections["projection"]
    assert projection["label"] == "projection" and {r["tau"] for r in projection["rows"]} == {2.0, 2.5, 3.0, 3.5}
    for r in projection["rows"]:
        assert r["projected_speedup"] == pytest.approx(r["tau"] / (r["verify_ratio"] + r["head_ratio"]))

    text = md.read_text()
    assert text in capsys.readouterr().out
    for heading in ("## 1. Plain decode", "## 2. Verify cost", "## 3. EAGLE-3 head", "## 5. Projection"):
        assert heading in text


def test_compiled_phase(tmp_path, monkeypatch):
    """The compiled-transformers phase (CUDA only in real runs) fills section 1's last column; on the CPU
    transformers does not compile, so this checks the phase's plumbing, alternation and agreement."""
    import specserve.evals.bench_gpu as bench_gpu

    monkeypatch.setattr(bench_gpu, "_compile_status", lambda s: None)
    out = tmp_path / "gpu.json"
    assert main(TINY + ["--sections", "1", "--batch-sizes", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["sections"]["plain_decode"]["batches"]
    compiled = row["transformers_compiled"]
    assert compiled["status"] == "ran" and compiled["compiled"] is False  # nothing compiles on the CPU
    assert compiled["tokens_per_s"]["median"] > 0 and compiled["specserve_speedup"] > 0
    assert compiled["agreement"]["tokens_match"]


def test_drafters_section_feeds_projection(tmp_path):
    """Section 4 runs `specserve eval`'s machinery on the embedded model; section 5 then projects its τ."""
    out = tmp_path / "gpu.json"
    rc = main(TINY + ["--sections", "2,3,4,5", "--drafters", "ngram", "--eval-prompts", "1", "--eval-tokens", "4",
                      "--tree-sizes", "0,8", "--verify-batch-sizes", "1", "--json", str(out)])
    assert rc == 0
    sections = json.loads(out.read_text())["sections"]
    (ngram,) = sections["drafters_e2e"]["drafters"]
    assert ngram["drafter"] == "ngram" and ngram["tau"] >= 1 and ngram["speedup"] > 0
    assert ngram["identical_fraction"] == 1.0
    assert [(r["tau_from"], r["tau"], r["nodes"]) for r in sections["projection"]["rows"]] == [("ngram", ngram["tau"], 8)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_cuda_run(tmp_path):
    out = tmp_path / "gpu.json"
    rc = main(["bench", "gpu", "--shape", "tiny", "--repeats", "1", "--new-tokens", "8", "--sections", "1,2,3,5",
               "--no-compile", "--json", str(out)])
    assert rc == 0
    sections = json.loads(out.read_text())["sections"]
    assert all(r["ratio"] > 0 for r in sections["verify_cost"]["rows"])
