"""What a step costs on this machine: the target forward by rows, drafting by levels and batch.

Both are measured, never assumed: the verify cost is calibrated at engine start (a few forwards at
row counts 1, 2, 4, ...) and both are corrected online from every `StepRecord`. Costs are seconds.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable

import numpy as np

# Online correction rate: a step moves the prediction this fraction of the way to what it measured.
# Steps of a few milliseconds jitter by 10-30 % on a shared host; 0.05 averages ~20 steps.
RATE = 0.05
# A measurement more than this factor above the prediction is clipped (a GC pause, a page fault,
# another process, a first call compiling) before it corrects anything. Measurements below the
# prediction are not clipped: nothing makes a step spuriously fast.
OUTLIER = 3.0


class VerifyCost:
    """Seconds of one step's target forward plus acceptance, as a function of its rows and of how many
    sequences they belong to:

        cost(rows, sequences) = curve(rows) + offset(sequences)

    curve: piecewise linear between knots (rows, ascending), extrapolated along the last segment — one
    sequence's rows (calibrated on one sequence, learned online from steps of one sequence). offset: what
    each further sequence adds whatever its rows (its own attention over its context, its logits and
    bookkeeping), learned online per sequence count from steps of that many (offset(1) = 0). Rows of one
    sequence and rows of many cost differently: the default model's 8 rows took 12.6 ms as one sequence's
    and 21 ms as eight sequences' single rows (2026-12-03); folded into the curve, eight decodes' steps
    raised its 8-row knot to 21 ms and every knot above it to at least that, so the first 8 draft rows of
    a batch of 8 looked free and an adaptive batch of 8 verified at a loss. With the offset apart, the
    marginal cost of a draft row is the curve's at every batch size."""

    def __init__(self, knots: list[int], seconds: list[float]) -> None:
        if len(knots) != len(seconds) or not knots:
            raise ValueError("VerifyCost needs one time per knot")
        self.knots = np.asarray(knots, dtype=np.float64)
        self._knot_list = [float(k) for k in knots]
        self.seconds = np.maximum.accumulate(np.maximum(np.asarray(seconds, dtype=np.float64), 1e-7))
        self._offsets: dict[int, float] = {}  # sequences (> 1) -> learned offset
        self._offset_steps: dict[int, int] = {}

    def __call__(self, rows, sequences: int = 1):
        """Predicted seconds for `rows` (a number, or an array of them) of `sequences` sequences."""
        return self.curve(rows) + self.offset(sequences)

    def curve(self, rows):
        """One sequence's predicted seconds for `rows` (a number, or an array of them). Called several times a
        step: a number is interpolated in plain Python (numpy's per-call overhead was most of its cost), an array
        by np.interp."""
        knots, y = self._knot_list, self.seconds
        slope = (y[-1] - y[-2]) / (knots[-1] - knots[-2]) if len(knots) > 1 else 0.0  # past the last knot
        if isinstance(rows, (int, float, np.integer, np.floating)):
            r = float(rows)
            if r >= knots[-1]:
                return float(y[-1] + slope * (r - knots[-1]))
            i = bisect.bisect_right(knots, r)
            if i == 0:
                return float(y[0])
            w = (r - knots[i - 1]) / (knots[i] - knots[i - 1])
            return float(y[i - 1] + w * (y[i] - y[i - 1]))
        x = np.asarray(rows, dtype=np.float64)
        out = np.interp(x, self.knots, y)
        over = x > knots[-1]
        if over.any():
            out[over] = y[-1] + slope * (x[over] - knots[-1])
        return out

    def offset(self, sequences: int) -> float:
        """Seconds a step of `sequences` sequences costs beyond one sequence with as many rows: learned where
        steps of that many were seen, else interpolated linearly between the nearest counts seen (1 costs
        nothing), or scaled in proportion beyond the largest."""
        if sequences <= 1:
            return 0.0
        known = self._offsets.get(sequences)
        if known is not None:
            return known
        lower, lower_s = 1, 0.0
        for count in sorted(self._offsets):
            if count > sequences:
                w = (sequences - lower) / (count - lower)
                return lower_s + w * (self._offsets[count] - lower_s)
            lower, lower_s = count, self._offsets[count]
        return lower_s * (sequences - 1) / (lower - 1) if lower > 1 else 0.0

    def observe(self, rows: int, seconds: float, sequences: int = 1) -> None:
        """Learn from a measured step: one sequence's steps move the two knots around `rows` towards it, in
        proportion to their weight; a step of several sequences moves their offset (by the mean of its first
        steps, then at RATE). Scalar Python: this runs every step."""
        predicted = self(rows, sequences)
        error = min(seconds, predicted * OUTLIER) - predicted
        if sequences > 1:
            steps = self._offset_steps[sequences] = self._offset_steps.get(sequences, 0) + 1
            self._offsets[sequences] = self.offset(sequences) + max(RATE, 1.0 / steps) * error
            return
        knots, y = self.knots, self.seconds
        i = bisect.bisect_left(self._knot_list, rows)
        if i == 0 or len(knots) == 1:
            y[0] = max(y[0] + RATE * error, 1e-7)
            changed = 0
        elif i >= len(knots):
            y[-1] = max(y[-1] + RATE * error, y[-2])
            return
        else:
            w = (rows - knots[i - 1]) / (knots[i] - knots[i - 1])
            y[i - 1] = max(y[i - 1] + RATE * (1 - w) * error, 1e-7)
            y[i] += RATE * w * error
            changed = i - 1
        for j in range(max(changed, 1), len(y)):  # keep the cost non-decreasing in rows
            if y[j] < y[j - 1]:
                y[j] = y[j - 1]


# Calibration timings are taken in interleaved rounds (every row count in turn, then again), never one row count's
# repeats back to back: on a shared host a few milliseconds of contention then hit one round, not every timing of
# one knot. Measured on the default model (2026-12-03): a start-up calibration that timed each knot's repeats in a
# row read 2 rows as 1.20x one row (interleaved timings: 1.01x) and a tree's overhead as 6.6 ms (0.2-0.7 ms),
# which kept an adaptive engine from drafting for its whole life — both are only ever corrected by drafting steps.
CALIBRATION_ROUNDS = 3  # up to DENSE_ROWS rows, where the differences that decide small trees are a few hundred µs
CALIBRATION_ROUNDS_LARGE = 2  # above: the forward is long, and compute-bound
# Every row count up to DENSE_ROWS is its own knot, then every COARSE_STEP rows up to COARSE_ROWS, then powers
# of two. The products run rows in passes of a few rows (4 in our kernels), so the cost is a staircase, not a
# line: on the default model (Q4_1, 2026-12-03) 1 row 7.8 ms, 2-4 rows 8.8-8.9, 5 rows 10.6, 8 rows 12.6, 9 rows
# 14.8. Knots at 1, 2, 4, 8, 16 alone read 5 rows as 9.9 ms and 9 as 13.7 — a node that opens a pass priced at
# half its cost, which is what made an adaptive batch of 8 (8 rows before any draft) verify at a loss.
DENSE_ROWS = 16
COARSE_STEP = 4
COARSE_ROWS = 32


def calibration_knots(max_rows: int) -> list[int]:
    """The row counts the verify cost is timed at (ascending, up to max_rows, max_rows included)."""
    max_rows = max(1, max_rows)
    knots = set(range(1, min(DENSE_ROWS, max_rows) + 1))
    knots |= set(range(DENSE_ROWS + COARSE_STEP, min(COARSE_ROWS, max_rows) + 1, COARSE_STEP))
    knots |= {1 << i for i in range(max_rows.bit_length()) if (1 << i) <= max_rows}
    return sorted(knots | {max_rows})


def calibrate_verify_cost(time_forward: Callable[[int], float], max_rows: int) -> VerifyCost:
    """Time the target forward at `calibration_knots(max_rows)` (after two warm-up forwards): the fastest of
    interleaved rounds per row count, the starting point the online corrections refine."""
    knots = calibration_knots(max_rows)
    time_forward(1)
    time_forward(2)
    best = {k: math.inf for k in knots}
    for round_index in range(CALIBRATION_ROUNDS):
        for k in knots:
            if k <= DENSE_ROWS or round_index < CALIBRATION_ROUNDS_LARGE:
                best[k] = min(best[k], time_forward(k))
    return VerifyCost(knots, [best[k] for k in knots])


def calibrate_tree_cost(time_forward: Callable[[int], float], time_tree: Callable[[int], float], nodes: int) -> float:
    """What verifying one tree costs beyond its rows: a chain of `nodes` draft tokens verified (tree
    mask, tree acceptance) against a plain forward of as many rows — the median of interleaved pairs' differences
    (after a warm-up of the tree path), so a moment of contention in either timing moves nothing. Measured at
    start because learning it only online never started: a request that decodes plainly verifies trees only in
    its rare probes, which run the tree path cold (1.3-3.5 ms per tree measured, against 0.6-0.8 ms in steady
    drafting), and a cost learned from them kept speculation off where it paid 2.8x (suffix drafting on
    repetitive text)."""
    nodes = max(1, nodes)
    time_tree(nodes)
    time_tree(nodes)
    differences = []
    for _ in range(CALIBRATION_ROUNDS):
        tree = time_tree(nodes)
        differences.append(tree - time_forward(nodes + 1))
    return max(float(np.median(differences)), 0.0)


class DraftCost:
    """Seconds of drafting one step, linear in what the drafter does:

        draft_s ≈ a · levels + b · levels · requests + c · backlog

    levels: tree levels drafted (one drafter forward each for level drafters; 1 for drafters that draft
    a whole tree at once, `levels=False`); requests: requests drafting; backlog: tokens the drafting requests committed since they last drafted, which a drafter
    with its own model or features must feed before it can draft (its catch-up). Fitted online by
    recursive least squares with forgetting; with nothing measured it predicts 0, so the first steps
    draft and measure (exploration, not a guess).
    """

    FORGET = 0.98  # weight of older steps per new step (~50 steps of memory)

    # Three parameters, updated every drafting step: plain Python floats (numpy's 3x3 products cost ~40 us a
    # step in call overhead alone, most of the policy's bookkeeping).
    def __init__(self, levels: bool = True, backlog: bool = True) -> None:
        # backlog=False (drafters without a catch-up: n-gram, suffix, Medusa): the term is left out —
        # with the few drafting steps a mostly-plain request gives, least squares otherwise pinned
        # drafting time on it (~38 µs per token from 3 probes of an n-gram drafter that has no catch-up),
        # which priced every probe out.
        self.backlog = backlog
        self.levels = levels
        self.theta = [0.0, 0.0, 0.0]
        self.cov = [[1e4 if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.seen = 0
        self.warmed = False  # the first drafting step (first calls, compiling) teaches nothing

    def _features(self, levels: int, requests: int, backlog: int) -> tuple[float, float, float]:
        levels = levels if self.levels else 1
        return float(levels), float(levels * requests), float(backlog if self.backlog else 0)

    def __call__(self, levels: int, requests: int, backlog: int = 0) -> float:
        if levels <= 0 or requests <= 0 or not self.seen:
            return 0.0
        return max(_dot3(self._features(levels, requests, backlog), self.theta), 0.0)

    def observe(self, levels: int, requests: int, backlog: int, seconds: float) -> None:
        if levels <= 0 or requests <= 0:
            return
        if not self.warmed:
            self.warmed = True
            return
        x, cov, theta = self._features(levels, requests, backlog), self.cov, self.theta
        predicted = _dot3(x, theta)
        if self.seen:
            seconds = min(seconds, max(predicted, 1e-5) * OUTLIER)
        px = [_dot3(row, x) for row in cov]
        denom = self.FORGET + _dot3(x, px)
        gain = [p / denom for p in px]
        error = seconds - predicted
        self.theta = [max(theta[i] + gain[i] * error, 0.0) for i in range(3)]
        self.cov = [[(cov[i][j] - gain[i] * px[j]) / self.FORGET for j in range(3)] for i in range(3)]
        trace = self.cov[0][0] + self.cov[1][1] + self.cov[2][2]
        if trace > 1e8:  # directions no step excites grow without bound under forgetting: cap them
            self.cov = [[c * 1e8 / trace for c in row] for row in self.cov]
        self.seen += 1


def _dot3(a, b) -> float:
    """a · b of two 3-sequences of floats (the drafting cost's features, parameters and covariance rows)."""
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
