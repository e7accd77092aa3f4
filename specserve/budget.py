"""How many draft nodes each request may have this step.

The policy is its own object so the adaptive one (batch size, measured verify cost, measured
acceptance) replaces this one without touching the step loop. Hard limits — remaining tokens and the
context window — are applied by the engine on top of any policy.
"""

from __future__ import annotations

from specserve.request import Request


class StaticBudget:
    """Every request gets the same budget (the drafter's default); 0 means plain decoding."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"draft budget must be >= 0, got {budget}")
        self.budget = budget

    def budgets(self, requests: list[Request]) -> list[int]:
        return [self.budget] * len(requests)
