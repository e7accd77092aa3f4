"""How much each request drafts each step: the static policy and the adaptive one (issue 14).

`make_budget_policy` is what `LLM(speculation=...)` uses; `AdaptiveBudget` is the policy itself
(`adaptive.py`), built on a measured cost model (`cost_model.py`) and calibrated node values
(`node_values.py`).
"""

from __future__ import annotations

from specserve.budget import StaticBudget
from specserve.speculation.adaptive import AdaptiveBudget
from specserve.speculation.cost_model import DraftCost

SPECULATION_MODES = ("adaptive", "static")

# Calibration forwards go up to this many rows; beyond it the cost is extrapolated (linear: the
# forward is compute-bound long before) and corrected online.
CALIBRATION_MAX_ROWS = 64
# Cached keys before the timed rows: about a prompt and a reply, so the rows' attention costs what a
# verify row's does.
CALIBRATION_CONTEXT = 128


def make_budget_policy(mode: str, drafter):
    """The budget policy for ``LLM(speculation=mode)``: "static" gives every request the drafter's own
    budget and depth; "adaptive" sizes each request's tree each step from measured cost and
    acceptance, with the drafter's budget and depth as upper bounds. The engine calibrates it."""
    if mode not in SPECULATION_MODES:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {mode!r}")
    budget = drafter.max_budget if drafter is not None else 0
    if mode == "static" or not budget:
        return StaticBudget(budget)
    return AdaptiveBudget(max_budget=budget, max_depth=max(1, int(getattr(drafter, "depth", 1) or 1)),
                          whole_trees=not drafter.drafts_by_level,
                          draft_cost=DraftCost(levels=drafter.drafts_by_level, backlog=drafter.catches_up))
