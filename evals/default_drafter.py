"""Pick the embedded bundle's default drafter by measurement (`specserve train default-drafter`).

It runs evaluations, so it lives here with them; `specserve.cli` adds it to the ``train`` commands
(`add_default_drafter_parser`), as training code does not import the evals.

`drafter="auto"` (the CLI's and the server's default) gives the embedded model the drafter recorded in
the bundle's MANIFEST. Which one that is is measured, not assumed: every candidate — the bundle's
trained drafters, the training-free ones and hybrids of both — runs the eval suite on the held-out
split of the builtin code dataset at batch 1, greedy, with adaptive speculation, in one run beside plain
decoding; the fastest by median speedup becomes ``default_drafter`` — among those within TIE (2 %) of
the fastest, a tie at this run's noise, the one with the highest τ (it speculates most where speculation
pays) — and the whole
table is recorded next to it (``default_drafter_eval``: command, date, machine, each candidate's
speedup, τ and tokens/s), so README's table and the choice come from the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

DATASET = "builtin:heldout-code"
TIE = 0.02  # speedups this close to the best are a tie: two runs of the same drafter differ by about this
DEFAULT_CANDIDATES = ("eagle", "medusa", "draft", "ngram", "suffix", "lookahead", "hybrid:suffix+eagle",
                      "hybrid:suffix+draft", "hybrid:ngram+suffix")


def pick_default_drafter(candidates: list[str], out: str, max_prompts: int = 8, max_tokens: int = 64,
                         repeats: int = 2, threads: int | None = None, command: str = "") -> dict:
    """Measure ``candidates`` on the embedded model and record the winner in the bundle's MANIFEST.
    Returns the recorded ``default_drafter_eval`` (with ``default_drafter``)."""
    from specserve.evals.suite import EvalConfig, run_eval
    from specserve.bundle_paths import MANIFEST, bundle_dir, bundle_manifest, default_model_dir, runs_on_bundle

    manifest = bundle_manifest()
    if manifest is None or default_model_dir() is None:
        raise ValueError(f"no embedded bundle in {str(bundle_dir())!r}: build it with `specserve train bundle` first")
    from specserve.drafters import registered_drafters

    known = registered_drafters()
    usable = [c for c in candidates
              if runs_on_bundle(c) and all(n in known for n in {c.partition(":")[0], *_drafter_names(c)})]
    dropped = sorted(set(candidates) - set(usable))
    if not usable:
        raise ValueError(f"none of the candidates {list(candidates)} can run on the embedded model")
    results = run_eval(EvalConfig(drafters=usable, dataset=DATASET, out=out, max_prompts=max_prompts,
                                  max_tokens=max_tokens, temperature=0.0, batch_size=1, repeats=repeats,
                                  threads=threads, progress=False))
    table = {name: {"speedup": round(r["speedup"], 3), "tau": round(r["tau"], 3), "tokens_per_s": round(r["tokens_per_s"], 1),
                    "identical": r["identical_fraction"]}
             for name, r in results["drafters"].items()}
    # The default must keep seeded sampling reproducible: drafters that learn across requests (suffix, and
    # hybrids with it) make a request's trees depend on what else the server ran. Measured, not chosen.
    eligible = [n for n in table if not _learns_across_requests(n)] or list(table)
    best = max(table[n]["speedup"] for n in eligible)
    winner = max((n for n in eligible if table[n]["speedup"] >= best - TIE), key=lambda n: (table[n]["tau"], table[n]["speedup"]))
    record = {"default_drafter": winner, "command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "dataset": DATASET, "prompts": results["settings"]["num_prompts"], "max_tokens": max_tokens, "repeats": repeats,
              "batch_size": 1, "temperature": 0.0, "speculation": "adaptive",
              "plain_tokens_per_s": round(results["plain"]["tokens_per_s"], 1), "machine": results["machine"],
              "candidates": table, "not_run": dropped,
              "not_eligible": sorted(n for n in table if _learns_across_requests(n))}
    manifest["default_drafter"] = winner
    manifest["default_drafter_eval"] = record
    path = bundle_dir() / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(path)
    return record


def _drafter_names(spec: str) -> list[str]:
    """The drafters a spec runs: a hybrid's parts (``hybrid:suffix+eagle`` → suffix, eagle), else its own."""
    name, _, path = spec.partition(":")
    return [p.strip().partition(":")[0] for p in path.split("+")] if name == "hybrid" else [name]


def _learns_across_requests(spec: str) -> bool:
    from specserve.drafters.base import drafter_class

    return any(drafter_class(n).learns_across_requests for n in _drafter_names(spec))


def table_markdown(record: dict) -> str:
    """The recorded measurement as README's table."""
    lines = ["| drafter | speedup vs plain | τ | tokens/s |", "|---|---|---|---|"]
    rows = sorted(record["candidates"].items(), key=lambda kv: -kv[1]["speedup"])
    for name, r in rows:
        mark = " **(default)**" if name == record["default_drafter"] else ""
        if name in record.get("not_eligible", ()):
            mark += " (learns across requests: not eligible)"
        lines.append(f"| `{name}`{mark} | {r['speedup']:.2f} | {r['tau']:.2f} | {r['tokens_per_s']:.0f} |")
    lines.append(f"| plain | 1.00 | 1.00 | {record['plain_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def add_default_drafter_parser(tsub) -> None:
    """Register ``default-drafter`` on the ``train`` subparsers ``tsub``."""
    pick = tsub.add_parser("default-drafter", help="measure drafters on the embedded model (held-out code, batch 1, "
                                                   "greedy) and make the fastest its default (drafter auto)")
    pick.add_argument("--candidates", default=None,
                      help="comma-separated drafter specs (default: the bundle's drafters, ngram, suffix, lookahead "
                           "and hybrids of them)")
    pick.add_argument("--max-prompts", type=int, default=8)
    pick.add_argument("--max-tokens", type=int, default=64)
    pick.add_argument("--repeats", type=int, default=2)
    pick.add_argument("--threads", type=int, default=None)
    pick.add_argument("--out", default="runs/default-drafter", help="where the eval's report goes")
    pick.set_defaults(handler=cmd_default_drafter)


def cmd_default_drafter(args: argparse.Namespace) -> int:
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else list(DEFAULT_CANDIDATES)
    record = pick_default_drafter(candidates, args.out, max_prompts=args.max_prompts, max_tokens=args.max_tokens,
                                  repeats=args.repeats, threads=args.threads,
                                  command="specserve train default-drafter " + " ".join(sys.argv[3:]))
    print(table_markdown(record))
    print(f"default drafter: {record['default_drafter']} (recorded in the bundle's MANIFEST.json)")
    return 0
