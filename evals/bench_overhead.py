"""`specserve bench overhead`: host time per engine step, by phase, with every forward replaced by its
precomputed output — what the step costs besides its kernels, the figure that matters on a GPU (an
8B target's step is ~6 ms there; host work must stay well under a millisecond).

For each drafter and batch size: one real run records every model forward's output in order (the
target's, and the drafter's own model or head), then the same scripted run (greedy, the same
prompts, static budgets so nothing learns between runs) is replayed with `NullForwards` handing the
recorded outputs back. The replay must emit the same tokens as the real run (checked: greedy output
is a pure function of the forwards' outputs); its time is host work alone. Phases wrap the owners of
the step (ARCHITECTURE.md): schedule (Scheduler), draft (Speculator.propose, the drafter's own host
work included), batch (ModelRunner.run: the StepBatch; its forward is a null one), accept
(Verifier.accept), commit (KV move, Speculator.commit, prefix cache), emit (detokenise, stop checks),
observe (the policy's record). Medians over --repeats replays.

`--cold` replays as the CPU runs: before each replayed target forward a `CacheFlusher` streams the target's weight
bytes through the caches (untimed), as the real forward's weights do. Host work then meets cold caches, as it does
between real forwards: on the default model a greedy verify's acceptance took 64-82 µs warm and 350-630 µs after an
80 MB stream (BENCHMARKS.md, "Where a drafting step's time goes").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict

import numpy as np

from specserve.evals.common import machine, parse_batch_sizes, set_threads, start_cold, write_json

GOALS_MS = {1: 0.3, 32: 1.5}  # the speculation-efficiency issue's goals (draft model, EAGLE, n-gram)
PHASES = ("schedule", "draft", "batch", "accept", "commit", "emit", "observe")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafters", default="none,ngram,draft,eagle", help="comma-separated drafter specs ('none': plain)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="replays per cell (the median is reported)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cold", action="store_true",
                   help="before each replayed target forward, stream the target's weight bytes through the caches "
                        "(untimed), as the real forward does: host work as it runs between real forwards on the CPU")
    p.add_argument("--json", default=None, metavar="FILE")


class NullForwards:
    """Record, then replay, the outputs of a set of forward callables (`owner.attr`), in call order.

    While recording, each call runs the real forward and keeps a detached copy of its output (kernels
    may reuse output buffers); while replaying, each call returns the next recorded output without
    computing anything — so a replayed run costs only the host work around the forwards. flush: called before
    each replayed output of the first target (the target model's forward), e.g. a `CacheFlusher`."""

    def __init__(self, targets: list[tuple[object, str]], flush=None) -> None:
        self.targets = targets
        self.flush = flush
        self.recorded: dict[int, list] = defaultdict(list)
        self.replaying = False
        self._next: dict[int, int] = {}
        for k, (owner, attr) in enumerate(targets):
            setattr(owner, attr, self._wrap(k, getattr(owner, attr)))

    def _wrap(self, k: int, real):
        def forward(*args, **kwargs):
            if self.replaying:
                if k == 0 and self.flush is not None:
                    self.flush()
                i = self._next[k]
                self._next[k] = i + 1
                return self.recorded[k][i]
            out = _detached(real(*args, **kwargs))
            self.recorded[k].append(out)
            return out

        return forward

    def replay(self) -> None:
        self.replaying = True
        self._next = {k: 0 for k in range(len(self.targets))}

    def all_replayed(self) -> bool:
        return all(self._next[k] == len(self.recorded[k]) for k in range(len(self.targets)))


class CacheFlusher:
    """Streams `nbytes` through the caches on each call, as a forward's weight stream does, and keeps the seconds it
    took (`seconds`, `calls`) so that a timed replay can leave them out."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.buffer = np.ones(max(self.nbytes // 4, 1), dtype=np.float32)
        self.seconds = 0.0
        self.calls = 0

    def __call__(self) -> None:
        t0 = time.perf_counter()
        self.buffer.sum()  # reads every cache line of the buffer once
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def _detached(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if dataclasses.is_dataclass(out):
        return dataclasses.replace(out, **{f.name: _detached(getattr(out, f.name)) for f in dataclasses.fields(out)})
    if isinstance(out, dict):
        return {k: _detached(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return type(out)(_detached(v) for v in out)
    return out


class TreeLog:
    """Every step's verified trees (tokens and parents per decode), to check a replay drafts what the real
    run drafted, not only that it emits the same tokens."""

    def __init__(self, speculator) -> None:
        self.steps: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []
        self.enabled = True
        real = speculator.propose

        def propose(step):
            proposal = real(step)
            if self.enabled:
                self.steps.append([(tuple(t.tokens.tolist()), tuple(t.parents.tolist())) for t in proposal.trees])
            return proposal

        speculator.propose = propose


class PhaseClock:
    """Accumulates wall time per phase by wrapping the step owners' methods on their instances."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.speculator, "propose", "draft")
        self._wrap(engine.runner, "run", "batch")
        self._wrap(engine.verifier, "accept", "accept")
        self._wrap(engine, "_keep_accepted", "commit")
        self._wrap(engine.speculator, "commit", "commit")
        self._wrap(engine, "_offer_blocks", "commit")
        self._wrap(engine, "_emit", "emit")
        self._wrap(engine.speculator, "observe", "observe")
        real_step = engine.step

        def step():
            self.steps += 1
            t0 = time.perf_counter()
            try:
                return real_step()
            finally:
                self.seconds["step"] += time.perf_counter() - t0

        engine.step = step

    def _wrap(self, owner, attr: str, phase: str) -> None:
        real = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0


def forward_targets(llm) -> list[tuple[object, str]]:
    """Every forward a step of this LLM runs: the target model's, and the drafter's model or head."""
    targets: list[tuple[object, str]] = [(llm.model, "forward")]
    drafter = llm.engine.drafter
    if drafter is None:
        return targets
    for part in getattr(drafter, "parts", None) or [drafter]:  # a hybrid's parts, else the drafter itself
        if hasattr(part, "model") and part.model is not llm.model:  # a draft model
            targets.append((part.model, "forward"))
        if hasattr(part, "head"):  # an EAGLE head: its layer(s) and its LM head
            targets += [(part.head, "forward"), (part.head, "fuse"), (part.head, "logits")]
    return targets


def measure(drafter: str | None, batch: int, max_tokens: int, repeats: int, prompts: list[str],
            cold: bool = False) -> tuple[dict, object]:
    """One cell: the real run, a checked replay, then `repeats` timed null-forward replays (cold: each replayed
    target forward streams the target's weight bytes through the caches first, its time left out). Returns the
    figures and the LLM."""
    from specserve import LLM, SamplingParams

    # Static budgets and no prefix caching: a replay must run exactly the real run's forwards.
    llm = LLM(drafter=drafter, speculation="static", max_num_seqs=batch, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    llm.generate(batch_prompts[:1], params)  # warm-up: kernels compiled, first-call costs paid
    flusher = CacheFlusher(llm.model.bytes_read_per_token()) if cold else None
    nulls = NullForwards(forward_targets(llm), flush=flusher)
    trees = TreeLog(llm.engine.speculator)
    clock = PhaseClock(llm.engine)

    def run() -> list[list[int]]:
        start_cold(llm)
        return [o.token_ids for o in llm.generate(batch_prompts, params)]

    t0 = time.perf_counter()
    real = run()
    real_s, real_steps = time.perf_counter() - t0, clock.steps
    real_trees, trees.steps = trees.steps, []
    nulls.replay()  # the check, untimed: a replay drafts, verifies and emits what the real run did
    replayed = run()
    if replayed != real or trees.steps != real_trees or not nulls.all_replayed():
        raise RuntimeError(f"{drafter or 'plain'} batch {batch}: the replay diverged from the real run "
                           f"(tokens equal: {replayed == real}, trees equal: {trees.steps == real_trees})")
    trees.enabled = False
    rounds = []
    for _ in range(repeats):
        clock.reset()
        if flusher is not None:
            flusher.seconds, flusher.calls = 0.0, 0
        nulls.replay()
        run()
        seconds = dict(clock.seconds)
        if flusher is not None:  # the stream ran inside the batch phase (the runner's null forward): not host work
            seconds["batch"] -= flusher.seconds
            seconds["step"] -= flusher.seconds
        rounds.append(dict(seconds, steps=clock.steps))
    steps = rounds[0]["steps"]
    per_step_ms = {p: statistics.median(r.get(p, 0.0) for r in rounds) / steps * 1e3 for p in PHASES + ("step",)}
    per_step_ms["other"] = per_step_ms["step"] - sum(per_step_ms[p] for p in PHASES)
    tokens = sum(len(t) for t in real)
    return {"drafter": drafter or "plain", "batch": batch, "steps": steps, "tokens": tokens,
            "host_ms_per_step": {k: round(v, 4) for k, v in per_step_ms.items()},
            "real_ms_per_step": round(real_s / real_steps * 1e3, 4),
            "host_share": round(per_step_ms["step"] / (real_s / real_steps * 1e3), 3),
            "tokens_per_step": round(tokens / steps / batch, 3),
            "cold_bytes": flusher.nbytes if flusher is not None else 0,
            "cold_streams": flusher.calls if flusher is not None else 0,  # in the last replay: one per step
            "goal_ms": GOALS_MS.get(batch)}, llm


def run(args: argparse.Namespace) -> int:
    from specserve.evals.datasets import heldout_prompts

    drafters = [None if d.strip() == "none" else d.strip() for d in args.drafters.split(",") if d.strip()]
    batches = parse_batch_sizes(args.batch_sizes)
    if not drafters or args.repeats < 1 or args.max_tokens < 2:
        raise ValueError("--drafters must be non-empty, --repeats >= 1, --max-tokens >= 2")
    set_threads(args.threads)
    prompts = heldout_prompts(32, chars=200)
    cells = []
    print(f"{'drafter':<10} {'batch':>5} {'tok/step':>8} " + " ".join(f"{p:>8}" for p in PHASES)
          + f" {'other':>7} {'host ms':>8} {'real ms':>8} {'host %':>7} goal")
    for drafter in drafters:
        for batch in batches:
            cell, llm = measure(drafter, batch, args.max_tokens, args.repeats, prompts, cold=args.cold)
            cells.append(cell)
            ms = cell["host_ms_per_step"]
            goal = cell["goal_ms"]
            verdict = "" if goal is None else (f"<= {goal}: " + ("met" if ms["step"] <= goal else "missed"))
            print(f"{cell['drafter']:<10} {batch:>5} {cell['tokens_per_step']:>8.2f} "
                  + " ".join(f"{ms[p]:>8.3f}" for p in PHASES)
                  + f" {ms['other']:>7.3f} {ms['step']:>8.3f} {cell['real_ms_per_step']:>8.3f} "
                  f"{100 * cell['host_share']:>6.1f}% {verdict}", flush=True)
    settings = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    write_json({"cells": cells, "settings": settings, "machine": machine(llm)}, args.json)
    return 0
