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
    """Seconds of one step's target forward plus acceptance, as a function of its rows: piecewise
    linear between knots (rows, ascending), extrapolated along the last segment."""

    def __init__(self, knots: list[int], seconds: list[float]) -> None:
        if len(knots) != len(seconds) or not knots:
            raise ValueError("VerifyCost needs one time per knot")
        self.knots = np.asarray(knots, dtype=np.float64)
        self._knot_list = [float(k) for k in knots]
        self.seconds = np.maximum.accumulate(np.maximum(np.asarray(seconds, dtype=np.float64), 1e-7))

    def __call__(self, rows):
        """Predicted seconds for `rows` (a number, or an array of them). Called several times a step: a number
        is interpolated in plain Python (numpy's per-call overhead was most of its cost), an array by np.interp."""
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

    def observe(self, rows: int, seconds: float) -> None:
        """Move the two knots around `rows` towards a measured step, in proportion to their weight
        (scalar Python: this runs every step)."""
        predicted = self(rows)
        error = min(seconds, predicted * OUTLIER) - predicted
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
CALIBRATION_ROUNDS = 5  # up to 16 rows, where the differences that decide small trees are a few hundred µs
CALIBRATION_ROUNDS_LARGE = 2  # above: the forward is long, and compute-bound


def calibrate_verify_cost(time_forward: Callable[[int], float], max_rows: int) -> VerifyCost:
    """Time the target forward at rows 1, 2, 4, ... up to max_rows (after two warm-up forwards): the fastest of
    interleaved rounds per row count, the starting point the online corrections refine."""
    max_rows = max(1, max_rows)
    knots = sorted({min(1 << i, max_rows) for i in range(int(math.log2(max_rows)) + 2)})
    time_forward(1)
    time_forward(2)
    best = {k: math.inf for k in knots}
    for round_index in range(CALIBRATION_ROUNDS):
        for k in knots:
            if k <= 16 or round_index < CALIBRATION_ROUNDS_LARGE:
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
