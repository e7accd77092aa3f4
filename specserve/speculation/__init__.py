"""Speculation: the `Speculator` that owns it in the step (`speculator.py`), and how much each request
drafts — the static policy and the adaptive one.

`make_budget_policy` is what `LLM(speculation=...)` uses; `AdaptiveBudget` is the policy itself
(`adaptive.py`), built on a measured cost model (`cost_model.py`) and calibrated node values
(`node_values.py`), calibrated at start (`calibration.py`).
"""

from __future__ import annotations

from pathlib import Path

from specserve.numba_cache import register_package

register_package(Path(__file__).parent)  # before its numba functions are defined: see numba_cache

from specserve.budget import StaticBudget
from specserve.speculation.adaptive import AdaptiveBudget
from specserve.speculation.cost_model import DraftCost

SPECULATION_MODES = ("adaptive", "static")


def make_budget_policy(mode: str, drafter):
    """The budget policy for ``LLM(speculation=mode)``: "static" gives every request the drafter's own
    budget and depth; "adaptive" sizes each request's tree each step from measured cost and
    acceptance, with the drafter's budget and depth as upper bounds. The engine calibrates it
    (`calibration.calibrate_policy`)."""
    if mode not in SPECULATION_MODES:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {mode!r}")
    budget = drafter.max_budget if drafter is not None else 0
    if mode == "static" or not budget:
        return StaticBudget(budget)
    return AdaptiveBudget(max_budget=budget, max_depth=max(1, drafter.depth),
                          whole_trees=not drafter.drafts_by_level,
                          draft_cost=DraftCost(levels=drafter.drafts_by_level, backlog=drafter.catches_up))
