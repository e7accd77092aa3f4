"""`specserve bench soak`: a soak and chaos run — many clients, some of them hostile, against a real server
on loopback for a given time, checking that nothing leaks, nothing crosses over and nothing dies.

The server is a real SpecServer (BackgroundServer: its own event loop and engine thread) in this process,
over the default model (SmolLM2-135M-Instruct) unless ``--model`` names another, so that the engine's KV pool
can be read at the end; the clients are real websocket (``websockets``) and HTTP/SSE (``aiohttp``) connections
on one asyncio loop in the main thread. Their scripts are in soak_scripts.py, their connections in soak_clients.py.

Before the server starts, every reference is answered solo by the same LLM: greedy requests (a prompt and
its max tokens) and seeded sampled ones. Then, after a warm-up (every action once, unmeasured: first-time
allocations and kernel shapes are not growth), two phases of ``--duration`` together:

- quiet (``--quiet-share`` of it): the well-behaved clients alone (with ``--load-matched``, as many
  well-behaved clients as the hostile phase has clients in all) — greedy requests over the websocket (text
  or token ids, some with stop strings, some smoothly paced) and HTTP (streamed or whole), seeded sampled
  requests, chat turns over both, choice-constrained requests;
- hostile: the same well-behaved clients plus ``--hostile-share`` of ``--clients`` hostile ones, which
  cancel at random points (their own responses, and others' they must not reach), disconnect abruptly
  before or mid-stream (websocket and HTTP), read slowly (some responses fail with ``slow_consumer``:
  the server runs with small output bounds for that), send malformed, oversized and unknown frames and
  bodies, prompts past the context, invalid sampling values and constraints that do not compile, switch
  drafters, and open more responses than a connection may hold.

Invariants (any broken one: exit status 1, after the table and the JSON):

- every response ends with exactly one terminal event (websocket: one ``response.done``, nothing after it;
  HTTP: one finish or error chunk, then ``[DONE]``), and every hostile input gets its documented error;
- greedy answers equal their solo reference (no cross-over, no corruption by batching or speculation);
- seeded sampled answers equal theirs — checked only under ``--speculation static`` (the default here) or
  without a drafter: the README promises a seed reproduces there, while adaptive budgets follow timings
  and so does which exact draw a seed gives (under adaptive they are counted "not checked");
- once idle (after each phase), KV blocks in use, responses in flight and engine requests are all back to
  zero — read from the engine and from /metrics;
- the engine thread stays alive throughout (sampled every 0.2 s); there is no restart to hide a death;
- nothing is logged at ERROR or above while the server runs (an exception the server did not handle).

Goals, reported: growth per 10k requests of the memory held — the process's RSS (clients included) less the
pages of the KV cache the OS has mapped in so far (`rss_and_kv_mib`: reserved untouched, they are not a leak) — after
the warm-up vs the end, and, the figure the goal is judged on, the steady state: over the second half of the
last phase, sampled every 5 s against the server's count of requests (the first minutes' allocator growth
levels off, a leak does not); an invariant too once that half has served 10k requests, below which it is
an extrapolation. And the well-behaved clients' TTFT and inter-token latency p50/p99, quiet vs hostile,
with the ratio of p99 TTFT (goal ≤ ``--max-ttft-ratio``; not an exit status: the hostile clients' requests
are load as well, and on a shared machine the ratio is noise-prone).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import re
import sys
import time

import numpy as np

from specserve.evals.common import machine, set_threads, write_json
from specserve.evals.resident_memory import resident_mib
from specserve.evals.soak_clients import Tally
from specserve.evals.soak_scripts import GOOD, HOSTILE, Reference, Soak, client
from specserve.cli import MODEL_HELP

#: Code-like prompts (the embedded model learned Python); greedy references cycle through max tokens.
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def read_file(path):\n    with open(path) as f:\n",
           "try:\n    import json\nexcept ImportError:\n", "    def __repr__(self):\n        return ",
           "if __name__ == '__main__':\n", "def parse_args(argv=None):\n", "squares = [i * i for i in ",
           "    @property\n    def name(self):\n", "from collections import "]
GREEDY_MAX_TOKENS = (12, 24, 40)
STOPPED = [("def fibonacci(n):\n", ("return",)), ("squares = [i * i for i in ", (")", "]")),
           ("class Stack:\n    def __init__(self):\n", ("\n\n",))]
SEEDED = 6  # seeded sampled references (the first prompts), temperature 0.9
MEMORY_GOAL_MIB_PER_10K = 20.0
MEMORY_ENFORCED_FROM = 10_000  # requests: below this the growth per 10k is an extrapolation, reported only
MAX_MESSAGE_BYTES = 64 * 1024  # small, so oversized frames are cheap to send
# A connection's unsent output (text and events waiting while its socket is full) and its kernel send buffer.
PENDING_BYTES = 1024
SEND_BUFFER_BYTES = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafter", default="auto", help="drafter spec for the server: 'auto' (the model's default), a name "
                                                    "or 'none'")
    p.add_argument("--speculation", default="static", choices=("static", "adaptive"),
                   help="static (default): seeded sampled answers reproduce and are checked; adaptive: they are not")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients in the hostile phase (default 16)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the quiet and hostile phases together")
    p.add_argument("--quiet-share", type=float, default=1 / 3,
                   help="fraction of --duration the well-behaved clients run alone first (default 1/3)")
    p.add_argument("--hostile-share", type=float, default=0.5, help="fraction of --clients that are hostile (default 0.5)")
    p.add_argument("--load-matched", action="store_true",
                   help="the quiet phase runs --clients well-behaved clients (as many as the hostile phase has in all), "
                        "so the TTFT ratio measures what hostility costs beyond the load it adds")
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' random scripts")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the engine (default 1)")
    p.add_argument("--max-ttft-ratio", type=float, default=2.0,
                   help="goal: well-behaved p99 TTFT, hostile over quiet (default 2)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    if args.clients < 1 or args.duration <= 0:
        raise ValueError(f"--clients must be >= 1 and --duration > 0, got {args.clients} and {args.duration}")
    if not 0 <= args.hostile_share < 1 or not 0 <= args.quiet_share < 1:
        raise ValueError("--hostile-share and --quiet-share must be in [0, 1)")
    set_threads(args.threads)
    from specserve import LLM
    from specserve.server import BackgroundServer, ServerConfig

    llm = LLM(args.model, drafter=args.drafter, speculation=args.speculation, threads=args.threads)
    greedy, seeded = references(llm)
    hostile = min(round(args.clients * args.hostile_share), args.clients - 1)  # at least one well-behaved client
    # Small output bounds, so that a slow reader's responses do fail with slow_consumer (that path is soaked
    # too): a well-behaved client has one short response at a time on its connection, far below them.
    config = ServerConfig(port=0, threads=args.threads, max_connections=4 * args.clients + 16,
                          max_message_bytes=MAX_MESSAGE_BYTES, max_pending_bytes=PENDING_BYTES,
                          send_buffer_bytes=SEND_BUFFER_BYTES)
    errors = ErrorLog()
    with errors, BackgroundServer(llm, config) as srv:
        server = srv.server
        soak = Soak(ws_url=srv.ws_url, http_url=srv.http_url.rstrip("/"), tally=Tally(), greedy=greedy, seeded=seeded,
                    check_seeds=server.drafter_spec is None or args.speculation == "static", drafter=server.drafter_spec,
                    context_length=server.context_length, max_message_bytes=config.max_message_bytes,
                    max_responses_per_connection=config.max_responses_per_connection,
                    vocab_size=llm.engine.model.config.vocab_size)
        kv_cache = (llm.engine.cache.k, llm.engine.cache.v)
        figures = asyncio.run(soak_run(srv, soak, args, args.clients - hostile, hostile, kv_cache))
    figures["server_errors_logged"] = {"count": errors.count, "first": errors.first}
    figures["machine"] = machine(llm)
    figures["settings"] = {"model": args.model or "the default model", "drafter": soak.drafter,
                           "speculation": args.speculation,
                           "clients": args.clients, "well_behaved": args.clients - hostile, "hostile": hostile,
                           "duration_s": args.duration, "quiet_share": args.quiet_share, "seed": args.seed,
                           "load_matched": args.load_matched,
                           "threads": args.threads, "max_ttft_ratio": args.max_ttft_ratio}
    judge(figures, args.max_ttft_ratio)
    print_report(figures)
    write_json(figures, args.json)
    return 0 if figures["ok"] else 1


class ErrorLog(logging.Handler):
    """Counts the records logged at ERROR or above while the server runs (``with``): each is an exception
    the server did not handle or a failure it noticed — under the soak's inputs, a bug. Keeps the first
    few; the records still reach stderr (a plain stderr handler is added when nothing else would print them)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.first: list[str] = []
        self._stderr: logging.Handler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 5:
            exc = record.exc_info[1] if record.exc_info else None
            self.first.append(f"{record.name}: {record.getMessage()}" + (f" ({type(exc).__name__}: {exc})" if exc else ""))

    def __enter__(self) -> ErrorLog:
        root = logging.getLogger()
        if not root.handlers:  # logging's last resort (stderr, WARNING) only speaks when no handler exists
            self._stderr = logging.StreamHandler()
            self._stderr.setLevel(logging.WARNING)
            root.addHandler(self._stderr)
        root.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        if self._stderr is not None:
            root.removeHandler(self._stderr)


def references(llm) -> tuple[list[Reference], list[Reference]]:
    """Each reference answered alone by the same LLM, before the server shares its engine with anyone."""
    from specserve import SamplingParams

    def solo(ref: Reference) -> Reference:
        params = SamplingParams(max_tokens=ref.max_tokens, temperature=ref.temperature, seed=ref.seed, stop=ref.stop)
        text = llm.generate(ref.prompt, params)[0].text
        return dataclasses.replace(ref, text=text, ids=tuple(llm.encode(ref.prompt)))

    greedy = [solo(Reference(p, GREEDY_MAX_TOKENS[i % len(GREEDY_MAX_TOKENS)])) for i, p in enumerate(PROMPTS)]
    # Stop strings hold text back until they can be ruled out: a place where streams could be cut or mixed up.
    greedy += [solo(Reference(p, 40, stop=stop)) for p, stop in STOPPED]
    seeded = [solo(Reference(p, 24, 0.9, 1000 + i)) for i, p in enumerate(PROMPTS[:SEEDED])]
    return greedy, seeded


# ---- the run -------------------------------------------------------------------------------------------


async def soak_run(srv, soak: Soak, args, good: int, hostile: int, kv_cache: tuple) -> dict:
    """The warm-up, then the quiet and hostile phases; kv_cache: the engine's K and V tensors, whose pages the OS maps
    in as blocks are first written (`rss_and_kv_mib`)."""
    import aiohttp

    tally = soak.tally
    alive = {"samples": 0, "dead": 0, "rss": []}
    async with aiohttp.ClientSession() as http:
        watcher = asyncio.create_task(watch_engine(srv, alive, tally, http, soak.http_url, kv_cache))
        # Warm-up: every action once (one well-behaved and one hostile client), unmeasured.
        await asyncio.gather(client(soak, "warm-good", GOOD, args.seed, once=True),
                             client(soak, "warm-bad", HOSTILE, args.seed + 1, once=True))
        idle = {"warmup": await wait_idle(srv, http, soak.http_url)}
        warm_counts = {"kinds": dict(tally.kinds), "terminals": dict(tally.terminals)}
        tally.kinds.clear()
        tally.terminals.clear()
        tally.checks.clear()
        (rss_start, kv_start), served_start = rss_and_kv_mib(kv_cache), idle["warmup"]["requests_served"]
        phases = {}
        quiet_s = args.duration * args.quiet_share
        for phase, seconds, bad in (("quiet", quiet_s, 0), ("hostile", args.duration - quiet_s, hostile)):
            if seconds <= 0:
                continue
            tally.phase = phase
            start = time.perf_counter()
            soak.deadline = start + seconds
            # The well-behaved clients' seeds are the same in both phases: they run the same scripts, so their
            # latencies differ by what the hostile clients add, not by what they themselves did.
            # --load-matched: the quiet phase has as many clients as the hostile one, all well-behaved.
            n_good = good + hostile if phase == "quiet" and args.load_matched else good
            clients = [client(soak, f"good{i}", GOOD, args.seed * 1000 + i) for i in range(n_good)]
            clients += [client(soak, f"bad{i}", HOSTILE, args.seed * 1000 + 500 + i) for i in range(bad)]
            await asyncio.gather(*clients)
            phases[phase] = {"seconds": round(time.perf_counter() - start, 2), "clients": n_good + bad}
            rss_phase_end, kv_phase_end = rss_and_kv_mib(kv_cache, collect=False)  # as the timeline reads it
            idle[phase] = await wait_idle(srv, http, soak.http_url)
        rss_end, kv_end = rss_and_kv_mib(kv_cache)
        watcher.cancel()
    end = idle[list(idle)[-1]]
    served = end["requests_served"] - served_start
    by_status = {k: n - idle["warmup"]["requests_by_status"].get(k, 0) for k, n in end["requests_by_status"].items()}
    return {
        "requests_by_status": {k: n for k, n in by_status.items() if n},
        "phases": phases,
        "warmup": warm_counts,
        "kinds": dict(tally.kinds),
        "terminals": dict(tally.terminals),
        "checks": dict(tally.checks),
        "violations": dict(tally.violations),
        "examples": tally.examples,
        "idle": idle,
        "engine": {"samples": alive["samples"], "dead_samples": alive["dead"]},
        "rss_timeline": alive["rss"],
        "memory": {"rss_start_mib": round(rss_start, 1), "rss_end_mib": round(rss_end, 1),
                   "kv_resident_start_mib": round(kv_start, 1), "kv_resident_end_mib": round(kv_end, 1),
                   "requests": served,
                   "growth_mib_per_10k": (round(((rss_end - kv_end) - (rss_start - kv_start)) / served * 1e4, 2)
                                          if served else None),
                   **steady_growth(alive["rss"], rss_phase_end - kv_phase_end, end["requests_served"])},
        "latency": {phase: {"ttft_ms": pct(tally.ttft_ms[phase]), "itl_ms": pct(tally.itl_ms[phase]),
                            "ttft_ms_by_action": {a: pct(v) for a, v in sorted(tally.ttft_by_action[phase].items())},
                            "server_ms": {k: pct(v) for k, v in sorted(tally.server_ms[phase].items())}}
                    for phase in phases},
    }


def steady_growth(timeline: list[dict], held_end: float, served_end: int) -> dict:
    """Growth of the memory held (RSS less the KV cache's resident pages: `rss_and_kv_mib`) per 10k requests over the
    second half of the last phase: the steady state. The first minutes' growth (allocator arenas, buffers sized
    by the peak of connections) levels off; a leak does not."""
    last = [r for r in timeline if r["phase"] == timeline[-1]["phase"]] if timeline else []
    if len(last) < 4:
        return {"steady_growth_mib_per_10k": None, "steady_requests": 0}
    mid = last[len(last) // 2]
    requests = served_end - mid["served"]
    growth = round((held_end - mid["held_mib"]) / requests * 1e4, 2) if requests > 0 else None
    return {"steady_growth_mib_per_10k": growth, "steady_requests": requests, "steady_from_s": mid["s"]}


async def watch_engine(srv, alive: dict, tally: Tally, http, base: str, kv_cache: tuple) -> None:
    """Sample the engine thread's liveness until cancelled, and every 5 s the RSS against the actions run
    (a leak grows with the work done; allocator warm-up levels off)."""
    start = time.perf_counter()
    while True:
        alive["samples"] += 1
        alive["dead"] += not srv.server.worker.alive
        if alive["samples"] % 25 == 1:
            served = sum(v for k, v in (await scrape(http, base)).items() if k.startswith("specserve_requests_total{"))
            rss, kv = rss_and_kv_mib(kv_cache, collect=False)
            alive["rss"].append({"s": round(time.perf_counter() - start, 1), "rss_mib": round(rss, 1),
                                 "kv_mib": round(kv, 1), "held_mib": round(rss - kv, 1), "phase": tally.phase,
                                 "served": int(served)})
        await asyncio.sleep(0.2)


async def wait_idle(srv, http, base: str, timeout: float = 30.0) -> dict:
    """Once every client has gone: wait (up to ``timeout``) for the server to be idle, then read what it
    holds. Anything left is a leak: KV blocks, responses in flight, requests in the engine, connections."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        gauges = await scrape(http, base)
        busy = [gauges.get(name, 0) for name in ("specserve_kv_blocks_used", "specserve_responses_in_flight",
                                                 "specserve_running_sequences", "specserve_queue_depth",
                                                 "specserve_websocket_connections")]
        if not any(busy) or loop.time() > deadline:
            break
        await asyncio.sleep(0.1)

    def engine_state(engine):
        allocator = engine.cache.allocator
        return allocator.num_blocks - allocator.num_free_blocks, len(engine.requests), engine.has_unfinished()

    try:
        used, requests, unfinished = await loop.run_in_executor(None, srv.engine_call, engine_state)
    except Exception as exc:  # the engine thread is gone (or stuck): that is reported as such
        used, requests, unfinished = None, None, f"engine unreachable: {type(exc).__name__}"
    return {"kv_blocks_used": used, "kv_blocks_used_gauge": gauges.get("specserve_kv_blocks_used"),
            "kv_blocks_total": gauges.get("specserve_kv_blocks_used", 0) + gauges.get("specserve_kv_blocks_free", 0),
            "engine_requests": requests, "engine_unfinished": unfinished,
            "responses_in_flight": gauges.get("specserve_responses_in_flight"),
            "connections": gauges.get("specserve_websocket_connections"),
            "engine_alive_gauge": gauges.get("specserve_engine_alive"),
            "requests_served": int(sum(v for k, v in gauges.items() if k.startswith("specserve_requests_total{"))),
            "requests_by_status": _by_status(gauges)}


def _by_status(gauges: dict[str, float]) -> dict[str, int]:
    """specserve_requests_total by status, both APIs together (the server's own count of finished requests)."""
    out: dict[str, int] = {}
    for key, value in gauges.items():
        status = re.search(r'status="([^"]*)"', key) if key.startswith("specserve_requests_total{") else None
        if status:
            out[status.group(1)] = out.get(status.group(1), 0) + int(value)
    return out


_SAMPLE = re.compile(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$")


async def scrape(http, base: str) -> dict[str, float]:
    """GET /metrics: each sample by name (with its labels, if any)."""
    async with http.get(base + "/metrics") as resp:
        text = await resp.text()
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := _SAMPLE.match(line))}


def rss_and_kv_mib(kv_cache: tuple, collect: bool = True) -> tuple[float, float]:
    """(RSS, the KV cache's resident part of it) in MiB. The cache is reserved zeroed and untouched, and its pages
    count toward RSS only once a block is first written: RSS climbs in steps as longer prompts or more clients
    reach new blocks, up to the cache's size. What a leak check judges is the difference, the memory held."""
    rss = rss_mib(collect)
    return rss, resident_mib(kv_cache)


def rss_mib(collect: bool = True) -> float:
    """This process's resident memory now (Linux /proc; elsewhere the peak, from getrusage), after a full
    garbage collection when ``collect`` (what is merely uncollected yet is not growth)."""
    if collect:
        gc.collect()
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform != "darwin" else 1024 * 1024)


def pct(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None, "n": 0}
    arr = np.asarray(xs, dtype=float)
    return {"p50": round(float(np.percentile(arr, 50)), 2), "p99": round(float(np.percentile(arr, 99)), 2), "n": len(xs)}


# ---- verdict and report --------------------------------------------------------------------------------


def judge(figures: dict, max_ttft_ratio: float) -> None:
    """Add ``invariants`` (each a count that must be 0), ``goals`` and ``ok`` to the figures."""
    v = figures["violations"]
    idle = figures["idle"]
    leaked_kv = max((i["kv_blocks_used"] if i["kv_blocks_used"] is not None else 1) for i in idle.values())
    memory = figures["memory"]
    steady = memory["steady_growth_mib_per_10k"] is not None
    growth = memory["steady_growth_mib_per_10k"] if steady else memory["growth_mib_per_10k"]
    memory_enforced = steady and memory["steady_requests"] >= MEMORY_ENFORCED_FROM
    figures["invariants"] = {
        "terminal_event_violations": v.get("terminal", 0),
        "greedy_mismatches": v.get("mismatch", 0),
        "seeded_mismatches": v.get("seed", 0),
        "wrong_answers": v.get("answer", 0),
        "leaked_kv_blocks": leaked_kv,
        "responses_in_flight_when_idle": max(int(i["responses_in_flight"] or 0) for i in idle.values()),
        "engine_requests_when_idle": max((i["engine_requests"] if i["engine_requests"] is not None else 1)
                                         for i in idle.values()),
        "engine_deaths": int(figures["engine"]["dead_samples"] > 0 or any(i["engine_alive_gauge"] != 1 for i in idle.values())),
        "memory_over_goal": int(memory_enforced and growth is not None and growth >= MEMORY_GOAL_MIB_PER_10K),
        "server_errors_logged": figures["server_errors_logged"]["count"],
    }
    lat = figures["latency"]
    ratio = None
    if "quiet" in lat and "hostile" in lat and lat["quiet"]["ttft_ms"]["p99"] and lat["hostile"]["ttft_ms"]["p99"]:
        ratio = round(lat["hostile"]["ttft_ms"]["p99"] / lat["quiet"]["ttft_ms"]["p99"], 2)
    figures["goals"] = {
        "memory_growth_mib_per_10k": growth, "memory_growth_measure": "steady" if steady else "whole run",
        "memory_goal_mib_per_10k": MEMORY_GOAL_MIB_PER_10K,
        "memory_goal_enforced": memory_enforced, "memory_goal_met": growth is not None and growth < MEMORY_GOAL_MIB_PER_10K,
        "p99_ttft_ratio": ratio, "max_ttft_ratio": max_ttft_ratio,
        "ttft_goal_met": ratio is not None and ratio <= max_ttft_ratio,
    }
    figures["ok"] = not any(figures["invariants"].values())


def _counts(counter: dict) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counter.items(), key=lambda kv: -kv[1])) or "none"


def _lat(d: dict) -> str:
    return "n/a" if d["p50"] is None else f"{d['p50']:.1f} / {d['p99']:.1f}"


def _per_10k(growth: float | None) -> str:
    return "n/a" if growth is None else f"{growth:+.1f} MiB per 10k requests"


def _memory(mem: dict) -> str:
    held_start = mem["rss_start_mib"] - mem["kv_resident_start_mib"]
    held_end = mem["rss_end_mib"] - mem["kv_resident_end_mib"]
    return (f"{mem['rss_start_mib']:.1f} -> {mem['rss_end_mib']:.1f} MiB, of which the KV cache's first-touched "
            f"pages {mem['kv_resident_start_mib']:.1f} -> {mem['kv_resident_end_mib']:.1f}; held {held_start:.1f} -> "
            f"{held_end:.1f}: {_per_10k(mem['growth_mib_per_10k'])}")


def _steady(mem: dict, goals: dict) -> str:
    note = "" if goals["memory_goal_enforced"] else "; enforced from 10k requests"
    if mem["steady_growth_mib_per_10k"] is None:
        return f"n/a (run too short; goal < {MEMORY_GOAL_MIB_PER_10K:g})"
    return (f"{_per_10k(mem['steady_growth_mib_per_10k'])} over {mem['steady_requests']} requests from "
            f"{mem['steady_from_s']:.0f} s (goal < {MEMORY_GOAL_MIB_PER_10K:g}{note})")


def print_report(f: dict) -> None:
    s, inv, goals, mem = f["settings"], f["invariants"], f["goals"], f["memory"]
    phases = ", ".join(f"{name} {p['seconds']:.0f} s ({p['clients']} clients)" for name, p in f["phases"].items())
    print(f"soak: {s['clients']} clients ({s['well_behaved']} well-behaved, {s['hostile']} hostile), {phases}; "
          f"model {s['model']}, drafter {s['drafter'] or 'none'}, {s['speculation']} speculation")
    rows = [
        ("actions by kind", _counts(f["kinds"])),
        ("requests served (server's count)", f"{mem['requests']}: {_counts(f['requests_by_status'])}"),
        ("terminal events", _counts(f["terminals"])),
        ("answers checked", _counts(f["checks"])),
        ("terminal-event violations", inv["terminal_event_violations"]),
        ("greedy mismatches (cross-over)", inv["greedy_mismatches"]),
        ("seeded mismatches", inv["seeded_mismatches"]),
        ("wrong answers", inv["wrong_answers"]),
        ("leaked KV blocks when idle", inv["leaked_kv_blocks"]),
        ("responses in flight when idle", inv["responses_in_flight_when_idle"]),
        ("engine requests when idle", inv["engine_requests_when_idle"]),
        ("server errors logged", inv["server_errors_logged"]),
        ("engine deaths / restarts", f"{inv['engine_deaths']} / 0 ({f['engine']['samples']} liveness samples)"),
        ("RSS after warm-up -> end", _memory(mem)),
        ("held memory growth, steady state", _steady(mem, goals)),
    ]
    for phase, lat in f["latency"].items():
        rows.append((f"well-behaved TTFT ms, {phase}", f"{_lat(lat['ttft_ms'])} (p50 / p99, {lat['ttft_ms']['n']} responses)"))
        rows.append((f"well-behaved ITL ms, {phase}", f"{_lat(lat['itl_ms'])} (p50 / p99)"))
        server = lat.get("server_ms", {})
        if server.get("ttft_ms", {}).get("n"):  # websocket responses: what the server itself took
            rows.append((f"  server's own TTFT / queue ms, {phase}",
                         f"{_lat(server['ttft_ms'])} / {_lat(server['queue_ms'])} (p50 / p99; receipt -> first token "
                         f"sampled / -> admitted)"))
    ratio = goals["p99_ttft_ratio"]
    rows.append(("p99 TTFT hostile / quiet", "n/a" if ratio is None else
                 f"{ratio:.2f} (goal <= {goals['max_ttft_ratio']:g}: {'met' if goals['ttft_goal_met'] else 'MISSED'})"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for example in f["examples"][:20] + [f"logged: {line}" for line in f["server_errors_logged"]["first"]]:
        print(f"  ! {example}")
    print("soak: PASS" if f["ok"] else "soak: FAIL (" + ", ".join(k for k, n in inv.items() if n) + ")", flush=True)
