"""`specserve bench serve`: N concurrent clients against a real `specserve serve` over loopback.

The server runs in its own process (as users run it); the clients share one asyncio loop in this
process. ``--api`` picks the protocols measured against the same server, one after another at each
level: ``websocket`` (the /v1/ws protocol) and ``openai`` (POST /v1/completions streamed as
server-sent events, with vLLM's ``stream_options.continuous_usage_stats`` so each chunk's token count
is known). Each client sends its requests one after another (closed loop), greedy with ``ignore_eos``
so every response has the same length. Per level of concurrency and API it reports, at p50 and p99:

- TTFT as the client sees it (send → first delta);
- inter-token latency: the gap between consecutive deltas divided by the tokens the later one carries;
- tokens/s of each response after its first token, and the aggregate output tokens/s;
- server overhead = client TTFT − engine TTFT (``response.done`` timing.engine_ttft_ms: the engine's own
  add_request → first token, as LLM.generate reports it). It is everything the server adds: the
  websocket frames both ways, JSON, tokenizing, the hand-offs to and from the engine thread, and
  waiting for the running step to end before the new request can join the batch.

Overhead is computed over responses whose first delta carried exactly one token (the prefill token):
when a tokenizer holds the first token's text back (an incomplete UTF-8 character), the first delta
comes a step later and would count a decode step as overhead.

``--pacing`` measures paced streaming on the websocket at concurrency 1 (and the highest level):
``stream_pacing`` off vs smooth, the coefficient of variation of the gaps between tokens as the
client sees them (tokens of one delta arrive together: gap 0), and the added end-to-end latency (how
long after the engine finished the last token arrives, paced minus unpaced) against the step time.
It needs a drafter that speculates: e.g. ``--model embedded --drafter eagle``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from specserve.evals.common import host, use_model_dir, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory, or 'embedded' for the bundled default model "
                                               "(default: a small random-weight Llama with a BPE tokenizer, built on the fly)")
    p.add_argument("--api", default="websocket,openai", help="comma-separated: websocket, openai (default: both)")
    p.add_argument("--pacing", action="store_true", help="also measure stream_pacing off vs smooth (websocket)")
    p.add_argument("--drafter", default=None, help="drafter spec for the server (default: none)")
    p.add_argument("--concurrency", default="1,8", help="comma-separated client counts (default: 1,8)")
    p.add_argument("--requests", type=int, default=20, help="measured requests per client and level")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per client first")
    p.add_argument("--duration", type=float, default=60.0, help="at most this many seconds per level")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server's engine")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


# ---- the model --------------------------------------------------------------------------------------


def build_small_llama(out_dir: Path, seed: int = 0) -> Path:
    """~3M parameters: 4 layers, hidden 256, and a 2,048-token byte-level BPE trained on specserve's own sources."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # ASCII only, and no byte alphabet beyond what the corpus holds: every token decodes to whole
    # characters, so no delta is ever held back waiting for the rest of a UTF-8 sequence.
    root = Path(__file__).resolve().parent.parent
    corpus = [p.read_text(errors="ignore").encode("ascii", "ignore").decode() for p in sorted(root.glob("*/*.py"))][:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(corpus or ["def f(x):\n    return x\n"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(out_dir))
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(out_dir))
    return out_dir


# ---- the server process -----------------------------------------------------------------------------


APIS = ("websocket", "openai")


def start_server(model_dir: Path, args, max_clients: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specserve", "serve", "--model", str(model_dir), "--port", "0",
           "--threads", str(args.threads), "--device", args.device, "--max-num-seqs", str(max(64, max_clients)),
           "--max-connections", str(max_clients + 8)]
    cmd += ["--drafter", args.drafter or "none", "--log-level", "warning", "--replicas", str(getattr(args, "replicas", 1))]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()  # the banner is on stderr, with the other status lines
        if not line:
            raise ValueError(f"the server exited (status {proc.wait()}): {line.strip()}")
        match = re.search(r"(ws://\S+/v1/ws)", line)
        if match:
            return proc, match.group(1)
    proc.terminate()
    raise ValueError("the server did not start within 300 s")


# ---- clients ----------------------------------------------------------------------------------------


class _Deliveries:
    """What one response's client saw: when each delivery came and how many tokens it carried."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.first: float | None = None
        self.first_tokens = 0
        self.last: float | None = None
        self.tokens = 0
        self.itl: list[float] = []
        self.arrivals: list[float] = []  # one per token

    def add(self, now: float, tokens: int) -> None:
        if tokens <= 0:
            return
        if self.first is None:
            self.first, self.first_tokens = now, tokens
        else:
            self.itl += [(now - self.last) / tokens] * tokens
        self.last = now
        self.tokens += tokens
        self.arrivals += [now] * tokens

    def result(self, output_tokens: int, timing: dict, tau: float, steps: int, now: float) -> dict:
        first, last = self.first, self.last
        return {
            "ttft_ms": (first - self.sent) * 1e3 if first else None,
            "first_delta_tokens": self.first_tokens,
            "itl_ms": [x * 1e3 for x in self.itl],
            "output_tokens": output_tokens,
            "tokens_per_s": (self.tokens - self.first_tokens) / (last - first) if first and last > first else None,
            "server_ttft_ms": timing["ttft_ms"],
            "engine_ttft_ms": timing["engine_ttft_ms"],
            "tau": tau,
            "gap_cv": _gap_cv(self.arrivals),
            # how long after the engine finished the last token reached the client (pacing holds tokens back)
            "tail_ms": (last - self.sent) * 1e3 - timing["e2e_ms"] if last else None,
            "step_ms": (timing["e2e_ms"] - timing["ttft_ms"]) / steps if steps else None,
            "done_at": now,
        }


def _gap_cv(arrivals: list[float]) -> float | None:
    """Coefficient of variation of the gaps between consecutive tokens after the first."""
    if len(arrivals) < 3:
        return None
    gaps = np.diff(np.asarray(arrivals))
    mean = gaps.mean()
    return float(gaps.std() / mean) if mean > 0 else None


async def _ws_request(ws, prompt: list[int], max_tokens: int, pacing: str) -> dict:
    sent = time.perf_counter()
    await ws.send(json.dumps({"type": "response.create", "response": {
        "input": prompt, "max_output_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream_pacing": pacing}}))
    seen = _Deliveries(sent)
    async for message in ws:
        event = json.loads(message)
        kind = event["type"]
        now = time.perf_counter()
        if kind == "response.output_text.delta":
            seen.add(now, event["tokens"])
        elif kind == "response.done":
            resp = event["response"]
            if resp["status"] not in ("completed", "incomplete"):
                raise RuntimeError(f"response {resp['status']}: {resp.get('error')}")
            return seen.result(resp["usage"]["output_tokens"], resp["timing"], resp["spec"]["tau"], resp["spec"]["steps"], now)
        elif kind == "error":
            raise RuntimeError(f"server error: {event['error']}")
    raise RuntimeError("the server closed the connection")


async def _ws_client(url: str, prompts: list[list[int]], args, deadline: float, pacing: str) -> list[dict]:
    from websockets.asyncio.client import connect

    results = []
    async with connect(url, compression=None, max_size=None) as ws:
        await ws.recv()  # session.created
        for i, prompt in enumerate(prompts):
            if time.perf_counter() > deadline:
                break
            result = await _ws_request(ws, prompt, args.max_output_tokens, pacing)
            if i >= args.warmup:
                results.append(result)
    return results


async def _openai_request(session, url: str, prompt: list[int], max_tokens: int, pacing: str) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_pacing": pacing, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    sent = time.perf_counter()
    seen = _Deliveries(sent)
    counted = 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:  # server-sent events: "data: {json}" lines, blank lines between
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']}")
            usage = chunk.get("usage")
            if chunk["choices"] and usage is not None:
                seen.add(now, usage["completion_tokens"] - counted)
                counted = usage["completion_tokens"]
            if "spec" in chunk:
                final = chunk
    return seen.result(final["usage"]["completion_tokens"], final["timing"], final["spec"]["tau"], final["spec"]["steps"],
                       time.perf_counter())


async def _openai_client(base: str, prompts: list[list[int]], args, deadline: float, pacing: str) -> list[dict]:
    import aiohttp

    results = []
    async with aiohttp.ClientSession() as session:
        for i, prompt in enumerate(prompts):
            if time.perf_counter() > deadline:
                break
            result = await _openai_request(session, base + "/v1/completions", prompt, args.max_output_tokens, pacing)
            if i >= args.warmup:
                results.append(result)
    return results


async def run_level(url: str, concurrency: int, vocab: int, args, api: str = "websocket", pacing: str = "off") -> dict:
    rng = np.random.default_rng(concurrency)
    n = args.warmup + args.requests
    prompts = [[rng.integers(0, vocab - 1, args.prompt_tokens).tolist() for _ in range(n)] for _ in range(concurrency)]
    start = time.perf_counter()
    if api == "websocket":
        clients = (_ws_client(url, p, args, start + args.duration, pacing) for p in prompts)
    else:
        base = url.replace("ws://", "http://").rsplit("/v1/ws", 1)[0]
        clients = (_openai_client(base, p, args, start + args.duration, pacing) for p in prompts)
    per_client = await asyncio.gather(*clients)
    results = [r for rs in per_client for r in rs]
    if not results:
        raise RuntimeError("no request finished within --duration")
    wall = max(r["done_at"] for r in results) - start
    clean = [r for r in results if r["first_delta_tokens"] == 1 and r["ttft_ms"] is not None]
    overhead = [r["ttft_ms"] - r["engine_ttft_ms"] for r in clean]
    wire = [r["ttft_ms"] - r["server_ttft_ms"] for r in clean]
    handoff = [r["server_ttft_ms"] - r["engine_ttft_ms"] for r in clean]
    return {
        "api": api,
        "pacing": pacing,
        "concurrency": concurrency,
        "requests": len(results),
        "ttft_ms": _pct([r["ttft_ms"] for r in results if r["ttft_ms"] is not None]),
        "engine_ttft_ms": _pct([r["engine_ttft_ms"] for r in results]),
        "server_overhead_ms": _pct(overhead),
        # overhead = wire + handoff. wire: client TTFT - server TTFT (receipt -> first token sampled): frames,
        # JSON and the delivery back through the event loop. handoff: receipt -> engine add_request: parsing,
        # tokenizing, the queue to the engine thread and waiting for the running step to end.
        "wire_ms": _pct(wire),
        "handoff_ms": _pct(handoff),
        "itl_ms": _pct([x for r in results for x in r["itl_ms"]]),
        "tokens_per_s_per_request": _pct([r["tokens_per_s"] for r in results if r["tokens_per_s"]]),
        "aggregate_tokens_per_s": sum(r["output_tokens"] for r in results) / wall,
        "tau": float(np.mean([r["tau"] for r in results])),
        "overhead_samples": len(clean),
        "gap_cv": _pct([r["gap_cv"] for r in results if r["gap_cv"] is not None]),
        "tail_ms": _pct([r["tail_ms"] for r in results if r["tail_ms"] is not None]),
        "step_ms": _pct([r["step_ms"] for r in results if r["step_ms"] is not None]),
    }


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None, "n": 0}
    arr = np.asarray(xs, dtype=float)
    return {"p50": round(float(np.percentile(arr, 50)), 3), "p99": round(float(np.percentile(arr, 99)), 3), "n": len(xs)}


def run(args: argparse.Namespace) -> int:
    try:
        levels = [int(c) for c in str(args.concurrency).split(",")]
    except ValueError:
        raise ValueError(f"--concurrency expects comma-separated integers, got {args.concurrency!r}") from None
    for name in ("requests", "prompt_tokens", "max_output_tokens", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(c < 1 or c > 256 for c in levels):
        raise ValueError(f"--concurrency levels must be in [1, 256], got {levels}")
    apis = [a.strip() for a in str(args.api).split(",") if a.strip()]
    if not apis or any(a not in APIS for a in apis):
        raise ValueError(f"--api takes a comma-separated list of {', '.join(APIS)}, got {args.api!r}")
    args.apis = apis
    if args.model == "embedded":
        from specserve.bundle_paths import default_model_dir

        if default_model_dir() is None:
            raise ValueError("--model embedded: no embedded default model is installed")
        args.model = str(default_model_dir())
    if args.warmup < 0 or args.duration <= 0:
        raise ValueError("--warmup must be >= 0 and --duration > 0")
    with use_model_dir(args.model, build_small_llama, "a small random Llama") as path:
        figures = _measure(args, path, levels)
    write_json(figures, args.json)
    return 0


def _measure(args: argparse.Namespace, model_dir: Path, levels: list[int]) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    proc, url = start_server(model_dir, args, max(levels))
    figures: dict = {
        "machine": host() | {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"model": str(args.model or "small random Llama (4 layers, hidden 256, 2k BPE vocab)"),
                     "drafter": args.drafter, "apis": args.apis, "prompt_tokens": args.prompt_tokens,
                     "max_output_tokens": args.max_output_tokens, "requests_per_client": args.requests,
                     "warmup_per_client": args.warmup, "server_threads": args.threads, "device": args.device},
        "levels": [],
    }
    try:
        for c in levels:
            for api in args.apis:
                level = asyncio.run(run_level(url, c, vocab, args, api))
                figures["levels"].append(level)
                _print_level(level)
        if args.pacing:
            figures["pacing"] = []
            for c in sorted({1, max(levels)}):
                off = asyncio.run(run_level(url, c, vocab, args, "websocket", "off"))
                smooth = asyncio.run(run_level(url, c, vocab, args, "websocket", "smooth"))
                figures["pacing"].append(_pacing_figures(c, off, smooth))
                _print_pacing(figures["pacing"][-1])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return figures


def _pacing_figures(concurrency: int, off: dict, smooth: dict) -> dict:
    added = None
    if off["tail_ms"]["p50"] is not None and smooth["tail_ms"]["p50"] is not None:
        added = round(smooth["tail_ms"]["p50"] - off["tail_ms"]["p50"], 3)
    return {"concurrency": concurrency, "tau": smooth["tau"], "gap_cv_off": off["gap_cv"], "gap_cv_smooth": smooth["gap_cv"],
            "itl_ms_off": off["itl_ms"], "itl_ms_smooth": smooth["itl_ms"], "tail_ms_off": off["tail_ms"],
            "tail_ms_smooth": smooth["tail_ms"], "added_e2e_ms_p50": added, "step_ms": smooth["step_ms"],
            "ttft_ms_off": off["ttft_ms"], "ttft_ms_smooth": smooth["ttft_ms"]}


def _f(d: dict) -> str:
    return "n/a" if d["p50"] is None else f"{d['p50']:.2f} / {d['p99']:.2f}"


def _print_pacing(p: dict) -> None:
    print(f"pacing, websocket, concurrency {p['concurrency']} (τ {p['tau']:.2f}), p50 / p99:")
    print(f"  inter-token gap CV, off / smooth    {_f(p['gap_cv_off'])}  /  {_f(p['gap_cv_smooth'])}")
    print(f"  TTFT ms, off / smooth               {_f(p['ttft_ms_off'])}  /  {_f(p['ttft_ms_smooth'])}")
    print(f"  last token after engine end ms      {_f(p['tail_ms_off'])}  /  {_f(p['tail_ms_smooth'])}")
    added = "n/a" if p["added_e2e_ms_p50"] is None else f"{p['added_e2e_ms_p50']:.2f}"
    print(f"  added end-to-end ms (p50)           {added}   (one step: {_f(p['step_ms'])} ms)", flush=True)


def _print_level(level: dict) -> None:
    f = _f
    print(f"{level['api']}, concurrency {level['concurrency']}: {level['requests']} requests, τ {level['tau']:.2f}")
    print(f"  TTFT ms (p50 / p99)             {f(level['ttft_ms'])}")
    print(f"  engine TTFT ms                  {f(level['engine_ttft_ms'])}")
    print(f"  server overhead ms              {f(level['server_overhead_ms'])}  ({level['overhead_samples']} samples)")
    print(f"    of which wire / hand-off ms   {f(level['wire_ms'])}  /  {f(level['handoff_ms'])}")
    print(f"  inter-token latency ms          {f(level['itl_ms'])}")
    print(f"  tokens/s per request            {f(level['tokens_per_s_per_request'])}")
    print(f"  aggregate output tokens/s       {level['aggregate_tokens_per_s']:.1f}", flush=True)
