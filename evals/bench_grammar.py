"""`specserve bench grammar`: structured output — validity, τ, speed and mask cost of every drafter in
every grammar-drafting mode, against constrained plain decoding.

Workload: `builtin:structured-code` (`specserve.evals.structured`: JSON objects described by code
comments, regex-shaped lines, small Lark grammars, choices; first turns of `--dataset`'s records
otherwise), the first `--prompts` of it. Configurations, each one `LLM` built once and reused for every
cell:

- plain:         no drafter, `grammar_drafting="verify"`: the grammar masks each step's one row — constrained
                 plain decoding, the baseline of every speedup;
- none/forced:   no drafter, `grammar_drafting="forced"`: only the tokens the grammar leaves no choice
                 about are drafted (jump-forward), when "forced" is among --modes;
- DRAFTER/MODE:  each drafter × each mode (verify: the grammar masks verification only, what other stacks
                 do; aware: drafters mask their own proposals too; forced: aware + forced tokens drafted
                 for free), with --speculation static (default: each drafter's own budget every step, so
                 its behaviour shows) and/or adaptive (a "/adaptive" suffix when both run).

A cell is one batch size × temperature. Its requests are the prompts, cycled to fill whole batches of
B (so B = 8 with 4 prompts runs each prompt twice), run B at a time through `generate`, EOS allowed (a
request ends when its structure is complete, or at --max-tokens: "truncated"). At T > 0 request i of
round r has seed 1000·r + i, the same for every configuration. A cell runs --repeats rounds; each runs
every configuration once, in an order rotated by one each round. Each configuration is warmed up first:
one untimed pass of every prompt at each temperature, B = the largest batch size (kernels, every grammar
compiled, the drafters' paths).

Per cell and configuration: validity (outputs that satisfy their constraint, checked from the text by
`specserve.evals.structured.check_output`, independently of the engine), τ (tokens emitted per verify
step, bonus and forced tokens included; plain = 1), tokens/s (new tokens / wall time of the round's
`generate` calls, median over rounds), speedup (over plain's median tokens/s in the same cell), and the
grammar's mask cost: `LLM.constraints.mask_s` after − before over the engine steps of the round (ms per
step, and as a fraction of the wall time: of the step time). At T = 0 every configuration's tokens must
equal plain decoding's: a mismatch is a bug, reported loudly, and the command exits 1 (after writing its
JSON), as it does when an output that finished ("stop") fails its constraint.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from pathlib import Path

from specserve.evals.common import machine, model_label, parse_batch_sizes, set_threads, sync, write_json
from specserve.evals.metrics import SpecCounts
from specserve.cli import MODEL_HELP

MODES = ("verify", "aware", "forced")
SPECULATION = ("static", "adaptive")
DEFAULT_DRAFTERS = "eagle,draft,medusa,ngram"
PLAIN = "plain"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--dataset", default="builtin:structured-code",
                   help="builtin:structured-code (default) or a JSONL file whose lines carry json_schema / regex / "
                        "grammar / choice (first turns only)")
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                   help="comma-separated drafter specs, NAME or NAME:PATH (default %(default)s); 'none' alone runs only "
                        "the configurations without a drafter")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated grammar-drafting modes (default %(default)s)")
    p.add_argument("--speculation", default="static",
                   help="static (default: each drafter's own budget every step), adaptive, or static,adaptive")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default %(default)s)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated temperatures, 0 = greedy (default %(default)s)")
    p.add_argument("--prompts", type=int, default=None, metavar="N", help="the first N prompts of the workload (default: all)")
    p.add_argument("--max-tokens", type=int, default=96, help="most new tokens per request (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per cell (default %(default)s)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="CPU kernel threads (default: every core)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="JSON results (default evals/results/grammar-<date>.json)")


# ---- arguments ------------------------------------------------------------------------------------


def _parse_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise ValueError(f"{flag} expects a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return items


def parse_drafters(text: str) -> list[str]:
    """Drafter specs in order (unknown names are an error before any loading); 'none' adds nothing."""
    from specserve.evals.bench_adaptive import parse_drafters as parse

    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise ValueError(f"--drafters expects a comma-separated list of drafters, got {text!r}")
    rest = [s for s in specs if s not in ("none", PLAIN)]
    return [spec for spec, _ in parse(",".join(rest))] if rest else []


def default_out(today: datetime.date | None = None) -> str:
    return str(Path("evals") / "results" / f"grammar-{(today or datetime.date.today()).isoformat()}.json")


def configurations(drafters: list[str], modes: list[str], speculation: list[str]) -> dict[str, dict]:
    """label → how to build it: plain first, then none/forced, then drafter × mode × speculation."""
    configs = {PLAIN: {"drafter": None, "mode": "verify", "speculation": "static"}}
    if "forced" in modes:
        configs["none/forced"] = {"drafter": None, "mode": "forced", "speculation": "static"}
    for spec in drafters:
        for mode in modes:
            for how in speculation:
                label = f"{spec}/{mode}" + (f"/{how}" if len(speculation) > 1 else "")
                configs[label] = {"drafter": spec, "mode": mode, "speculation": how}
    return configs


# ---- measuring ------------------------------------------------------------------------------------


class StepCounter:
    """Counts `engine.step()` calls (what `generate` loops on) without touching the engine's code."""

    def __init__(self, engine) -> None:
        self.count = 0
        step = engine.step

        def counted(*args, **kwargs):
            self.count += 1
            return step(*args, **kwargs)

        engine.step = counted


def _params(prompts, temperature: float, max_tokens: int, round_index: int) -> list:
    from specserve import SamplingParams
    from specserve.evals.structured import constraint_kwargs

    return [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                           seed=(1000 * round_index + i) if temperature > 0 else None, **constraint_kwargs(p.constraint))
            for i, p in enumerate(prompts)]


def _requests(prompts: list, batch: int) -> list:
    """The prompts cycled to fill whole batches of `batch`."""
    count = math.ceil(len(prompts) / batch) * batch
    return [prompts[i % len(prompts)] for i in range(count)]


def run_config(llm, counter: StepCounter, requests: list, batch: int, temperature: float, max_tokens: int,
               round_index: int, device) -> dict:
    """One configuration's round of a cell: every request, `batch` at a time."""
    from specserve.evals.structured import check_output

    params = _params(requests, temperature, max_tokens, round_index)
    outs = []
    steps0, mask0 = counter.count, llm.constraints.mask_s
    sync(device)
    t0 = time.perf_counter()
    for s in range(0, len(requests), batch):
        outs += llm.generate([list(p.token_ids) for p in requests[s: s + batch]], params[s: s + batch])
    sync(device)
    wall = time.perf_counter() - t0
    checks = [check_output(p.constraint, o.text) if p.constraint is not None else "" for p, o in zip(requests, outs)]
    return {
        "wall_s": wall, "tokens": sum(len(o.token_ids) for o in outs), "steps": counter.count - steps0,
        "mask_s": llm.constraints.mask_s - mask0, "stats": [o.spec for o in outs],
        "token_ids": [o.token_ids for o in outs],
        "invalid": [(p.id, o.finish_reason, why, o.text) for p, o, why in zip(requests, outs, checks) if why],
        "truncated": sum(o.finish_reason == "length" for o in outs), "outputs": len(outs),
    }


def measure_cell(llms: dict, counters: dict, requests: list, batch: int, temperature: float, max_tokens: int,
                 repeats: int, device) -> dict:
    names = list(llms)
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    mismatched: set[str] = set()
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            rounds[name].append(run_config(llms[name], counters[name], requests, batch, temperature, max_tokens, r, device))
        if temperature == 0:
            mismatched |= {n for n in names if rounds[n][r]["token_ids"] != rounds[PLAIN][r]["token_ids"]}
    rates = {n: [x["tokens"] / x["wall_s"] for x in rounds[n]] for n in names}
    plain = statistics.median(rates[PLAIN])
    configs = {}
    for n in names:
        xs = rounds[n]
        outputs = sum(x["outputs"] for x in xs)
        invalid = [item for x in xs for item in x["invalid"]]
        steps, wall, mask = sum(x["steps"] for x in xs), sum(x["wall_s"] for x in xs), sum(x["mask_s"] for x in xs)
        counts = SpecCounts.total(s for x in xs for s in x["stats"])
        med = statistics.median(rates[n])
        configs[n] = {
            "validity": 1 - len(invalid) / outputs, "outputs": outputs, "invalid": len(invalid),
            "invalid_examples": [{"prompt": pid, "finish_reason": fr, "why": why, "text": text[:200]}
                                 for pid, fr, why, text in invalid[:3]],
            "invalid_finished": sum(fr != "length" for _, fr, _, _ in invalid),
            "truncated": sum(x["truncated"] for x in xs),
            "tau": counts.tau if counts.steps else 1.0,
            "draft_tokens_per_step": counts.drafted_per_step or 0.0,
            "tokens_per_s": med, "tokens_per_s_rounds": rates[n], "speedup": med / plain,
            "mean_output_tokens": sum(x["tokens"] for x in xs) / outputs,
            "engine_steps": steps, "step_ms": 1000 * wall / steps if steps else None,
            "mask_ms_per_step": 1000 * mask / steps if steps else None,
            "mask_fraction": mask / wall if wall > 0 else None,
        }
    return {"plain_tokens_per_s": plain, "configs": configs,
            "outputs_identical": (not mismatched) if temperature == 0 else None, "mismatched_configs": sorted(mismatched)}


# ---- the run --------------------------------------------------------------------------------------


def _workload(dataset: str, limit: int | None, tokenizer) -> list:
    from specserve.evals.datasets import EvalPrompt, load_dataset, render

    records = load_dataset(dataset, limit=limit)
    if limit is not None:
        records = records[:limit]
    if not any(r.constraint is not None for r in records):
        raise ValueError(f"dataset {dataset!r} has no constrained prompts (json_schema / regex / grammar / choice)")
    return [EvalPrompt(r.id, r.id, r.category, 1, tuple(render(tokenizer, r, 1, [])), r.constraint) for r in records]


def run(args: argparse.Namespace) -> int:
    from specserve import LLM
    from specserve.evals.bench_adaptive import parse_temperatures

    drafters = parse_drafters(args.drafters)
    modes = _parse_list(args.modes, MODES, "--modes")
    speculation = _parse_list(args.speculation, SPECULATION, "--speculation")
    sizes = parse_batch_sizes(args.batch_sizes)
    temps = parse_temperatures(args.temperatures)
    for name in ("repeats", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompts is not None and args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
    out = args.out or default_out()
    if not Path(out).resolve().parent.is_dir():
        raise ValueError(f"--out: the directory of {out!r} does not exist")
    set_threads(args.threads)
    started = time.perf_counter()
    plan = configurations(drafters, modes, speculation)
    llms, counters, load_s = {}, {}, {}
    prompts = None
    for label, c in plan.items():  # plain first: the workload is checked before the drafters load
        t0 = time.perf_counter()
        try:
            llms[label] = LLM(args.model, drafter=c["drafter"], device=args.device, max_num_seqs=sizes[-1],
                              speculation=c["speculation"], grammar_drafting=c["mode"])
        except Exception as exc:  # a drafter that cannot load is bad input: one line naming it and why
            if c["drafter"] is None:
                raise
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"drafter {c['drafter']!r} failed to load: {first}") from exc
        counters[label] = StepCounter(llms[label].engine)
        load_s[label] = time.perf_counter() - t0
        if prompts is None:
            prompts = _workload(args.dataset, args.prompts, llms[PLAIN].tokenizer)
            window = llms[PLAIN].engine.config.max_model_len
            longest = max(len(p.token_ids) for p in prompts)
            if longest + args.max_tokens > window:
                raise ValueError(f"the longest prompt ({longest} tokens) plus --max-tokens {args.max_tokens} exceed the "
                                 f"context window ({window})")
    plain = llms[PLAIN]
    _log(f"bench grammar: {len(prompts)} prompts, {len(plan)} configurations, cells B={sizes} x T={temps}; warming up")
    for llm in llms.values():  # kernels, and every prompt's grammar compiled, at every temperature
        for t in temps:
            for s in range(0, len(prompts), sizes[-1]):
                chunk = prompts[s: s + sizes[-1]]
                llm.generate([list(p.token_ids) for p in chunk], _params(chunk, t, args.max_tokens, 0))
    result: dict = {
        "machine": machine(plain),
        "model": model_label(args.model),
        "settings": {
            "dataset": args.dataset, "drafters": drafters, "modes": modes, "speculation": speculation,
            "batch_sizes": sizes, "temperatures": temps, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "seeds": "T > 0: request i of round r has seed 1000*r + i (same for every configuration)",
            "requests": "per cell, the prompts cycled to fill whole batches of B, run B at a time",
            "order": "each round runs every configuration once; the order rotates by one configuration per round",
        },
        "workload": [{"id": p.id, "category": p.category, "kind": p.constraint.kind if p.constraint else None,
                      "prompt_tokens": len(p.token_ids)} for p in prompts],
        "configs": {label: c | {"load_s": load_s[label]} for label, c in plan.items()},
        "cells": [],
    }
    mismatches: list[str] = []
    for b in sizes:
        requests = _requests(prompts, b)
        for t in temps:
            cell = {"batch": b, "temperature": t, "requests": len(requests)}
            cell |= measure_cell(llms, counters, requests, b, t, args.max_tokens, args.repeats, plain.device)
            result["cells"].append(cell)
            _progress(cell)
            if cell["outputs_identical"] is False:
                line = f"MISMATCH: B={b} T=0: {', '.join(cell['mismatched_configs'])} differ from plain decoding's tokens"
                mismatches.append(line)
                print(f"!!! {line} !!!", file=sys.stderr, flush=True)
    result["outputs_identical"] = not mismatches
    result["mismatches"] = mismatches
    result["invalid_finished"] = [f"B={c['batch']} T={c['temperature']:g} {n}: {e['prompt']}: {e['why']}"
                                  for c in result["cells"] for n, x in c["configs"].items() if x["invalid_finished"]
                                  for e in x["invalid_examples"] if e["finish_reason"] != "length"]
    result["wall_s"] = time.perf_counter() - started
    print(markdown(result))
    write_json(result, out)
    print(f"results: {out}", file=sys.stderr)
    status = 0
    if mismatches:
        print("ERROR: greedy outputs differ from constrained plain decoding (a bug):", file=sys.stderr)
        for line in mismatches:
            print(f"  {line}", file=sys.stderr)
        status = 1
    if result["invalid_finished"]:
        print("ERROR: finished outputs that fail their constraint (a bug):", file=sys.stderr)
        for line in result["invalid_finished"]:
            print(f"  {line}", file=sys.stderr)
        status = 1
    return status


# ---- output ---------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(cell: dict) -> None:
    best = max((n for n in cell["configs"] if n != PLAIN), key=lambda n: cell["configs"][n]["speedup"], default=None)
    valid = min(c["validity"] for c in cell["configs"].values())
    _log(f"B={cell['batch']} T={cell['temperature']:g}: plain {cell['plain_tokens_per_s']:.0f} tok/s"
         + (f", best {best} {cell['configs'][best]['speedup']:.2f}x" if best else "") + f", lowest validity {100 * valid:.0f}%")


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    lines = [
        f"Structured output: {len(result['workload'])} prompts ({s['dataset']}), at most {s['max_tokens']} new tokens, "
        f"{s['repeats']} rounds per cell, {m['device']}, {m['threads']} threads.",
        "valid = outputs satisfying their constraint; τ = tokens per verify step (forced tokens included); "
        "speedup = tokens/s over constrained plain decoding (plain) in the same cell; step ms = wall time / engine "
        "steps; mask = grammar mask time per engine step and its share of the step time; greedy = tokens equal "
        "plain's (T=0).",
        "",
        "| B | T | drafter | mode | speculation | valid | trunc. | τ | tokens/s | speedup | step ms | mask ms/step | mask % | greedy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in result["cells"]:
        for name, c in cell["configs"].items():
            cfg = result["configs"][name]
            same = "–" if cell["outputs_identical"] is None else ("DIFF" if name in cell["mismatched_configs"] else "same")
            lines.append(
                f"| {cell['batch']} | {cell['temperature']:g} | {cfg['drafter'] or 'none'} | {cfg['mode']} | "
                f"{cfg['speculation'] if cfg['drafter'] else '–'} | {100 * c['validity']:.0f}% | {c['truncated']} | "
                f"{c['tau']:.2f} | {c['tokens_per_s']:.1f} | {c['speedup']:.2f} | {_fmt(c['step_ms'], '.2f')} | "
                f"{_fmt(c['mask_ms_per_step'], '.3f')} | {_fmt(c['mask_fraction'] and 100 * c['mask_fraction'], '.1f')} | "
                f"{same} |")
    lines += ["", f"greedy outputs identical to constrained plain decoding: {'yes' if result['outputs_identical'] else 'NO'}; "
                  f"finished outputs failing their constraint: {len(result['invalid_finished'])}; "
                  f"wall time {result['wall_s']:.0f} s"]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
