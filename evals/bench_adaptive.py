"""`specserve bench adaptive`: adaptive speculation vs plain decoding and static budgets, by batch size.

Prompts are the held-out code prefixes of `bench drafters` (`specserve.evals.datasets.heldout_prompts`,
repeated in order when a batch needs more than there are). A cell is one drafter × batch size ×
temperature; in each cell these configurations run the same batch of prompts (EOS ignored; at T > 0
request i of round r has seed 1000·r + i, the same for every configuration):

- plain:           no drafter;
- plain:control:   a second, separately loaded plain `LLM` (a control: two instances of the same model
                   differ by a few percent here — memory placement — and that is noise too);
- static:default:  the drafter with its default options, every request its fixed budget;
- static:bBdD:     the drafter with max_budget=B, depth=D (the sweep), budgets fixed (static:bB: a drafter without a
                   depth option, a hybrid, at its own depth);
- adaptive:        the drafter with its default options, `speculation="adaptive"`.

Every configuration is one `LLM` built once per drafter (plain once for all), warmed up once at each
temperature, and reused for every cell. A cell runs --repeats rounds; each round runs every
configuration once, in an order rotated by one each round, so none always goes first, over at least
MIN_CELL_PROMPTS prompts in consecutive batches of the cell's batch size (one short request is too little
to time).

Aggregate tokens/s = new tokens of the batch / wall time of the `generate` call (prefill included: every
configuration's run starts from a cold prefix cache, `common.start_cold`);
per-request tokens/s = a request's new tokens / its end-to-end time, p50 over the batch, median over
rounds. "Best static" is the static setting (default included) with the highest median aggregate
tokens/s in the cell. Noise: the larger of the spread of plain decoding's aggregate tokens/s over the
cell's rounds, (max − min) / median, and the control's distance from plain, |1 − control / plain|. A goal (adaptive ≥ 0.97 × max(plain, best static); adaptive ≥ 1.00 × plain) is
missed beyond noise when the ratio is below goal × (1 − noise).

`--workload editing` asks for an edit instead: each prompt is a held-out prefix, plain decoding's own
greedy continuation of it (--max-tokens tokens) and the prefix again — a file handed back to be
rewritten, where the answer mostly copies the prompt (the case prompt-lookup and suffix drafters are
for; the default drafters become ngram,suffix).

At T = 0 every configuration's tokens must equal plain decoding's in every round; a mismatch is a
bug: it is reported loudly and the command exits 1 after writing its JSON and plot.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path

from specserve.evals.common import machine, model_label, parse_batch_sizes, set_threads, start_cold, sync, write_json
from specserve.evals.metrics import SpecCounts
from specserve.cli import MODEL_HELP

DEFAULT_DRAFTERS = "eagle,draft,medusa,ngram"
EDITING_DRAFTERS = "ngram,suffix"
WORKLOADS = ("heldout", "editing")
GOAL_VS_BEST = 0.97
GOAL_VS_PLAIN = 1.00
# (max_budget, depth) settings swept besides each drafter's default (chain-ish budgets: about one node
# per level). Defaults: eagle depth 5, topk 2, budget 8; draft depth 4 chain (budget 4); medusa 3 heads
# of the embedded bundle, budget 8; ngram depth 6, budget 24. Every setting lies within the default's
# budget and depth, the bounds the adaptive policy chooses within (it runs with the default options), so
# "best static" is a fixed choice adaptive could have made.
DEFAULT_SWEEP: dict[str, tuple[tuple[int, int], ...]] = {
    "eagle": ((1, 1), (2, 2), (4, 4)),
    "draft": ((1, 1), (2, 2), (3, 3)),
    "medusa": ((1, 1), (2, 2), (4, 3)),
    "ngram": ((2, 2), (4, 4), (6, 6)),
}
FALLBACK_SWEEP = ((1, 1), (2, 2), (4, 4))  # a drafter without an entry above


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafters", default=None,
                   help=f"comma-separated drafter specs, NAME or NAME:PATH, or auto (the model's default drafter) "
                        f"(default {DEFAULT_DRAFTERS}; {EDITING_DRAFTERS} with --workload editing)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="comma-separated batch sizes (default %(default)s)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated temperatures, 0 = greedy (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default %(default)s)")
    p.add_argument("--prompt-chars", type=int, default=None,
                   help="characters per held-out prompt (default 400; 200 with --workload editing, whose prompts hold "
                        "a prefix twice and a continuation)")
    p.add_argument("--workload", choices=WORKLOADS, default="heldout",
                   help="heldout: held-out code prefixes; editing: a prefix, its continuation and the prefix again, "
                        "to be continued (default drafters then ngram,suffix) (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per cell (default %(default)s)")
    p.add_argument("--sweep", action="append", default=None, metavar="[DRAFTER=]BxD[,BxD...]",
                   help="static settings swept besides the default, as max_budget x depth (e.g. 'ngram=4x4,8x8'; "
                        "without DRAFTER= for every drafter not named; 'DRAFTER=' for none); repeatable. "
                        "Default: " + "; ".join(f"{n}={','.join(f'{b}x{d}' for b, d in s)}" for n, s in DEFAULT_SWEEP.items()))
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="FILE", help="PNG: speedup over plain vs batch size")


# ---- arguments ------------------------------------------------------------------------------------


def parse_temperatures(text: str) -> list[float]:
    temps: list[float] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            t = float(item)
        except ValueError:
            raise ValueError(f"--temperatures expects comma-separated numbers >= 0, got {text!r}") from None
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"--temperatures must be finite numbers >= 0 (0 = greedy), got {item!r}")
        if t not in temps:
            temps.append(t)
    if not temps:
        raise ValueError(f"--temperatures expects comma-separated numbers >= 0, got {text!r}")
    return temps


def parse_drafters(text: str) -> list[tuple[str, str]]:
    """(spec, name) pairs, in order, duplicates dropped; unknown names are an error (before any loading)."""
    from specserve.drafters import parse_drafter_spec, registered_drafters

    out: list[tuple[str, str]] = []
    for spec in (s.strip() for s in text.split(",")):
        if not spec:
            continue
        # auto: the model's measured default drafter with its recorded options, which `LLM` resolves
        name = "auto" if spec == "auto" else parse_drafter_spec(spec)[0]
        if name != "auto" and name not in registered_drafters():
            raise ValueError(f"--drafters: unknown drafter {name!r}; registered drafters: {', '.join(registered_drafters())}")
        if spec not in [s for s, _ in out]:
            out.append((spec, name))
    if not out:
        raise ValueError(f"--drafters expects a comma-separated list of drafters, got {text!r}")
    return out


def _setting(text: str, item: str) -> tuple[int, int]:
    budget, sep, depth = text.strip().lower().partition("x")
    try:
        b, d = int(budget), int(depth)
    except ValueError:
        b = d = 0
    if not sep or b < 1 or d < 1:
        raise ValueError(f"--sweep expects [DRAFTER=]BUDGETxDEPTH[,...] with integers >= 1 (e.g. ngram=4x4,8x8), got {item!r}")
    return b, d


def parse_sweep(items: list[str] | None, names: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Each drafter name → its (max_budget, depth) settings besides the default."""
    if not items:
        return {n: list(DEFAULT_SWEEP.get(n, FALLBACK_SWEEP)) for n in names}
    named: dict[str, list[tuple[int, int]]] = {}
    common: list[tuple[int, int]] | None = None
    for item in items:
        key, sep, rest = item.partition("=")
        settings = [_setting(s, item) for s in (rest if sep else key).split(",") if s.strip()]
        if sep:
            key = key.strip()
            if key not in names:
                raise ValueError(f"--sweep names drafter {key!r}, which is not in --drafters ({', '.join(names)})")
            named.setdefault(key, []).extend(settings)
        else:
            if not settings:
                raise ValueError(f"--sweep expects [DRAFTER=]BUDGETxDEPTH[,...], got {item!r}")
            common = (common or []) + settings
    return {n: list(dict.fromkeys(named[n] if n in named else
                                  (common if common is not None else DEFAULT_SWEEP.get(n, FALLBACK_SWEEP))))
            for n in names}


def editing_prompts(plain, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt followed by plain greedy decoding's continuation of it and the prompt again: asked to
    go on, the model mostly repeats what it wrote (an edit of a file it was handed)."""
    from specserve import SamplingParams

    outs = plain.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [p + list(o.token_ids) + p for p, o in zip(prompts, outs)]


def _check_output(path: str | None, flag: str) -> None:
    if path and not Path(path).resolve().parent.is_dir():
        raise ValueError(f"{flag}: the directory of {path!r} does not exist")


# ---- measuring ------------------------------------------------------------------------------------


def _params(temperature: float, max_tokens: int, count: int, round_index: int):
    from specserve import SamplingParams

    if temperature == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=1000 * round_index + i)
            for i in range(count)]


def _spread(values: list[float]) -> float:
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else 0.0


def _p50_request_rates(outs) -> tuple[float, float | None]:
    """p50 over requests of new tokens / end-to-end time, and of (tokens − 1) / (e2e − TTFT)."""
    e2e = [len(o.token_ids) / o.e2e_s for o in outs if o.e2e_s]
    decode = [(len(o.token_ids) - 1) / (o.e2e_s - o.ttft_s) for o in outs
              if o.e2e_s and o.ttft_s is not None and o.e2e_s > o.ttft_s and len(o.token_ids) > 1]
    return statistics.median(e2e), (statistics.median(decode) if decode else None)


#: Prompts a cell times per configuration and round at least, in consecutive batches of its batch size: a B=1 cell
#: that timed one 64-token request (about a second on the default model) read 0.89-0.94x plain on a noisy host where
#: 8 prompts a round read 1.00-1.03x (BENCHMARKS.md, "Editing prompts, adaptive cells...").
MIN_CELL_PROMPTS = 8


def _measure_cell(llms: dict, prompts: list[list[int]], temperature: float, max_tokens: int, repeats: int, device,
                  batch: int | None = None) -> dict:
    """Every configuration of `llms` on `prompts`, `repeats` rounds in rotated order; the prompts go in consecutive
    batches of `batch` (None: all at once), and a round's tokens/s is all their new tokens over all their time."""
    names = list(llms)
    batch = batch or len(prompts)
    groups = [range(i, min(len(prompts), i + batch)) for i in range(0, len(prompts), batch)]
    rates = {n: [] for n in names}
    per_request = {n: [] for n in names}
    per_request_decode = {n: [] for n in names}
    stats = {n: [] for n in names}
    mismatched: set[str] = set()
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        params = _params(temperature, max_tokens, len(prompts), r)
        tokens: dict[str, list[list[int]]] = {}
        for name in order:
            start_cold(llms[name])
            outs, wall = [], 0.0
            for group in groups:
                sync(device)
                t0 = time.perf_counter()
                outs += llms[name].generate([prompts[i] for i in group],
                                            [params[i] for i in group] if isinstance(params, list) else params)
                sync(device)
                wall += time.perf_counter() - t0
            rates[name].append(sum(len(o.token_ids) for o in outs) / wall)
            e2e, decode = _p50_request_rates(outs)
            per_request[name].append(e2e)
            if decode is not None:
                per_request_decode[name].append(decode)
            stats[name].extend(o.spec for o in outs)
            tokens[name] = [o.token_ids for o in outs]
        if temperature == 0:
            mismatched |= {n for n in names if tokens[n] != tokens["plain"]}
    plain = statistics.median(rates["plain"])
    configs = {}
    for n in names:
        med = statistics.median(rates[n])
        counts = SpecCounts.total(stats[n]) if not n.startswith("plain") else None
        configs[n] = {
            "tokens_per_s": med, "tokens_per_s_rounds": rates[n], "spread": _spread(rates[n]),
            "speedup": med / plain,
            "per_request_p50_tokens_per_s": statistics.median(per_request[n]),
            "per_request_p50_tokens_per_s_rounds": per_request[n],
            "per_request_p50_decode_tokens_per_s": statistics.median(per_request_decode[n]) if per_request_decode[n] else None,
            "tau": counts.tau if counts else 1.0,
            "draft_tokens_per_step": counts.drafted_per_step if counts else 0.0,
        } | _policy_stats(stats[n])
    statics = [n for n in names if n.startswith("static:")]
    best = max(statics, key=lambda n: configs[n]["tokens_per_s"])
    adaptive = configs["adaptive"]["tokens_per_s"]
    noise = configs["plain"]["spread"]
    if "plain:control" in configs:
        noise = max(noise, abs(1 - configs["plain:control"]["tokens_per_s"] / plain))
    vs_best = adaptive / max(plain, configs[best]["tokens_per_s"])
    vs_plain = adaptive / plain
    return {
        "configs": configs,
        "plain_tokens_per_s": plain,
        "static_default_speedup": configs["static:default"]["speedup"],
        "best_static": best,
        "best_static_speedup": configs[best]["speedup"],
        "adaptive_speedup": vs_plain,
        "adaptive_vs_max_plain_best_static": vs_best,
        "noise": noise,
        "goals": {
            "vs_max_plain_best_static": _goal(vs_best, GOAL_VS_BEST, noise),
            "vs_plain": _goal(vs_plain, GOAL_VS_PLAIN, noise),
        },
        "outputs_identical": (not mismatched) if temperature == 0 else None,
        "mismatched_configs": sorted(mismatched),
    }


def _policy_stats(stats: list) -> dict:
    """Budget allowed per verify step and, where the adaptive policy predicted accepted lengths, its
    predicted vs realised τ over those steps (None when the engine records no such counts)."""
    steps = sum(s.num_steps for s in stats)
    budget = sum(getattr(s, "num_budget", 0) for s in stats)
    predicted = sum(getattr(s, "num_predicted", 0) for s in stats)
    return {
        "mean_budget": budget / steps if steps and any(hasattr(s, "num_budget") for s in stats) else None,
        "predicted_tau": 1 + sum(s.predicted_accepted for s in stats) / predicted if predicted else None,
        "realised_tau": 1 + sum(s.accepted_when_predicted for s in stats) / predicted if predicted else None,
    }


def _goal(ratio: float, goal: float, noise: float) -> str:
    """"met"; "within noise" (below the goal by no more than the noise); "missed" beyond the noise."""
    if ratio >= goal:
        return "met"
    return "within noise" if ratio >= goal * (1 - noise) else "missed"


# ---- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from specserve import LLM
    from specserve.evals.datasets import heldout_prompts

    drafters = parse_drafters(args.drafters or (EDITING_DRAFTERS if args.workload == "editing" else DEFAULT_DRAFTERS))
    sizes = parse_batch_sizes(args.batch_sizes)
    temps = parse_temperatures(args.temperatures)
    sweep = parse_sweep(args.sweep, list(dict.fromkeys(n for _, n in drafters)))
    if args.prompt_chars is None:
        args.prompt_chars = 200 if args.workload == "editing" else 400
    for name in ("repeats", "max_tokens", "prompt_chars"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _check_output(args.json, "--json")
    _check_output(args.plot, "--plot")
    set_threads(args.threads)
    started = time.perf_counter()
    max_batch = sizes[-1]

    def build(drafter: str | None, speculation: str, options: dict | None = None):
        t0 = time.perf_counter()
        llm = LLM(args.model, drafter=drafter, drafter_options=options, device=args.device, max_num_seqs=max_batch,
                  speculation=speculation)
        return llm, time.perf_counter() - t0

    plain, plain_load_s = build(None, "static")
    control, _ = build(None, "static")
    num_prompts = max(max_batch, MIN_CELL_PROMPTS)
    texts = heldout_prompts(num_prompts, args.prompt_chars)
    encoded = [plain.encode(t) for t in texts]
    if args.workload == "editing":
        encoded = editing_prompts(plain, encoded, args.max_tokens)
    prompts = [encoded[i % len(encoded)] for i in range(num_prompts)]
    window = plain.engine.config.max_model_len
    longest = max(len(p) for p in encoded)
    if longest + args.max_tokens > window:
        raise ValueError(f"the longest prompt ({longest} tokens at --prompt-chars {args.prompt_chars}) plus --max-tokens "
                         f"{args.max_tokens} exceed the context window ({window})")

    def warm_up(llm) -> None:
        for t in temps:
            llm.generate(prompts[: min(2, max_batch)], _params(t, 8, min(2, max_batch), 0))

    warm_up(plain)
    warm_up(control)
    result: dict = {
        "machine": machine(plain),
        "model": model_label(args.model),
        "settings": {
            "drafters": [s for s, _ in drafters], "batch_sizes": sizes, "temperatures": temps,
            "workload": args.workload,
            "max_tokens": args.max_tokens, "prompt_chars": args.prompt_chars, "repeats": args.repeats,
            "prompts": {"unique": len(encoded), "tokens_min": min(map(len, encoded)), "tokens_max": longest},
            "sweep": {n: [list(s) for s in v] for n, v in sweep.items()},
            "seeds": "T > 0: request i of round r has seed 1000*r + i (same for every configuration)",
            "goals": {"adaptive_vs_max_plain_best_static": GOAL_VS_BEST, "adaptive_vs_plain": GOAL_VS_PLAIN},
            "noise": "per cell, the larger of plain decoding's aggregate tokens/s spread over the rounds, (max - min) / "
                     "median, and a second plain instance's distance from it, |1 - control / plain|; a goal is missed "
                     "beyond noise when the ratio < goal * (1 - noise)",
            "order": "each round runs every configuration once; the order rotates by one configuration per round",
        },
        "plain_load_s": plain_load_s,
        "drafters": {},
    }
    mismatches: list[str] = []
    for spec, name in drafters:
        llms: dict = {"plain": plain, "plain:control": control}
        configs: dict = {"plain": {"speculation": None, "options": None, "max_budget": 0, "depth": 0, "load_s": plain_load_s},
                         "plain:control": {"speculation": None, "options": None, "max_budget": 0, "depth": -1, "load_s": 0.0}}
        skipped: list[str] = []

        def add(label: str, speculation: str, options: dict | None) -> None:
            llm, load_s = build(spec, speculation, options)
            d = llm.engine.drafter
            if d is None:
                raise ValueError(f"--drafters {spec}: this model has no default drafter ({spec} decodes it plainly)")
            key = (speculation, int(d.max_budget), getattr(d, "depth", None))
            same = next((c for c, v in configs.items() if (v["speculation"], v["max_budget"], v["depth"]) == key), None)
            if same is not None:  # e.g. a sweep setting the drafter capped to its default
                skipped.append(f"{label} (same as {same}: budget {d.max_budget}, depth {d.depth})")
                return
            llms[label] = llm
            configs[label] = {"speculation": speculation, "options": options, "max_budget": key[1], "depth": key[2],
                              "load_s": load_s}

        add("static:default", "static", None)
        # A drafter without a depth option (a hybrid: `auto`) sweeps its budgets at its own depth.
        from specserve.drafters.base import option_names  # (here: argument errors answer before torch loads)

        takes_depth = "depth" in option_names(type(llms["static:default"].engine.drafter))
        for b, d in sweep[name]:
            if takes_depth:
                label, options = f"static:b{b}d{d}", {"max_budget": b, "depth": d}
            else:
                label, options = f"static:b{b}", {"max_budget": b}
            try:
                add(label, "static", options)
            except ValueError as exc:
                if args.sweep:  # asked for: bad input
                    raise
                skipped.append(f"{label} ({exc})")  # a default setting this drafter cannot take
        add("adaptive", "adaptive", None)
        for label, llm in llms.items():
            if not label.startswith("plain"):
                warm_up(llm)
        cells = []
        for b in sizes:
            for t in temps:
                cell = {"batch": b, "temperature": t}
                cell |= _measure_cell(llms, prompts[:max(b, MIN_CELL_PROMPTS)], t, args.max_tokens, args.repeats,
                                      plain.device, batch=b)
                cells.append(cell)
                _progress(spec, cell)
                if cell["outputs_identical"] is False:
                    line = (f"MISMATCH: {spec} batch {b} T=0: {', '.join(cell['mismatched_configs'])} "
                            "differ from plain decoding's tokens")
                    mismatches.append(line)
                    print(f"!!! {line} !!!", file=sys.stderr, flush=True)
        result["drafters"][spec] = {"name": name, "configs": configs, "sweep_skipped": skipped, "cells": cells}
        del llms
        gc.collect()
    result["outputs_identical"] = not mismatches
    result["mismatches"] = mismatches
    result["goal_misses_beyond_noise"] = [
        f"{spec} B={c['batch']} T={c['temperature']:g}: {goal}"
        for spec, entry in result["drafters"].items() for c in entry["cells"]
        for goal, verdict in c["goals"].items() if verdict == "missed"]
    result["wall_s"] = time.perf_counter() - started
    _print_tables(result)
    write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    if mismatches:
        print("ERROR: greedy outputs differ from plain decoding (a bug):", file=sys.stderr)
        for line in mismatches:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


# ---- output ---------------------------------------------------------------------------------------


def _progress(spec: str, cell: dict) -> None:
    mb = cell["configs"]["adaptive"]["mean_budget"]
    print(f"[{spec}] B={cell['batch']} T={cell['temperature']:g}: plain {cell['plain_tokens_per_s']:.0f} tok/s, "
          f"default {cell['static_default_speedup']:.2f}x, best {cell['best_static']} {cell['best_static_speedup']:.2f}x, "
          f"adaptive {cell['adaptive_speedup']:.2f}x" + (f" (mean budget {mb:.1f})" if mb is not None else ""),
          file=sys.stderr, flush=True)


def _verdict(cell: dict) -> str:
    parts = []
    for goal, short in (("vs_max_plain_best_static", "best"), ("vs_plain", "plain")):
        verdict = cell["goals"][goal]
        if verdict == "missed":
            parts.append(f"MISS {short}")
        elif verdict == "within noise":
            parts.append(f"~{short}")
    return ", ".join(parts) or "ok"


def _print_tables(result: dict) -> None:
    s = result["settings"]
    m = result["machine"]
    print(f"adaptive vs static speculation, {s.get('workload', 'heldout')} workload: {s['max_tokens']} new tokens, {s['repeats']} rounds per cell, "
          f"{m['device']}, {m['threads']} threads; x = tokens/s / plain's; ad/max = adaptive / max(plain, best static)")
    print("req p50 = per-request tokens/s (new tokens / end-to-end time), p50 over the batch, median over rounds")
    print(f"goals: ad/max >= {GOAL_VS_BEST:.2f} and adaptive >= {GOAL_VS_PLAIN:.2f}x plain; noise = plain's (max-min)/median "
          "over rounds; 'MISS' = missed by more than the noise, '~' = missed within the noise")
    for spec, entry in result["drafters"].items():
        cfg = entry["configs"]["static:default"]
        print(f"\n{spec} (static default: budget {cfg['max_budget']}, depth {cfg['depth']})")
        print(f"{'batch':>5} {'T':>4} {'plain tok/s':>11} {'default x':>9} {'best static x':>22} {'adaptive x':>10} "
              f"{'ad/max':>6} {'noise':>6} {'req p50 plain/ad':>16} {'greedy':>6}  goals")
        for c in entry["cells"]:
            best = f"{c['best_static_speedup']:.2f} ({c['best_static'].removeprefix('static:')})"
            same = {True: "same", False: "DIFF", None: "-"}[c["outputs_identical"]]
            req = "/".join(f"{c['configs'][n]['per_request_p50_tokens_per_s']:.0f}" for n in ("plain", "adaptive"))
            print(f"{c['batch']:>5} {c['temperature']:>4g} {c['plain_tokens_per_s']:>11.1f} {c['static_default_speedup']:>9.2f} "
                  f"{best:>22} {c['adaptive_speedup']:>10.2f} {c['adaptive_vs_max_plain_best_static']:>6.2f} "
                  f"{100 * c['noise']:>5.1f}% {req:>16} {same:>6}  {_verdict(c)}")
        if entry["sweep_skipped"]:
            print(f"  sweep settings skipped: {'; '.join(entry['sweep_skipped'])}")
    misses = result["goal_misses_beyond_noise"]
    print(f"\ncells missing a goal by more than the noise: {len(misses)}" + (":" if misses else ""))
    for line in misses:
        print(f"  {line}")
    print(f"greedy outputs identical to plain decoding: {'yes' if result['outputs_identical'] else 'NO'}")
    print(f"wall time {result['wall_s']:.0f} s")


def plot(result: dict, path: str) -> None:
    """One subplot per drafter × temperature: tokens/s ÷ plain against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(result["drafters"])
    temps = result["settings"]["temperatures"]
    sizes = result["settings"]["batch_sizes"]
    fig, axes = plt.subplots(len(specs), len(temps), figsize=(4.8 * len(temps), 3.4 * len(specs)), squeeze=False)
    for i, spec in enumerate(specs):
        cells = result["drafters"][spec]["cells"]
        for j, t in enumerate(temps):
            ax = axes[i][j]
            row = [c for c in cells if c["temperature"] == t]
            xs = [c["batch"] for c in row]
            ax.plot(xs, [c["static_default_speedup"] for c in row], "o-", label="static default")
            ax.plot(xs, [c["best_static_speedup"] for c in row], "s-", label="best static")
            ax.plot(xs, [c["adaptive_speedup"] for c in row], "^-", label="adaptive")
            for c in row:
                ax.annotate(c["best_static"].removeprefix("static:"), (c["batch"], c["best_static_speedup"]),
                            textcoords="offset points", xytext=(0, 5), ha="center", fontsize=6, color="C1")
            ax.axhline(1.0, ls="--", color="gray", lw=1, label="plain")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([str(b) for b in sizes])
            ax.set_title(f"{spec}, T={t:g}", fontsize=10)
            ax.set_xlabel("batch size")
            ax.set_ylabel("tokens/s / plain")
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
