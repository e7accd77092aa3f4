"""results.json → report.md and PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

PLOTS = {
    "accept_length": "accept_length_hist.png",
    "acceptance": "acceptance_per_position.png",
    "speedup": "speedup.png",
}


def write_json(results: dict, out_dir: Path) -> Path:
    """Write results.json atomically (a reader never sees half a file, Ctrl-C never leaves one)."""
    path = out_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, path)
    return path


def _f(x, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _range(s: dict | None, fmt: str = ".2f") -> str:
    return "–" if not s else f"{s['median']:{fmt}} [{s['min']:{fmt}}–{s['max']:{fmt}}]"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def markdown(results: dict, plots: list[str]) -> str:
    s = results["settings"]
    lines = [
        "# specserve eval",
        "",
        f"Status: **{results['status']}**. Model `{s['model']}`, dataset `{s['dataset']}` "
        f"({s['num_prompts']} prompts), max_tokens {s['max_tokens']}, temperature {s['temperature']}, "
        f"batch size {s['batch_size']}, repeats {s['repeats']}, threads {s['threads']}, device {results['machine']['device']} "
        f"({results['machine']['cpu']}).",
        "",
        f"Best drafter by speedup: **{results.get('best_drafter') or '–'}**.",
        "",
        "Tokens/s and speedup are medians over repeats [min–max]; speedup is against plain decoding of the",
        "same target measured in the same run, interleaved per prompt group. Identical = outputs equal to",
        "plain decoding token for token (greedy only).",
        "",
    ]
    constrained = bool(s.get("constrained_prompts"))
    if constrained:
        lines += [f"{s['constrained_prompts']} prompts are constrained (grammar drafting "
                        f"`{s.get('grammar_drafting')}`; plain decoding masks verification only): valid = outputs of "
                        "constrained prompts that satisfy their constraint.", ""]
    valid_head, valid_rule = (" valid |", "---|") if constrained else ("", "")

    def valid(entry: dict) -> str:
        return f" {_pct(entry.get('validity'))} |" if constrained else ""

    lines += [
        "| system | tokens/s | speedup vs plain | τ | draft tokens/step | accepted/step | identical |" + valid_head,
        "|---|---|---|---|---|---|---|" + valid_rule,
        f"| plain | {_range(results['plain'].get('tokens_per_s_spread'), '.1f')} | 1.00 | 1.00 | 0 | 0 | – |"
        + valid(results["plain"]),
    ]
    for spec, d in results["drafters"].items():
        lines.append(f"| {spec} | {_range(d.get('tokens_per_s_spread'), '.1f')} | {_range(d.get('speedup_spread'))} | "
                     f"{_f(d.get('tau'))} | {_f(d.get('draft_tokens_per_step'))} | {_f(d.get('accepted_tokens_per_step'))} | "
                     f"{_pct(d.get('identical_fraction'))} |" + valid(d))
    for name, p in results["peers"].items():
        lines.append(f"| {name} | {_range(p.get('tokens_per_s_spread'), '.1f')} | {_range(p.get('speedup_spread'))} "
                     f"| – | – | – | {_pct(p.get('identical_fraction'))} |" + valid(p))
    if results["peers"] and results["drafters"]:
        lines += ["", "Our drafters' tokens/s over each peer's:", "",
                  "| drafter | " + " | ".join(results["peers"]) + " |", "|---|" + "---|" * len(results["peers"])]
        for spec, d in results["drafters"].items():
            ratios = (_f(d.get("over_peers", {}).get(n)) + "×" for n in results["peers"])
            lines.append(f"| {spec} | " + " | ".join(ratios) + " |")
    depth = max((len(d.get("acceptance_per_position") or []) for d in results["drafters"].values()), default=0)
    if depth:
        lines += ["", "Acceptance rate per draft depth (accepted at depth d / drafted at depth d):", "",
                  "| drafter | " + " | ".join(str(d + 1) for d in range(depth)) + " |", "|---|" + "---|" * depth]
        for spec, d in results["drafters"].items():
            acc = d.get("acceptance_per_position") or []
            lines.append(f"| {spec} | " + " | ".join(_f(acc[i]) if i < len(acc) else "–" for i in range(depth)) + " |")
    for spec, d in results["drafters"].items():
        cats = d.get("per_category") or {}
        if len(cats) < 2 and spec != results.get("best_drafter"):
            continue
        lines += ["", f"Per category, `{spec}`:", "",
                  "| category | prompts | τ | speedup | tokens/s | identical |", "|---|---|---|---|---|---|"]
        for cat, c in cats.items():
            lines.append(f"| {cat} | {c.get('prompts_done', 0)} | {_f(c.get('tau'))} | {_f(c.get('speedup'))} | "
                         f"{_f(c.get('tokens_per_s'), '.1f')} | {_pct(c.get('identical_fraction'))} |")
    if plots:
        lines += [""] + [f"![{p}]({p})" for p in plots]
    v = results["versions"]
    lines += ["", f"Versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, specserve {v['specserve']}.", ""]
    return "\n".join(lines)


def write_report(results: dict, out_dir: Path) -> list[Path]:
    """report.md and the plots; returns the paths written."""
    plots = write_plots(results, out_dir)
    path = out_dir / "report.md"
    path.write_text(markdown(results, [p.name for p in plots]))
    return [path, *plots]


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    drafters = results["drafters"]
    hist = {s: d.get("accept_length_histogram") or [] for s, d in drafters.items()}
    if any(hist.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(hist))
        for k, (spec, h) in enumerate(hist.items()):
            xs = [a + 1 + (k - (len(hist) - 1) / 2) * width for a in range(len(h))]
            ax.bar(xs, h, width, label=f"{spec} (τ={_f(drafters[spec].get('tau'))})")
        ax.set(xlabel="tokens emitted per verify step (accepted + bonus)", ylabel="fraction of steps", title="Acceptance length")
        ax.legend()
        written.append(_save(fig, out_dir / PLOTS["accept_length"]))
    acc = {s: d.get("acceptance_per_position") or [] for s, d in drafters.items()}
    if any(acc.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        for spec, a in acc.items():
            if a:
                ax.plot(range(1, len(a) + 1), a, marker="o", label=spec)
        ax.set(xlabel="draft depth", ylabel="acceptance rate", ylim=(0, 1.05), title="Acceptance per position")
        ax.legend()
        written.append(_save(fig, out_dir / PLOTS["acceptance"]))
    bars = [("plain", 1.0, 1.0, 1.0)]
    for name, entry in [*drafters.items(), *results["peers"].items()]:
        sp = entry.get("speedup_spread")
        if sp:
            bars.append((name, sp["median"], sp["min"], sp["max"]))
    if len(bars) > 1:
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(bars)), 4))
        names = [b[0] for b in bars]
        meds = [b[1] for b in bars]
        err = [[m - lo for _, m, lo, _ in bars], [hi - m for _, m, _, hi in bars]]
        colors = ["grey"] + ["tab:blue" if n in drafters else "tab:orange" for n in names[1:]]
        ax.bar(names, meds, yerr=err, capsize=4, color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(ylabel="speedup over our plain decoding", title="Speed (median over repeats, min–max)")
        ax.tick_params(axis="x", rotation=20)
        written.append(_save(fig, out_dir / PLOTS["speedup"]))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
