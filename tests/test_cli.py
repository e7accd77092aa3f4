"""The `specserve` CLI: bad input exits 2 with one line and no traceback. `run` starts a real process, `cli` calls
the same `main()` in this one (tests/cli_runner.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from cli_runner import cli, run
from tiny_models import cli_env


def test_generate_json(capsys, llama_dir):
    res = cli(capsys, "generate", "--model", str(llama_dir), "--drafter", "ngram", "--prompt", "def f(x):",
              "--max-tokens", "12", "--ignore-eos", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    assert out["spec"]["num_steps"] >= 1 and out["spec"]["mean_accepted_length"] >= 1.0
    assert isinstance(out["text"], str)
    assert out["tau"] == out["spec"]["mean_accepted_length"] and 0 < out["ttft_s"] <= out["e2e_s"]
    assert out["tokens_per_s"] == pytest.approx(11 / (out["e2e_s"] - out["ttft_s"]))


def test_generate_streams_text(llama_dir):
    """stdout (a pipe here) is the completion alone — the prompt is echoed only on a terminal — ending with one
    newline; one summary line on stderr. Progress lines are for terminals only: a pipe gets none."""
    res = run("generate", "--model", str(llama_dir), "--prompt", "class A:", "--max-tokens", "8", "--temperature", "0.7", "--seed", "3")
    assert res.returncode == 0, res.stderr
    assert not res.stdout.startswith("class A:") and res.stdout.endswith("\n") and not res.stdout.endswith("\n\n")
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert all(field in lines[0] for field in ("8 tokens (length)", "tokens/s", "TTFT", "plain decoding")), lines[0]
    quiet = run("generate", "--model", str(llama_dir), "--prompt", "class A:", "--max-tokens", "8", "--temperature", "0.7",
                "--seed", "3", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == res.stdout


def test_generate_compare_reports_plain_speed_and_identical_greedy_output(capsys, llama_dir):
    args = ["generate", "--model", str(llama_dir), "--drafter", "ngram", "--prompt", "x = [1, 2, 3]\n" * 4,
            "--max-tokens", "12", "--ignore-eos", "--temperature", "0", "--threads", "1", "--compare"]
    res = cli(capsys, *args)
    assert res.returncode == 0, res.stderr
    summary = res.stderr.strip().splitlines()[-1]
    for field in ("12 tokens (length)", "TTFT", "drafter ngram (adaptive speculation)", "τ", "tokens/s vs plain decoding",
                  "x (median of 5 runs each)", "greedy outputs identical"):
        assert field in summary, summary
    out = json.loads(cli(capsys, *args, "--json").stdout)
    compare = out["compare"]
    assert compare["identical"] is True and compare["runs"] == 5
    assert compare["speedup"] == pytest.approx(compare["tokens_per_s"] / compare["plain_tokens_per_s"])
    plain = cli(capsys, "generate", "--model", str(llama_dir), "--drafter", "none", "--prompt", "x", "--max-tokens", "4",
                "--compare")
    assert res.returncode == 0 and "plain decoding already" in plain.stderr


def test_help_and_argument_errors_do_not_import_torch():
    """`specserve --help` and bad arguments answer without importing torch (~1 s of every start): argparse's
    errors, and the values `generate` and `serve` check before loading anything (sampling ranges, a
    missing model directory, thread counts, ports, drafter options, a missing schema file)."""
    code = ("import sys\nfrom specserve.cli import main\n"
            "for argv in (['--help'], ['generate', '--max-tokens', 'abc', '--prompt', 'x'], ['serve', '--help'],"
            " ['chat', '--port'], ['bench', '--help'], ['generate', '--regex', 'a', '--choice', 'b', '--prompt', 'x'],"
            " ['generate', '--grammar-drafting', 'x', '--prompt', 'x'], ['serve', '--grammar-drafting', 'x'],"
            " ['generate', '--prompt', 'x', '--temperature', '-1'], ['generate', '--prompt', 'x', '--top-p', '1.5'],"
            " ['generate', '--prompt', 'x', '--max-tokens', '0'], ['generate', '--prompt', ''],"
            " ['generate', '--model', '/no/such/dir', '--prompt', 'x'], ['generate', '--prompt', 'x', '--threads', '0'],"
            " ['generate', '--prompt', 'x', '--drafter-option', 'depth'], ['generate', '--prompt', 'x', '--json-schema', '/no/such.json'],"
            " ['serve', '--threads', '0'], ['serve', '--model', '/no/such/dir'], ['serve', '--port', '70000']):\n"
            "    try:\n        code = main(argv)\n    except SystemExit as e:\n        code = e.code\n"
            "    assert code in (0, 2), (argv, code)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nprint('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr


def test_every_eval_and_bench_argument_error_answers_without_torch():
    """An unknown option to `eval` or any `bench` command is argparse's error, before torch is imported
    (each bench module imports torch inside the functions that run it)."""
    from specserve.cli import BENCH_COMMANDS

    argvs = [["eval", "--bogus"], ["info", "--bogus"]] + [["bench", name, "--bogus"] for name in BENCH_COMMANDS
                                                          if name != "gpu"]
    code = ("import sys\nfrom specserve.cli import main\n"
            f"for argv in {argvs!r}:\n"
            "    try:\n        code = main(argv)\n    except SystemExit as e:\n        code = e.code\n"
            "    assert code == 2, (argv, code)\n"
            "    assert 'torch' not in sys.modules, ('torch was imported', argv)\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_a_multi_line_error_is_shown_whole_on_one_line(capsys, tmp_path):
    from tiny_models import build_model

    model = build_model(tmp_path / "m", "llama")
    (model / "tokenizer.json").write_text("{ this is not a tokenizer")
    res = cli(capsys, "generate", "--model", str(model), "--prompt", "x")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    line = res.stderr.strip()
    assert "cannot load the tokenizer" in line and not line.rstrip().endswith(":")
    assert len(line.split("cannot load the tokenizer", 1)[1]) > len(str(model)) + 10  # the cause is there


def test_info_json(capsys):
    res = cli(capsys, "info", "--json")
    assert res.returncode == 0
    info = json.loads(res.stdout)
    assert "ngram" in info["drafters"] and info["version"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
        (["generate", "--model", "{model}", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", "--model", "{model}", "--prompt", "x", "--top-p", "1.5"], "top_p"),
        (["generate", "--model", "{model}", "--prompt", "", "--max-tokens", "3"], "empty"),
        (["generate", "--model", "{model}", "--prompt", "x", "--drafter", "nope"], "unknown drafter"),
        (["generate", "--model", "{model}", "--prompt", "x", "--drafter-option", "depth"], "KEY=VALUE"),
        (["generate", "--model", "{model}", "--prompt", "x", "--max-tokens", "abc"], "invalid int"),
        (["generate", "--model", "{model}"], "required"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_line(llama_dir, args, message):
    res = run(*[a.replace("{model}", str(llama_dir)) for a in args])
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert message in lines[0]
    assert "Traceback" not in res.stderr


def test_prompt_past_context_exits_2(capsys, tmp_path):
    from tiny_models import build_model

    model = build_model(tmp_path / "m", "llama", max_positions=16)
    res = cli(capsys, "generate", "--model", str(model), "--prompt", "def f(x): return x + 1 " * 10)
    assert res.returncode == 2 and "context window" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_generate_without_the_default_model_or_a_network_exits_2_saying_what_to_run(tmp_path):
    """No model named, the default model not in the cache, and pip reaching no index: one line that says to run
    `specserve pull` where there is a network (or to name a model)."""
    env = cli_env(SPECSERVE_CACHE_DIR=str(tmp_path), PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0",
                  PIP_TIMEOUT="2")
    env.pop("SPECSERVE_MODEL"), env.pop("PIP_NO_INDEX")
    res = subprocess.run([sys.executable, "-m", "specserve", "generate", "--prompt", "x"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("specserve: error: could not fetch the default model") and "specserve pull" in last
    assert "Traceback" not in res.stderr and not (tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def readme_main_command() -> list[str]:
    """The arguments of README's main command (the `specserve generate ...` ending its set-up line)."""
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("python3 -m venv") and "specserve generate" in line)
    command = line.split("&& specserve ", 1)[1]
    assert any(other.startswith(f"specserve {command}   # the main command") for other in readme.splitlines()), \
        "the Command line section shows another main command than the set-up line"
    return shlex.split(command)


def test_readme_main_command_shows_a_greedy_answer_and_its_summary():
    """README's main command, as written (on the tiny model: the tests never fetch the default one): the prompt
    is a chat turn, stdout (a pipe here) is the answer alone, then one summary line on stderr with tokens,
    tokens/s, TTFT, the drafter, τ and the speedup measured on the spot over plain decoding, whose greedy output
    is the same."""
    args = readme_main_command()
    assert args[0] == "generate" and "--compare" in args and args[args.index("--temperature") + 1] == "0"
    assert "--model" not in args  # the default model
    prompt = args[args.index("--prompt") + 1]
    res = run(*args)
    assert res.returncode == 0, res.stderr
    assert not res.stdout.startswith(prompt) and res.stdout.endswith("\n") and res.stdout.strip()
    summary = res.stderr.strip().splitlines()[-1]
    for field in ("tokens (", "TTFT", "drafter ", "τ", "tokens/s vs plain decoding", "x (median of 5 runs each)",
                  "greedy outputs identical"):
        assert field in summary, summary


def test_the_tiny_model_runs_with_its_measured_default_drafter(capsys):
    """`--model tiny`: the bundled 9M code model with its default drafter (the one the bundle's MANIFEST records
    as measured fastest); --raw completes code as it is."""
    res = cli(capsys, "generate", "--model", "tiny", "--raw", "--prompt", "def fibonacci(n):", "--max-tokens", "16",
              "--ignore-eos", "--temperature", "0", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["token_ids"]) == 16 and out["spec"]["num_steps"] >= 1 and out["chat"] is False
    info = json.loads(cli(capsys, "info", "--json").stdout)
    assert info["tiny_model"] and {"draft", "medusa", "eagle"} <= set(info["default_drafters"])
    assert info["default_model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    from specserve.bundle_paths import bundle_manifest

    assert out["drafter"] == bundle_manifest()["default_drafter"]
    plain = json.loads(cli(capsys, "generate", "--model", "tiny", "--raw", "--drafter", "none", "--prompt",
                           "def fibonacci(n):", "--max-tokens", "16", "--ignore-eos", "--temperature", "0", "--json").stdout)
    assert plain["drafter"] is None and plain["token_ids"] == out["token_ids"]


def test_generate_wraps_the_prompt_in_the_chat_template_and_keeps_stdout_the_completion(capsys, tmp_path):
    """A model with a chat template: --prompt is one user turn (after --system), as transformers' template renders
    it; --raw completes the bare text. stdout is the completion alone (not a terminal), and with a constraint
    it parses: `generate --json-schema ... > out.json` gives a JSON file."""
    from transformers import AutoTokenizer

    from specserve.bundle_paths import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat = json.loads(cli(capsys, "generate", "--model", "tiny", "--system", "Be brief.", "--prompt", "def f(x):",
                          "--max-tokens", "4", "--temperature", "0", "--json").stdout)
    assert chat["chat"] is True and chat["prompt_token_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    raw = json.loads(cli(capsys, "generate", "--model", "tiny", "--raw", "--prompt", "def f(x):", "--max-tokens", "4",
                         "--temperature", "0", "--json").stdout)
    assert raw["prompt_token_ids"] == tok("def f(x):")["input_ids"]
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}'
    res = cli(capsys, "generate", "--model", "tiny", "--raw", "--prompt", "# config: ", "--json-schema", schema,
              "--max-tokens", "32", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert set(json.loads(res.stdout)) == {"n"}
    bad = cli(capsys, "generate", "--model", "tiny", "--raw", "--system", "x", "--prompt", "y")
    assert bad.returncode == 2 and "--system" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_bench_startup_prints_its_figures(tmp_path):
    """`specserve bench startup` runs and prints every figure it was asked for (no timing is asserted)."""
    res = run("bench", "startup", "--repeats", "1", "--skip", "serve", "--skip", "decode", "--threads", "1",
              "--json", str(tmp_path / "s.json"))
    assert res.returncode == 0, res.stderr
    for label in ("generate: process start -> first token", "argument error: generate --temperature -1",
                  "argument error: serve --threads 0", "import torch", "LLM()", "calibrating speculation"):
        assert label in res.stdout, res.stdout
    figures = json.loads((tmp_path / "s.json").read_text())
    assert figures["generate_first_token_s"]["median"] > 0 and figures["calibration_s"]["median"] > 0


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_bench_drafters_smoke(capsys, tmp_path, quantization):
    res = cli(capsys, "bench", "drafters", "--prompts", "1", "--max-tokens", "8", "--repeats", "1", "--drafter", "ngram",
              "--json", str(tmp_path / "r.json"), *(["--quantization", quantization] if quantization else []))
    assert res.returncode == 0, res.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["quantization"] == quantization
    assert result["drafters"]["ngram"]["identical_to_plain"] is True
    assert result["drafters"]["ngram"]["tau"] >= 1.0
    ngram = result["drafters"]["ngram"]
    assert result["plain_kernel_s"] > 0 and ngram["kernel_s"] > 0
    assert ngram["roofline_speedup"] == result["plain_kernel_s"] / ngram["kernel_s"]
    assert ngram["efficiency"] == ngram["speedup"] / ngram["roofline_speedup"]


def test_kernel_clock_counts_the_target_and_drafter_forwards(small_vocab_dir, near_draft_dir):
    """bench drafters' roofline: the clock sees every target and draft-model forward, and only those."""
    from specserve.evals.bench_drafters import KernelClock

    from specserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(small_vocab_dir, drafter=f"draft:{near_draft_dir}", device="cpu", speculation="static")
    ref = llm.generate([[3, 1, 4]], params)[0].token_ids
    calls, inside = {"target": 0, "draft": 0}, [0.0]
    for name, model in (("target", llm.model), ("draft", llm.engine.drafter.model)):
        forward = model.forward

        def counted(*args, _forward=forward, _name=name, **kwargs):
            calls[_name] += 1
            t0 = time.perf_counter()
            out = _forward(*args, **kwargs)
            inside[0] += time.perf_counter() - t0
            return out
        model.forward = counted
    clock = KernelClock(llm)  # wraps outside the counters: each of its intervals holds one of theirs
    assert clock.seconds == 0
    t0 = time.perf_counter()
    out = llm.generate([[3, 1, 4]], params)[0]
    wall = time.perf_counter() - t0
    assert out.token_ids == ref and calls["target"] == out.spec.num_steps + 1 and calls["draft"] > out.spec.num_steps
    assert inside[0] <= clock.seconds < wall


# ---- structured output ------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


def generate_in_process(capsys, llama_dir, *args: str) -> dict:
    """`specserve generate ... --json` through the same main() the console script runs."""
    res = cli(capsys, "generate", "--model", str(llama_dir), "--prompt", "hello", "--max-tokens", "64", "--threads", "1",
              *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_generate_json_schema_from_a_file_and_inline(capsys, llama_dir, tmp_path):
    schema_file = tmp_path / "ab.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for source in (str(schema_file), json.dumps(SCHEMA)):
        for extra in (["--temperature", "0"], ["--temperature", "1", "--seed", "5", "--drafter", "ngram"]):
            out = generate_in_process(capsys, llama_dir, "--json-schema", source, *extra)
            assert out["finish_reason"] == "stop", out["text"]
            obj = json.loads(out["text"])
            assert set(obj) == {"a", "b"} and 0 <= obj["a"] <= 999 and isinstance(obj["b"], bool), out["text"]


@pytest.mark.parametrize("drafting", ["forced", "aware", "verify"])
def test_generate_regex_grammar_and_choice(capsys, llama_dir, tmp_path, drafting):
    import re

    lark = tmp_path / "g.lark"
    lark.write_text('start: "x" NUM\nNUM: /[0-9]{1,3}/\n')
    common = ["--drafter", "ngram", "--grammar-drafting", drafting]
    out = generate_in_process(capsys, llama_dir, "--regex", "[a-z]{3}-[0-9]{2}", *common)
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", out["text"]) and out["finish_reason"] == "stop", out["text"]
    out = generate_in_process(capsys, llama_dir, "--grammar", str(lark), *common)
    assert re.fullmatch("x[0-9]{1,3}", out["text"]) and out["finish_reason"] == "stop", out["text"]
    out = generate_in_process(capsys, llama_dir, "--choice", "red", "--choice", "green", "--temperature", "1", *common)
    assert out["text"] in ("red", "green") and out["finish_reason"] == "stop"


def test_generate_streams_constrained_text(capsys, llama_dir):
    res = cli(capsys, "generate", "--model", str(llama_dir), "--prompt", "hi", "--threads", "1", "--max-tokens", "64",
              "--json-schema", json.dumps(SCHEMA), "--json-whitespace", "compact", "--quiet")
    assert res.returncode == 0, res.stderr
    obj = json.loads(res.stdout)
    assert set(obj) == {"a", "b"}


@pytest.mark.parametrize("args, message", [
    (["--json-schema", '{"type": "nope"}'], "invalid json_schema"),
    (["--json-schema", "{not json"], "not valid JSON"),
    (["--json-schema", "/no/such/schema.json"], "neither a file nor inline JSON"),
    (["--json-schema", "{badjson}"], "bad.json is not valid JSON"),
    (["--regex", "(("], "invalid regex"),
    (["--grammar", "/no/such/grammar.lark"], "no such file"),
    (["--grammar", "{lark}"], "invalid grammar"),
    (["--choice", ""], "choice"),
])
def test_bad_constraints_exit_2_with_one_line(capsys, llama_dir, tmp_path, args, message):
    from specserve.cli import main

    (tmp_path / "bad.lark").write_text("start: nope\n")
    (tmp_path / "bad.json").write_text('{"type": "object",')
    args = [a.replace("{lark}", str(tmp_path / "bad.lark")).replace("{badjson}", str(tmp_path / "bad.json")) for a in args]
    assert main(["generate", "--model", str(llama_dir), "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("args, message", [
    (["--regex", "a", "--choice", "b"], "not allowed with"),
    (["--json-schema", "{}", "--grammar", "g.lark"], "not allowed with"),
    (["--json-whitespace", "wide", "--regex", "a"], "invalid choice"),
    (["--grammar-drafting", "eager"], "invalid choice"),
])
def test_conflicting_constraint_arguments_exit_2_with_one_line(capsys, args, message):
    from specserve.cli import main

    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "x", *args])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_grammar_drafting_reaches_serve_and_generate():
    from specserve.cli import build_parser

    for command in (["serve"], ["generate", "--prompt", "x"]):
        argv = [*command, "--grammar-drafting", "aware"]
        assert build_parser(argv).parse_args(argv).grammar_drafting == "aware"
        assert build_parser(command).parse_args(command).grammar_drafting == "forced"


def test_info_drafter_prints_what_was_detected(capsys):
    """`specserve info --drafter KIND[:PATH]`: the target's architecture and context, and what the drafter's
    files are (format, version, heads, LM head, feature layers); a hybrid lists its parts."""
    medusa = json.loads(cli(capsys, "info", "--drafter", "medusa", "--json").stdout)
    assert medusa["model_type"] == "llama" and medusa["rope"] == "default" and medusa["max_model_len"] == 512
    d = medusa["drafter"]
    assert d["drafter"] == "medusa" and d["heads"] == "3" and d["lm head"] == "shared: the target's"
    assert d["fits the target"] == "yes"
    hybrid = json.loads(cli(capsys, "info", "--drafter", "hybrid:suffix+eagle", "--json").stdout)["drafter"]
    assert set(hybrid["parts"]) == {"suffix", "eagle"} and hybrid["parts"]["eagle"]["needs_target_features"] == [1, 3, 5]
    text = cli(capsys, "info", "--drafter", "eagle")
    assert text.returncode == 0 and "drafter:" in text.stdout and "path:" in text.stdout
    bad = cli(capsys, "info", "--drafter", "eagle:/nonexistent")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "/nonexistent" in bad.stderr


def test_convert_writes_a_public_layout_and_refuses_bad_input(capsys, tmp_path):
    res = cli(capsys, "convert", "--drafter", "eagle", "--to", "eagle3-speculators", "--out", str(tmp_path / "spec"))
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    info = json.loads(cli(capsys, "info", "--drafter", f"eagle:{tmp_path / 'spec'}", "--json").stdout)
    assert info["drafter"]["format"] == "speculators eagle3"
    bad = cli(capsys, "convert", "--drafter", "ngram", "--to", "specserve", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no weights" in bad.stderr


def test_chat_without_a_server_says_to_start_one():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run("chat", "--url", f"ws://127.0.0.1:{port}/v1/ws")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "cannot connect" in res.stderr and "no server is running" in res.stderr and "specserve serve" in res.stderr
