"""What one `specserve eval` run measured so far, and its summary (the body of results.json).

`RunData` collects raw measurements as they finish; `summarize` can be called at any time (after
each prompt group, on Ctrl-C) and summarises only what is complete: a speedup uses only the
(repeat, group) keys plain decoding finished too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.evals.datasets import EvalPrompt
from specserve.evals.metrics import (
    Measurement,
    SpecCounts,
    identical_fraction,
    median_of,
    ratio,
    speedup,
    tokens_per_s,
)

PLAIN = "plain"


@dataclass
class RunData:
    prompts: list[EvalPrompt]
    groups: list[list[int]]  # prompt indices per group; one group never mixes categories
    drafters: list[str]
    peers: list[str]
    greedy: bool
    measurements: list[Measurement] = field(default_factory=list)
    outputs: dict[tuple[str, int, int], list[int]] = field(default_factory=dict)  # (system, repeat, prompt) → ids
    stats: dict[tuple[str, int, int], object] = field(default_factory=dict)  # (drafter, repeat, prompt) → SpecStats
    valid: dict[tuple[str, int, int], bool] = field(default_factory=dict)  # constrained prompts' outputs: valid?

    def record(self, system: str, repeat: int, group: int, seconds: float, outputs: list[list[int]], stats=None,
               valid: list[bool | None] | None = None) -> None:
        """valid: per output, whether it satisfies its prompt's constraint (None: unconstrained prompt)."""
        idx = self.groups[group]
        category = self.prompts[idx[0]].category
        self.measurements.append(Measurement(system, repeat, group, seconds, sum(len(o) for o in outputs), category))
        for k, (i, out) in enumerate(zip(idx, outputs)):
            self.outputs[(system, repeat, i)] = list(out)
            if stats is not None:
                self.stats[(system, repeat, i)] = stats[k]
            if valid is not None and valid[k] is not None:
                self.valid[(system, repeat, i)] = bool(valid[k])

    def categories(self) -> list[str]:
        return list(dict.fromkeys(p.category for p in self.prompts))


def _timing(data: RunData, system: str, category: str | None) -> dict:
    ms = [m for m in data.measurements if m.system == system and (category is None or m.category == category)]
    plain = [m for m in data.measurements if m.system == PLAIN and (category is None or m.category == category)]
    tps = tokens_per_s(ms)
    out = {"tokens_per_s": median_of(tps), "tokens_per_s_spread": tps}
    if system != PLAIN:
        sp = speedup(plain, ms)
        out |= {"speedup": median_of(sp), "speedup_spread": sp}
        pairs = [(data.outputs[(PLAIN, r, i)], ids) for (s, r, i), ids in data.outputs.items()
                 if s == system and (PLAIN, r, i) in data.outputs
                 and (category is None or data.prompts[i].category == category)]
        out["identical_fraction"] = identical_fraction(pairs) if data.greedy else None
    flags = [ok for (s, _, i), ok in data.valid.items()
             if s == system and (category is None or data.prompts[i].category == category)]
    out["validity"] = sum(flags) / len(flags) if flags else None  # constrained outputs that satisfy their constraint
    out["constrained_outputs"] = len(flags)
    out["prompts_done"] = len({i for (s, _, i) in data.outputs if s == system
                               and (category is None or data.prompts[i].category == category)})
    return out


def _drafter(data: RunData, spec: str, category: str | None) -> dict:
    counts = SpecCounts.total(st for (s, _, i), st in data.stats.items()
                              if s == spec and (category is None or data.prompts[i].category == category))
    return counts.summary() | _timing(data, spec, category)


def summarize(data: RunData) -> dict:
    """results.json's measured part: plain, drafters, peers, and the best drafter's figures on top."""
    cats = data.categories()
    drafters = {}
    for spec in data.drafters:
        entry = _drafter(data, spec, None)
        entry["per_category"] = {c: _drafter(data, spec, c) for c in cats}
        drafters[spec] = entry
    plain = _timing(data, PLAIN, None)
    plain["per_category"] = {c: _timing(data, PLAIN, c) for c in cats}
    ranked = [s for s in data.drafters if drafters[s]["speedup"] is not None]
    best = max(ranked, key=lambda s: drafters[s]["speedup"]) if ranked else None
    best_tps = drafters[best]["tokens_per_s"] if best else None
    peers = {}
    for name in data.peers:
        entry = _timing(data, name, None)
        entry["best_drafter_over_peer"] = ratio(best_tps, entry["tokens_per_s"])
        peers[name] = entry
        for spec in data.drafters:
            drafters[spec].setdefault("over_peers", {})[name] = ratio(drafters[spec]["tokens_per_s"], entry["tokens_per_s"])
    top = {"best_drafter": best}
    for key in ("tau", "acceptance_per_position", "speedup", "speedup_spread", "identical_fraction", "tokens_per_s",
                "tokens_per_s_spread", "draft_tokens_per_step", "accepted_tokens_per_step", "validity", "per_category"):
        top[key] = drafters[best][key] if best else None
    return top | {"plain": plain, "drafters": drafters, "peers": peers}
