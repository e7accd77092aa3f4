"""Pure metric computations for `specserve eval`: no models, no I/O, unit-testable from hand-built traces.

Vocabulary (as in specserve.request.SpecStats):

- a **step** is one verify forward of a request; it emits ``accepted + 1`` tokens (the bonus token
  always comes), so plain decoding has τ = 1.
- **τ** (mean accepted length) = tokens emitted per step, bonus included.
- **acceptance at depth d** = steps whose draft token at depth d was accepted / steps whose tree
  reached depth d.
- a **measurement** is one timed ``generate`` of one prompt group by one system in one repeat; the
  speedup of a system is computed only over (repeat, group) keys that plain decoding also finished.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Sequence


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))


def _add_into(dst: list[int], src: Sequence[int]) -> None:
    _grow(dst, len(src))
    for i, v in enumerate(src):
        dst[i] += int(v)


@dataclass
class SpecCounts:
    """Speculation counts summed over requests (or built step by step from a hand-written trace).

    accepted_per_position[d-1]: steps whose depth-d draft token was accepted.
    drafted_per_position[d-1]:  steps whose tree reached depth d.
    accepted_length_counts[a]:  steps that accepted exactly a draft tokens (emitted a + 1).
    """

    steps: int = 0
    emitted: int = 0
    drafted_nodes: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_length_counts: list[int] = field(default_factory=list)

    def add_step(self, depth: int, accepted: int, nodes: int | None = None) -> "SpecCounts":
        """One verify step: a tree `depth` deep with `nodes` nodes (default: a chain, nodes = depth)
        of which a root→node path of `accepted` tokens was accepted."""
        nodes = depth if nodes is None else nodes
        if not 0 <= accepted <= depth <= nodes:
            raise ValueError(f"a step needs 0 <= accepted <= depth <= nodes, got {accepted}, {depth}, {nodes}")
        self.steps += 1
        self.emitted += accepted + 1
        self.drafted_nodes += nodes
        _add_into(self.drafted_per_position, [1] * depth)
        _add_into(self.accepted_per_position, [1] * accepted + [0] * (depth - accepted))
        _grow(self.accepted_length_counts, accepted + 1)
        self.accepted_length_counts[accepted] += 1
        return self

    def add(self, stats) -> "SpecCounts":
        """Add a `SpecStats` (or another SpecCounts, or SpecStats.to_dict()) into these counts."""
        get = stats.get if isinstance(stats, dict) else lambda k, d=None: getattr(stats, k, d)
        if isinstance(stats, SpecCounts):
            steps, emitted, drafted = stats.steps, stats.emitted, stats.drafted_nodes
        else:
            steps = get("num_steps")
            drafted = get("num_drafted")
            emitted = get("num_emitted")
            if emitted is None:  # to_dict() form carries τ, not the emitted count
                emitted = round(get("mean_accepted_length") * steps)
        self.steps += int(steps)
        self.emitted += int(emitted)
        self.drafted_nodes += int(drafted)
        _add_into(self.accepted_per_position, get("accepted_per_position") or [])
        _add_into(self.drafted_per_position, get("drafted_per_position") or [])
        counts = get("accepted_length_counts")
        if counts is None:
            raise ValueError("speculation stats lack accepted_length_counts (SpecStats records them per step)")
        _add_into(self.accepted_length_counts, counts)
        return self

    @classmethod
    def total(cls, stats: Iterable) -> "SpecCounts":
        out = cls()
        for s in stats:
            out.add(s)
        return out

    @property
    def tau(self) -> float | None:
        return self.emitted / self.steps if self.steps else None

    @property
    def acceptance_per_position(self) -> list[float]:
        acc = self.accepted_per_position + [0] * (len(self.drafted_per_position) - len(self.accepted_per_position))
        return [a / d if d else 0.0 for a, d in zip(acc, self.drafted_per_position)]

    @property
    def drafted_per_step(self) -> float | None:
        """Draft tokens (tree nodes) proposed per step."""
        return self.drafted_nodes / self.steps if self.steps else None

    @property
    def accepted_per_step(self) -> float | None:
        """Draft tokens accepted per step (τ − 1)."""
        return (self.emitted - self.steps) / self.steps if self.steps else None

    @property
    def accept_length_histogram(self) -> list[float]:
        """[a] = fraction of steps that accepted exactly a draft tokens."""
        total = sum(self.accepted_length_counts)
        return [c / total for c in self.accepted_length_counts] if total else []

    def summary(self) -> dict:
        return {
            "tau": self.tau,
            "acceptance_per_position": self.acceptance_per_position,
            "draft_tokens_per_step": self.drafted_per_step,
            "accepted_tokens_per_step": self.accepted_per_step,
            "steps": self.steps,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "accept_length_counts": list(self.accepted_length_counts),
            "accept_length_histogram": self.accept_length_histogram,
        }


# ---- timing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One timed generate: `system` ran prompt group `group` in repeat `repeat`."""

    system: str
    repeat: int
    group: int
    seconds: float
    tokens: int
    category: str = ""

    @property
    def key(self) -> tuple[int, int]:
        return (self.repeat, self.group)


def spread(values: Sequence[float]) -> dict | None:
    """Median, min, max and quartiles (inclusive method) of `values`; None when there are none."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0], xs[0], xs[0])
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3, "n": len(xs)}


def _by_repeat(ms: Iterable[Measurement]) -> dict[int, list[Measurement]]:
    out: dict[int, list[Measurement]] = {}
    for m in ms:
        out.setdefault(m.repeat, []).append(m)
    return out


def tokens_per_s(ms: Sequence[Measurement]) -> dict | None:
    """Spread over repeats of (tokens generated in the repeat) / (seconds it took)."""
    rates = [sum(m.tokens for m in group) / sum(m.seconds for m in group)
             for group in _by_repeat(ms).values() if sum(m.seconds for m in group) > 0]
    return spread(rates)


def speedup(plain: Sequence[Measurement], other: Sequence[Measurement]) -> dict | None:
    """Speedup of `other` over `plain` on the (repeat, group) keys both finished.

    Per repeat: (other's tokens/s) / (plain's tokens/s) over the matched groups; the figure is the
    spread of those over repeats. ``per_prompt`` is the spread of the per-group ratios (each group
    is one prompt at batch size 1), which shows how much prompts differ.
    """
    plain_by_key = {m.key: m for m in plain}
    matched = [(plain_by_key[m.key], m) for m in other if m.key in plain_by_key and m.seconds > 0]
    if not matched:
        return None
    per_repeat: dict[int, list[tuple[Measurement, Measurement]]] = {}
    for p, o in matched:
        per_repeat.setdefault(o.repeat, []).append((p, o))
    ratios = []
    for pairs in per_repeat.values():
        p_rate = sum(p.tokens for p, _ in pairs) / sum(p.seconds for p, _ in pairs)
        o_rate = sum(o.tokens for _, o in pairs) / sum(o.seconds for _, o in pairs)
        ratios.append(o_rate / p_rate)
    out = spread(ratios)
    out["per_prompt"] = spread([(o.tokens / o.seconds) / (p.tokens / p.seconds) for p, o in matched])
    return out


def identical_fraction(pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> float | None:
    """Fraction of (reference, output) token sequences that are equal; None when there are none."""
    flags = [list(a) == list(b) for a, b in pairs]
    return sum(flags) / len(flags) if flags else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median_of(s: dict | None) -> float | None:
    return s["median"] if s else None

