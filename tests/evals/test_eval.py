"""`specserve eval` end to end on tiny models: τ of always-right/always-wrong drafters, outputs written,
interrupts keep finished results, the CLI with transformers peers, bad input exits 2 with one line."""

from __future__ import annotations

import json

import pytest
from cli_runner import cli, run

import scripted_drafter  # noqa: F401  (registers "scripted")
from specserve import LLM, SamplingParams
from specserve.evals.datasets import build_prompts, load_dataset
from specserve.evals.suite import EvalConfig, run_eval

TURNS = [("def f(x):", "class A:"), ("for i in range(10):",), ("import os",)]
DEPTH = 4
MAX_TOKENS = 1 + 3 * (DEPTH + 1)  # prefill's token, then three full steps: no step is cut short


def write_dataset(path, rows=TURNS, categories=("code", "code", "loops")):
    lines = [json.dumps({"question_id": i, "category": c, "turns": list(t)}) for i, (t, c) in enumerate(zip(rows, categories))]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "spec.jsonl", rows=[("def f(x):",), ("class A:",), ("import os",)])


@pytest.fixture(scope="module")
def references(llama_dir, dataset):
    """Prompt + plain greedy output of each prompt, exactly as the eval builds and runs them."""
    plain = LLM(llama_dir, device="cpu")
    prompts = build_prompts(load_dataset(str(dataset)), plain.tokenizer, answer=None)
    outs = plain.generate([list(p.token_ids) for p in prompts],
                          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [list(p.token_ids) + o.token_ids for p, o in zip(prompts, outs)]


def test_tau_of_always_right_is_depth_plus_one_and_always_wrong_is_one(llama_dir, dataset, references, tmp_path):
    options = {mode: {"mode": mode, "references": references, "max_budget": DEPTH} for mode in ("all_right", "all_wrong")}
    cfg = EvalConfig(drafters=["scripted#all_right", "scripted#all_wrong"], dataset=str(dataset), out=str(tmp_path / "out"),
                     model=str(llama_dir), max_tokens=MAX_TOKENS, repeats=2, batch_size=2, device="cpu", progress=False,
                     drafter_options={f"scripted#{m}": o for m, o in options.items()}, speculation="static")
    res = run_eval(cfg)
    right, wrong = res["drafters"]["scripted#all_right"], res["drafters"]["scripted#all_wrong"]
    assert right["tau"] == DEPTH + 1 and right["acceptance_per_position"] == [1.0] * DEPTH
    assert right["accept_length_histogram"] == [0.0] * DEPTH + [1.0]
    assert right["draft_tokens_per_step"] == DEPTH and right["accepted_tokens_per_step"] == DEPTH
    assert wrong["tau"] == 1 and wrong["acceptance_per_position"] == [0.0] * DEPTH and wrong["accepted_tokens_per_step"] == 0
    assert right["identical_fraction"] == wrong["identical_fraction"] == 1.0
    assert res["best_drafter"] in res["drafters"]
    assert res["tau"] == res["drafters"][res["best_drafter"]]["tau"]
    # batch 2 within a category: "code" has two prompts (one group), "loops" one
    assert set(right["per_category"]) == {"code", "loops"}
    assert right["per_category"]["code"]["prompts_done"] == 2 and right["per_category"]["loops"]["tau"] == DEPTH + 1
    assert right["speedup_spread"]["n"] == 2 and right["speedup"] > 0 and res["plain"]["tokens_per_s"] > 0
    assert res["status"] == "complete" and res["progress"]["measurements"] == res["progress"]["planned"] == 2 * 2 * 3
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text())["tau"] == res["tau"]
    report = (out / "report.md").read_text()
    assert "scripted#all_right" in report and "| plain |" in report
    for png in ("accept_length_hist.png", "acceptance_per_position.png", "speedup.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert {"python", "torch", "transformers", "specserve"} <= set(res["versions"])
    assert res["machine"]["cores"] >= 1 and res["machine"]["device"] == "cpu" and res["machine"]["cpu"]


def test_multi_turn_prompts_and_sampling(llama_dir, tmp_path):
    data = write_dataset(tmp_path / "mt.jsonl")
    res = run_eval(EvalConfig(drafters=["ngram"], dataset=str(data), out=str(tmp_path / "o"), model=str(llama_dir),
                              max_tokens=6, repeats=1, temperature=0.8, device="cpu", progress=False))
    assert [p["id"] for p in res["prompts"]] == ["0/turn1", "0/turn2", "1", "2"]
    turn1, turn2 = res["prompts"][:2]
    assert turn2["prompt_tokens"] > turn1["prompt_tokens"]  # turn 1 and its answer come first
    assert res["identical_fraction"] is None  # sampled: outputs need not match plain decoding
    assert res["drafters"]["ngram"]["tau"] >= 1


def test_every_timed_run_prefills_its_prompts_cold(llama_dir, tmp_path, monkeypatch):
    """No system skips a prompt's prefill from its prefix cache: not plain decoding, which wrote the earlier turns
    itself, and no system in a second repeat (each would otherwise time a different amount of work)."""
    calls = []
    generate = LLM.generate

    def recording(self, prompts, params=None, **kwargs):
        outs = generate(self, prompts, params, **kwargs)
        calls.append([o.num_cached_tokens for o in outs])
        return outs

    monkeypatch.setattr(LLM, "generate", recording)
    data = write_dataset(tmp_path / "mt.jsonl")
    res = run_eval(EvalConfig(drafters=["ngram"], dataset=str(data), out=str(tmp_path / "o"), model=str(llama_dir),
                              max_tokens=24, repeats=2, device="cpu", progress=False))
    timed = calls[-2 * len(res["prompts"]) * 2:]  # the last calls: 2 repeats x the prompts (one a group) x 2 systems
    assert max(p["prompt_tokens"] for p in res["prompts"]) > 32  # turn 2 spans whole cache blocks
    assert all(n == 0 for call in timed for n in call)
    # ... where a second run of the same prompt would have hit the cache (it is on by default)
    llm, prompt = LLM(llama_dir, drafter=None, device="cpu"), list(range(3, 63))
    first, second = (llm.generate([prompt], SamplingParams(max_tokens=2))[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0


def test_interrupt_keeps_finished_results_and_exits_130(llama_dir, dataset, tmp_path, monkeypatch, capsys):
    from specserve.cli import main
    from specserve.evals.summary import RunData

    original, calls = RunData.record, []

    def record(self, *args, **kwargs):
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(args[0])
        original(self, *args, **kwargs)

    monkeypatch.setattr(RunData, "record", record)
    out = tmp_path / "out"
    rc = main(["eval", "--model", str(llama_dir), "--drafter", "ngram", "--dataset", str(dataset), "--max-tokens", "5",
               "--repeats", "1", "--device", "cpu", "--out", str(out)])
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "interrupted" and res["progress"]["measurements"] == 4
    assert res["drafters"]["ngram"]["prompts_done"] == 2 and res["drafters"]["ngram"]["speedup"] is not None
    assert (out / "report.md").exists()


def test_cli_with_transformers_peers(capsys, llama_dir, dataset, tmp_path):
    from tiny_models import build_model

    draft = build_model(tmp_path / "draft", "llama", layers=1, hidden_size=32, heads=2, kv_heads=1, seed=1, init_std=0.2)
    out = tmp_path / "out"
    res = cli(capsys, "eval", "--model", str(llama_dir), "--drafter", "ngram", "--drafter-option", "ngram:depth=3",
              "--dataset", str(dataset), "--max-prompts", "2", "--max-tokens", "8", "--repeats", "1",
              "--peers", "transformers,transformers-prompt-lookup,transformers-assisted", "--peer-draft", str(draft),
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "| transformers-assisted |" in res.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["drafter_options"] == {"ngram": {"depth": 3}}
    assert results["best_drafter"] == "ngram" and len(results["prompts"]) == 2
    assert len(results["acceptance_per_position"]) <= 3
    for name in ("transformers", "transformers-prompt-lookup", "transformers-assisted"):
        peer = results["peers"][name]
        assert peer["tokens_per_s"] > 0 and peer["best_drafter_over_peer"] > 0 and peer["prompts_done"] == 2
        assert results["drafters"]["ngram"]["over_peers"][name] == pytest.approx(peer["best_drafter_over_peer"])
    assert results["peers"]["transformers"]["identical_fraction"] == 1.0  # same weights, same greedy tokens


def test_cli_bad_input_exits_2_with_one_line(llama_dir, dataset, tmp_path):
    """In a process of its own: the exit status and stderr a shell sees."""
    res = run("eval", "--model", str(llama_dir), "--drafter", "ngram", "--dataset", "builtin:nope", "--out", str(tmp_path))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and "unknown dataset builtin" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--dataset", "builtin:nope"], "unknown dataset builtin 'nope'"),
    (["--dataset", "{empty}"], "is empty"),
    (["--dataset", "{bad}"], "line 2 (invalid JSON"),
    (["--peers", "transformers,vllm"], "unknown peer(s) 'vllm'"),
    (["--peers", "transformers-assisted"], "needs a draft model: pass --peer-draft"),
    (["--drafter", "nope"], "drafter 'nope' failed to load: unknown drafter"),
    (["--drafter", "draft:/no/such/dir"], "drafter 'draft:/no/such/dir' failed to load"),
    (["--drafter-option", "other:depth=2"], "not one of --drafter"),
    (["--drafter-option", "ngram:bogus=2"], "unknown option(s) ['bogus']"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--drafter", "ngram"], "--drafter specs must be distinct"),
])
def test_bad_input_exits_2_with_one_line(llama_dir, dataset, tmp_path, capsys, args, message):
    from specserve.cli import main

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["x"]}) + "\n{oops\n")
    args = [a.replace("{empty}", str(tmp_path / "empty.jsonl")).replace("{bad}", str(tmp_path / "bad.jsonl")) for a in args]
    base = ["eval", "--model", str(llama_dir), "--drafter", "ngram", "--dataset", str(dataset), "--max-tokens", "4",
            "--repeats", "1", "--device", "cpu", "--out", str(tmp_path / "out")]
    rc = main(base + args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_skip_bad_lines_runs(llama_dir, dataset, tmp_path, capsys):
    from specserve.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(dataset.read_text() + "{oops\n")
    rc = main(["eval", "--model", str(llama_dir), "--drafter", "ngram", "--dataset", str(bad), "--max-prompts", "1",
               "--max-tokens", "4", "--repeats", "1", "--device", "cpu", "--on-bad-line", "skip", "--out", str(tmp_path / "o")])
    assert rc == 0
    assert "skipped 1 malformed line(s): line 4" in capsys.readouterr().err
