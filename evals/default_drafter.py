"""Pick a model's default drafter by measurement (`specserve train default-drafter`).

It runs evaluations, so it lives here with them; `specserve.cli` adds it to the ``train`` commands
(`add_default_drafter_parser`), as training code does not import the evals.

`drafter="auto"` (the CLI's and the server's default) gives a model the drafter recorded for it:

- **the default model** (SmolLM2-135M-Instruct's GGUF file, ``--model default``): in
  ``specserve/default_model_drafters/MANIFEST.json``, measured on ``builtin:heldout-chat`` (chat questions
  about held-out modules, never trained on); candidates are the shipped drafters, the file-less ones (the
  suffix drafter also per request only: ``suffix#per-request``, ``shared_tokens=0``) and hybrids;
- **the tiny model** (``--model tiny``): in the bundle's MANIFEST.json, measured on ``builtin:heldout-code``.

Which one is measured, not assumed: every candidate runs the eval suite at batch 1, greedy, with adaptive
speculation, in one run beside plain decoding; the fastest by median speedup becomes ``default_drafter`` —
among those within TIE (2 %) of the fastest, a tie at this run's noise, the one with the highest τ (it
speculates most where speculation pays) — with its options (``default_drafter_options``), and the whole
table is recorded next to it (``default_drafter_eval``: command, date, machine, each candidate's speedup, τ
and tokens/s), so README's table and the choice come from the same run. A candidate is ``SPEC[#LABEL]``
with options per label, as in `specserve eval`.

The greedy leaders (SAMPLED_CHECKS of the eligible) also run at temperature 1, the API's default, in a second
run: one slower than SAMPLED_FLOOR × plain decoding there is passed over (with none above it, the rule reads the
greedy figures alone). On 2026-12-03 the per-request suffix + Medusa hybrid led greedy at 1.36× and ran 0.96× at
temperature 1, where it drafted almost nothing, while Medusa alone ran 1.01× (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

TIE = 0.02  # speedups this close to the best are a tie: two runs of the same drafter differ by about this
SAMPLED_CHECKS = 3  # the greedy leaders measured again at temperature 1
SAMPLED_TEMPERATURE = 1.0
SAMPLED_FLOOR = 0.97  # issue 40's floor for adaptive speculation: a default may not slow sampled decoding
PER_REQUEST_SUFFIX = "suffix#per-request"
DEFAULT_CANDIDATES: dict[str, dict[str, dict[str, Any]]] = {
    "default": {"eagle": {}, "medusa": {}, "ngram": {}, PER_REQUEST_SUFFIX: {"shared_tokens": 0}, "suffix": {},
                "lookahead": {}, "hybrid:ngram+suffix": {}, "hybrid:suffix+eagle": {}, "hybrid:suffix+medusa": {},
                "hybrid:suffix+medusa#per-request": {"part_options": {"suffix": {"shared_tokens": 0}}}},
    "tiny": {"eagle": {}, "medusa": {}, "draft": {}, "ngram": {}, "suffix": {}, "lookahead": {},
             "hybrid:suffix+eagle": {}, "hybrid:suffix+draft": {}, "hybrid:ngram+suffix": {}},
}


@dataclass(frozen=True)
class Target:
    """A model whose default drafter is measured: the eval's model and dataset, which candidate specs run on it
    with no path, and where the choice is recorded."""

    name: str
    model: str | None  # `EvalConfig.model`
    dataset: str
    runs_without_path: Callable[[str], bool]
    manifest_path: Path
    manifest: dict


def target_named(name: str) -> Target:
    """``default`` (the default model's GGUF file, fetched when absent) or ``tiny`` (the embedded bundle)."""
    if name == "tiny":
        from specserve.bundle_paths import MANIFEST, bundle_dir, bundle_manifest, default_model_dir, runs_on_bundle

        manifest = bundle_manifest()
        if manifest is None or default_model_dir() is None:
            raise ValueError(f"no embedded bundle in {str(bundle_dir())!r}: build it with `specserve train bundle` first")
        return Target("tiny", "tiny", "builtin:heldout-code", runs_on_bundle, bundle_dir() / MANIFEST, manifest)
    if name == "default":
        from specserve import default_model_drafters as shipped
        from specserve.loading import default_model

        model = default_model.default_model_path()  # fetched the first time (not $SPECSERVE_MODEL: this file)
        return Target("default", str(model), "builtin:heldout-chat", shipped.runs_without_path,
                      shipped.drafters_dir() / shipped.MANIFEST, shipped.manifest() or shipped.empty_manifest())
    raise ValueError(f"--model is 'default' (the default model) or 'tiny' (the embedded code model), got {name!r}")


def pick_default_drafter(candidates: dict[str, dict[str, Any]] | list[str], out: str, *, model: str = "default",
                         max_prompts: int = 8, max_tokens: int = 64, repeats: int = 2, threads: int | None = None,
                         command: str = "") -> dict:
    """Measure ``candidates`` ({SPEC[#LABEL]: options}, or specs without options) on ``model`` (`target_named`) and
    record the winner in its manifest. Returns the recorded ``default_drafter_eval`` (with ``default_drafter`` and
    ``default_drafter_options``)."""
    from specserve.drafters import registered_drafters
    from specserve.evals.suite import EvalConfig, run_eval

    target = target_named(model)
    options = dict(candidates) if isinstance(candidates, dict) else {c: {} for c in candidates}
    known = registered_drafters()
    usable = [c for c in options if target.runs_without_path(_spec(c)) and all(n in known for n in _drafter_names(_spec(c)))]
    dropped = sorted(set(options) - set(usable))
    if not usable:
        raise ValueError(f"none of the candidates {list(options)} can run on the {target.name} model")
    results = run_eval(EvalConfig(drafters=usable, dataset=target.dataset, out=out, model=target.model,
                                  max_prompts=max_prompts, max_tokens=max_tokens, temperature=0.0, batch_size=1,
                                  repeats=repeats, threads=threads, progress=False,
                                  drafter_options={c: options[c] for c in usable if options[c]}))
    table = {name: {"speedup": round(r["speedup"], 3), "tau": round(r["tau"], 3), "tokens_per_s": round(r["tokens_per_s"], 1),
                    "identical": r["identical_fraction"]}
             for name, r in results["drafters"].items()}
    # The default must keep seeded sampling reproducible: drafters that learn across requests (suffix with its
    # shared index, and hybrids with it) make a request's trees depend on what else the server ran. Measured,
    # not chosen.
    learns = {n for n in table if _learns_across_requests(_spec(n), options[n])}
    eligible = [n for n in table if n not in learns] or list(table)
    leaders = sorted(eligible, key=lambda n: -table[n]["speedup"])[:SAMPLED_CHECKS]
    sampled = run_eval(EvalConfig(drafters=leaders, dataset=target.dataset, out=str(Path(out) / "sampled"),
                                  model=target.model, max_prompts=max_prompts, max_tokens=max_tokens,
                                  temperature=SAMPLED_TEMPERATURE, batch_size=1, repeats=repeats, threads=threads,
                                  progress=False, drafter_options={c: options[c] for c in leaders if options[c]}))
    for name in leaders:
        if name in sampled["drafters"]:
            table[name]["sampled_speedup"] = round(sampled["drafters"][name]["speedup"], 3)
    eligible = [n for n in leaders if table[n].get("sampled_speedup", 0.0) >= SAMPLED_FLOOR] or eligible
    best = max(table[n]["speedup"] for n in eligible)
    winner = max((n for n in eligible if table[n]["speedup"] >= best - TIE), key=lambda n: (table[n]["tau"], table[n]["speedup"]))
    record = {"default_drafter": _spec(winner), "default_drafter_options": options[winner], "chosen": winner,
              "command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "dataset": target.dataset, "prompts": results["settings"]["num_prompts"], "max_tokens": max_tokens,
              "repeats": repeats, "batch_size": 1, "temperature": 0.0, "speculation": "adaptive",
              "sampled_temperature": SAMPLED_TEMPERATURE, "sampled_floor": SAMPLED_FLOOR,
              "sampled_plain_tokens_per_s": round(sampled["plain"]["tokens_per_s"], 1),
              "plain_tokens_per_s": round(results["plain"]["tokens_per_s"], 1), "machine": results["machine"],
              "candidates": table, "candidate_options": {n: options[n] for n in table if options[n]},
              "not_run": dropped, "not_eligible": sorted(learns)}
    manifest = dict(target.manifest)
    manifest["default_drafter"] = record["default_drafter"]
    manifest["default_drafter_options"] = record["default_drafter_options"]
    manifest["default_drafter_eval"] = record
    target.manifest_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(target.manifest_path)
    return record


def _spec(candidate: str) -> str:
    """The drafter spec of a candidate ``SPEC[#LABEL]``."""
    return candidate.partition("#")[0]


def _drafter_names(spec: str) -> list[str]:
    """The drafters a spec runs: a hybrid's parts (``hybrid:suffix+eagle`` → suffix, eagle), else its own."""
    name, _, path = spec.partition(":")
    return [p.strip().partition(":")[0] for p in path.split("+")] if name == "hybrid" else [name]


def _learns_across_requests(spec: str, options: dict[str, Any]) -> bool:
    """Whether ``spec`` built with ``options`` learns across requests (a hybrid's parts get their defaults)."""
    from specserve.drafters.base import drafter_class

    names = _drafter_names(spec)
    if len(names) == 1:
        return drafter_class(names[0]).learns_across_requests_with(options)
    parts = options.get("part_options") or {}
    return any(drafter_class(name).learns_across_requests_with(parts.get(name, {})) for name in names)


def table_markdown(record: dict) -> str:
    """The recorded measurement as README's table."""
    chosen = record.get("chosen", record["default_drafter"])
    lines = ["| drafter | speedup vs plain | τ | tokens/s | speedup at temperature 1 |", "|---|---|---|---|---|"]
    rows = sorted(record["candidates"].items(), key=lambda kv: -kv[1]["speedup"])
    for name, r in rows:
        mark = " **(default)**" if name == chosen else ""
        if name in record.get("not_eligible", ()):
            mark += " (learns across requests: not eligible)"
        sampled = f"{r['sampled_speedup']:.2f}" if "sampled_speedup" in r else "–"
        lines.append(f"| `{name}`{mark} | {r['speedup']:.2f} | {r['tau']:.2f} | {r['tokens_per_s']:.0f} | {sampled} |")
    lines.append(f"| plain | 1.00 | 1.00 | {record['plain_tokens_per_s']:.0f} | 1.00 |")
    return "\n".join(lines)


def add_default_drafter_parser(tsub) -> None:
    """Register ``default-drafter`` on the ``train`` subparsers ``tsub``."""
    pick = tsub.add_parser("default-drafter", help="measure drafters on a model (held-out prompts, batch 1, greedy) and "
                                                   "make the fastest its default (drafter auto)")
    pick.add_argument("--model", default="default", choices=("default", "tiny"),
                      help="default: the default model (held-out chat questions; recorded in "
                           "specserve/default_model_drafters); tiny: the embedded code model (held-out code; its bundle)")
    pick.add_argument("--candidates", default=None,
                      help="comma-separated SPEC[#LABEL] (default: the model's shipped drafters, ngram, suffix "
                           "(shared and per request), lookahead and hybrids of them)")
    pick.add_argument("--candidate-option", action="append", default=[], metavar="[SPEC#LABEL:]KEY=VALUE",
                      help="an option of one candidate (repeatable), as `specserve eval --drafter-option`")
    pick.add_argument("--max-prompts", type=int, default=8)
    pick.add_argument("--max-tokens", type=int, default=64)
    pick.add_argument("--repeats", type=int, default=2)
    pick.add_argument("--threads", type=int, default=None)
    pick.add_argument("--out", default="runs/default-drafter", help="where the eval's report goes")
    pick.set_defaults(handler=cmd_default_drafter)


def cmd_default_drafter(args: argparse.Namespace) -> int:
    from specserve.evals.suite import parse_drafter_options

    if args.candidates:
        names = [c.strip() for c in args.candidates.split(",") if c.strip()]
        candidates = {name: DEFAULT_CANDIDATES[args.model].get(name, {}) for name in names}
    else:
        candidates = dict(DEFAULT_CANDIDATES[args.model])
    for name, extra in parse_drafter_options(args.candidate_option, list(candidates)).items():
        candidates[name] = {**candidates[name], **extra}
    record = pick_default_drafter(candidates, args.out, model=args.model, max_prompts=args.max_prompts,
                                  max_tokens=args.max_tokens, repeats=args.repeats, threads=args.threads,
                                  command="specserve train default-drafter " + " ".join(sys.argv[3:]))
    print(table_markdown(record))
    where = "specserve/default_model_drafters/MANIFEST.json" if args.model == "default" else "the bundle's MANIFEST.json"
    print(f"default drafter: {record['chosen']} (recorded in {where})")
    return 0
