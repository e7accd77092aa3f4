"""`specserve bench startup`: where a command's first seconds go, each measured in fresh processes.

Figures (median, min and max of `--repeats` runs; every run a new `python -m specserve` process, timed
from just before it is spawned):

- generate: process start → first token on stdout (`generate --quiet`, greedy, plain or the default
  drafter), and → exit;
- serve: process start → `GET /health` answers 200 (polled every 20 ms), the server's "ready";
- argument errors: process start → exit status 2, for a few bad inputs of `generate` and `serve`;
- imports: `import torch` alone, then the rest of what loading a model imports (numba, the engine,
  transformers' config and tokenizer classes), in one fresh interpreter;
- LLM(): its whole construction in a fresh process, and inside it the engine's kernel warm-up and the
  adaptive policy's calibration (`engine.warmup_s`, `engine.calibration_s`);
- decode tokens/s of the default generate (`--json`, 64 tokens, EOS ignored), so a thread setting that
  starts faster but decodes slower shows;
- with `--cold`: the same generate once with an empty numba cache (`NUMBA_CACHE_DIR` pointed at a new
  directory): what a first run on a fresh install compiles, and how long it takes.

`--neighbour` runs one CPU-bound process beside every measurement (a busy machine); `--threads` is
passed to generate, serve and LLM(). It prints figures; it asserts nothing about them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from specserve.evals.common import median_spread, write_json

PROMPT = "def fibonacci(n):"
BAD_INPUTS = (
    ("generate --temperature -1", ["generate", "--prompt", "x", "--temperature", "-1"]),
    ("generate --max-tokens abc", ["generate", "--prompt", "x", "--max-tokens", "abc"]),
    ("generate --model /no/such/dir", ["generate", "--model", "/no/such/dir", "--prompt", "x"]),
    ("serve --threads 0", ["serve", "--threads", "0"]),
)
IMPORTS = """
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import numba, specserve.llm
from transformers import AutoConfig, AutoTokenizer
t2 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "rest_s": t2 - t1}))
"""
CONSTRUCT = """
import json, sys, time
t0 = time.perf_counter()
from specserve import LLM
t1 = time.perf_counter()
llm = LLM(threads=None if sys.argv[1] == "auto" else int(sys.argv[1]))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1, "drafter": llm.drafter_spec,
                  "warmup_s": getattr(llm.engine, "warmup_s", None),
                  "calibration_s": getattr(llm.engine, "calibration_s", None)}))
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per figure (default 3)")
    p.add_argument("--threads", type=int, default=None, help="passed to generate, serve and LLM() (default: theirs)")
    p.add_argument("--drafter", default="auto", help="generate's and serve's drafter (default: auto, as a user runs them)")
    p.add_argument("--cold", action="store_true",
                   help="also run generate once with an empty numba cache: the first run on a fresh install")
    p.add_argument("--neighbour", action="store_true", help="keep one CPU-bound process running beside each measurement")
    p.add_argument("--skip", action="append", default=[], choices=("generate", "serve", "errors", "imports", "llm", "decode"),
                   help="leave a figure out (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one process may take")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures here")


def _specserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "specserve", *args]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    return env


def _threads_args(args) -> list[str]:
    return ["--threads", str(args.threads)] if args.threads is not None else []


def time_first_token(args, env: dict | None = None) -> dict:
    """Spawn `generate --quiet` (greedy, 8 tokens): seconds to its first stdout byte and to its exit."""
    cmd = _specserve("generate", "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "8", "--quiet",
                     "--drafter", args.drafter, *_threads_args(args))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(env), bufsize=0)
    first = proc.stdout.read(1)
    first_s = time.perf_counter() - start
    rest, err = proc.communicate(timeout=args.timeout)
    exit_s = time.perf_counter() - start
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"generate failed ({proc.returncode}): {err.decode(errors='replace').strip()[-400:]}")
    return {"first_token_s": first_s, "exit_s": exit_s}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_serve_ready(args) -> float:
    """Spawn `serve` on a free port; seconds until GET /health answers 200. The server is then stopped."""
    port = _free_port()
    cmd = _specserve("serve", "--port", str(port), "--drafter", args.drafter, "--log-level", "warning",
                     *_threads_args(args))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited ({proc.returncode}): {proc.stderr.read().decode(errors='replace')[-400:]}")
            if time.perf_counter() - start > args.timeout:
                raise RuntimeError("serve did not become ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.02)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_argument_error(argv: list[str], timeout: float) -> float:
    start = time.perf_counter()
    res = subprocess.run(_specserve(*argv), capture_output=True, timeout=timeout, env=_env())
    elapsed = time.perf_counter() - start
    if res.returncode != 2:
        raise RuntimeError(f"{argv} exited {res.returncode}, expected 2: {res.stderr.decode(errors='replace')[-300:]}")
    return elapsed


def _child_json(code: str, *argv: str, timeout: float, env: dict | None = None) -> dict:
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                         env=_env(env))
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip()[-400:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def decode_speed(args) -> dict:
    cmd = _specserve("generate", "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "64", "--ignore-eos",
                     "--drafter", args.drafter, "--json", *_threads_args(args))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=_env())
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip()[-400:])
    out = json.loads(res.stdout)
    return {"tokens_per_s": out["tokens_per_s"], "tau": out["tau"]}


def cold_run(args) -> dict:
    """generate once with an empty numba cache: seconds to the first token, and what got compiled."""
    with tempfile.TemporaryDirectory(prefix="specserve-numba-") as cache:
        figures = time_first_token(args, {"NUMBA_CACHE_DIR": cache})
        entries = sorted({p.name.split("-")[0].split(".", 1)[-1] for p in Path(cache).rglob("*.nbi")})
        modules = sorted({p.parent.name for p in Path(cache).rglob("*.nbi")})
    return {**figures, "compiled_functions": entries, "cache_dirs": modules}


@contextmanager
def neighbour(enabled: bool):
    """One CPU-bound process beside the measurement (a busy machine), or nothing."""
    if not enabled:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def _stats(values: list[float]) -> dict:
    return median_spread(values) | {"runs": values}  # the values themselves, not only their count


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    result: dict = {"threads": args.threads if args.threads is not None else "default", "drafter": args.drafter,
                    "neighbour": args.neighbour, "repeats": args.repeats, "python": sys.version.split()[0],
                    "cores": os.cpu_count()}
    rows: list[tuple[str, dict | None, str]] = []
    with neighbour(args.neighbour):
        if args.cold:
            cold = cold_run(args)
            result["cold_generate"] = cold
            rows.append(("generate, first run (empty numba cache): first token", _stats([cold["first_token_s"]]), "s"))
        if "generate" not in args.skip:
            time_first_token(args)  # the kernels in numba's cache, the files in the page cache
            runs = [time_first_token(args) for _ in range(args.repeats)]
            result["generate_first_token_s"] = _stats([r["first_token_s"] for r in runs])
            result["generate_exit_s"] = _stats([r["exit_s"] for r in runs])
            rows.append(("generate: process start -> first token", result["generate_first_token_s"], "s"))
            rows.append(("generate: process start -> exit (8 tokens)", result["generate_exit_s"], "s"))
        if "serve" not in args.skip:
            result["serve_ready_s"] = _stats([time_serve_ready(args) for _ in range(args.repeats)])
            rows.append(("serve: process start -> /health 200", result["serve_ready_s"], "s"))
        if "errors" not in args.skip:
            result["argument_errors_s"] = {}
            for label, argv in BAD_INPUTS:
                figures = _stats([time_argument_error(argv, args.timeout) for _ in range(args.repeats)])
                result["argument_errors_s"][label] = figures
                rows.append((f"argument error: {label}", figures, "s"))
        if "imports" not in args.skip:
            runs = [_child_json(IMPORTS, timeout=args.timeout) for _ in range(args.repeats)]
            result["import_torch_s"] = _stats([r["torch_s"] for r in runs])
            result["import_rest_s"] = _stats([r["rest_s"] for r in runs])
            rows.append(("import torch", result["import_torch_s"], "s"))
            rows.append(("import the rest (numba, engine, transformers)", result["import_rest_s"], "s"))
        if "llm" not in args.skip:
            threads = str(args.threads) if args.threads is not None else "auto"
            runs = [_child_json(CONSTRUCT, threads, timeout=args.timeout) for _ in range(args.repeats)]
            result["llm_init_s"] = _stats([r["llm_s"] for r in runs])
            rows.append((f"LLM() (drafter {runs[0]['drafter']}), after imports", result["llm_init_s"], "s"))
            if runs[0]["warmup_s"] is not None:
                result["warmup_s"] = _stats([r["warmup_s"] for r in runs])
                result["calibration_s"] = _stats([r["calibration_s"] for r in runs])
                rows.append(("  of which kernel warm-up", result["warmup_s"], "s"))
                rows.append(("  of which calibrating speculation", result["calibration_s"], "s"))
        if "decode" not in args.skip:
            runs = [decode_speed(args) for _ in range(args.repeats)]
            result["decode_tokens_per_s"] = _stats([r["tokens_per_s"] for r in runs])
            rows.append(("decode tokens/s (64 tokens, greedy)", result["decode_tokens_per_s"], "tok/s"))
    print(f"specserve bench startup: threads {result['threads']}, drafter {args.drafter}, "
          f"{'one busy neighbour process' if args.neighbour else 'no neighbour process'}, "
          f"{args.repeats} fresh processes per figure, {result['cores']} cores")
    print("| figure | median | min | max |")
    print("|---|---|---|---|")
    for label, figures, unit in rows:
        fmt = (lambda v: f"{v:.0f}") if unit == "tok/s" else (lambda v: f"{v:.2f} s")
        print(f"| {label} | {fmt(figures['median'])} | {fmt(figures['min'])} | {fmt(figures['max'])} |")
    if args.cold:
        compiled = result["cold_generate"]["compiled_functions"]
        print(f"first run compiled {len(compiled)} cached functions: {', '.join(compiled)}")
    write_json(result, args.json)
    return 0
