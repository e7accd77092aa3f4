"""`specserve bench grammar` on a tiny model: every constrained output valid, greedy outputs equal constrained
plain decoding's, the table and the JSON, the configurations, bad input."""

from __future__ import annotations

import datetime
import json

import pytest

from specserve.cli import main
from specserve.evals.bench_grammar import configurations, default_out

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["kind", "n"], "additionalProperties": False}
CALL = 'start: NAME "(" NUMBER ")"\nNAME: /[a-z]{1,4}/\nNUMBER: /[0-9]{1,2}/\n'


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rows = [("def f(x):", {"json_schema": SCHEMA}), ("x =", {"regex": r" [0-9]{1,3}\n"}), ("y = ", {"grammar": CALL}),
            ("ok?", {"choice": ["yes", "no"]})]
    path = tmp_path_factory.mktemp("data") / "c.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": next(iter(c)), "turns": [t], **c})
                              for i, (t, c) in enumerate(rows)) + "\n")
    return path


def test_bench_grammar_tiny(llama_dir, dataset, tmp_path, capsys):
    out = tmp_path / "g.json"
    draft = f"draft:{llama_dir}"  # the target as its own draft model: no checkpoint needed
    rc = main(["bench", "grammar", "--model", str(llama_dir), "--dataset", str(dataset), "--drafters", f"ngram,{draft}",
               "--modes", "verify,forced", "--batch-sizes", "1,3", "--temperatures", "0,1", "--repeats", "1",
               "--max-tokens", "48", "--device", "cpu", "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "| B | T | drafter | mode | speculation | valid |" in printed
    assert "greedy outputs identical to constrained plain decoding: yes" in printed
    assert "finished outputs failing their constraint: 0" in printed
    result = json.loads(out.read_text())
    labels = ["plain", "none/forced", "ngram/verify", "ngram/forced", f"{draft}/verify", f"{draft}/forced"]
    assert list(result["configs"]) == labels
    assert result["configs"]["plain"] | {"load_s": 0} == {"drafter": None, "mode": "verify", "speculation": "static", "load_s": 0}
    assert [w["kind"] for w in result["workload"]] == ["json_schema", "regex", "grammar", "choice"]
    assert [(c["batch"], c["temperature"], c["requests"]) for c in result["cells"]] == [
        (1, 0.0, 4), (1, 1.0, 4), (3, 0.0, 6), (3, 1.0, 6)]  # 4 prompts cycled to two batches of 3
    assert result["outputs_identical"] is True and result["invalid_finished"] == []
    for cell in result["cells"]:
        assert cell["outputs_identical"] is (True if cell["temperature"] == 0 else None)
        assert list(cell["configs"]) == labels
        for name, c in cell["configs"].items():
            assert c["validity"] == 1.0 and c["invalid"] == 0 and c["outputs"] == cell["requests"], (name, c["invalid_examples"])
            assert c["truncated"] == 0
            assert c["tokens_per_s"] > 0 and c["engine_steps"] > 0 and c["step_ms"] > 0
            assert c["mask_ms_per_step"] > 0 and 0 < c["mask_fraction"] < 1  # every request is constrained
            assert c["tau"] >= 1
        plain = cell["configs"]["plain"]
        assert plain["speedup"] == 1.0 and plain["tau"] == 1.0 and plain["draft_tokens_per_step"] == 0
        assert cell["configs"]["none/forced"]["tau"] > 1  # JSON keys and punctuation are forced: drafted for free
    assert {"platform", "threads", "device"} <= set(result["machine"]) and result["wall_s"] > 0


def test_configurations_and_default_out():
    both = configurations(["eagle"], ["verify", "aware"], ["static", "adaptive"])
    assert list(both) == ["plain", "eagle/verify/static", "eagle/verify/adaptive", "eagle/aware/static", "eagle/aware/adaptive"]
    assert both["eagle/aware/adaptive"] == {"drafter": "eagle", "mode": "aware", "speculation": "adaptive"}
    assert list(configurations([], ["forced"], ["static"])) == ["plain", "none/forced"]
    assert default_out(datetime.date(2026, 11, 23)) == "evals/results/grammar-2026-11-23.json"


@pytest.mark.parametrize("args, message", [
    (["--drafters", "ngram,bogus"], "unknown drafter 'bogus'"),
    (["--modes", "verify,eager"], "--modes expects a comma-separated subset of verify, aware, forced"),
    (["--speculation", "dynamic"], "--speculation expects a comma-separated subset of static, adaptive"),
    (["--batch-sizes", "0"], "--batch-sizes must be integers >= 1"),
    (["--temperatures", "hot"], "--temperatures expects comma-separated numbers"),
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--out", "/nonexistent/dir/g.json"], "--out: the directory"),
    (["--dataset", "builtin:heldout-code", "--prompts", "1"], "has no constrained prompts"),
])
def test_bench_grammar_bad_input(llama_dir, capsys, args, message):
    rc = main(["bench", "grammar", "--model", str(llama_dir), "--drafters", "none", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_cut_off_outputs_count_as_invalid_not_as_bugs(llama_dir, dataset):
    import torch

    from specserve import LLM
    from specserve.evals.bench_grammar import StepCounter, _workload, measure_cell

    llm = LLM(llama_dir, drafter=None, device="cpu", grammar_drafting="verify")
    prompts = _workload(str(dataset), 1, llm.tokenizer)  # the JSON prompt: 3 tokens cannot close the object
    cell = measure_cell({"plain": llm}, {"plain": StepCounter(llm.engine)}, prompts, 1, 0.0, 3, 2, torch.device("cpu"))
    plain = cell["configs"]["plain"]
    assert plain["validity"] == 0.0 and plain["invalid"] == plain["truncated"] == plain["outputs"] == 2
    assert plain["invalid_finished"] == 0 and "not JSON" in plain["invalid_examples"][0]["why"]
    assert plain["engine_steps"] == 2 * 3  # per round: the prefill's step, then two decode steps
