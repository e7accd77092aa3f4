"""An adaptive budget policy on a synthetic cost model, for tests that need it to cut trees.

On the tiny test models a real calibration says speculation rarely pays, so the adaptive policy would
mostly decode plainly and a losslessness test would prove little. This cost model makes a step of up
to `batch` rows cost one unit and each row past them `row_cost / batch` units, so with `batch`
requests decoding the policy keeps nodes worth more than about `row_cost` tokens and cuts the rest:
trees of every size go through the cut.
"""

from __future__ import annotations

from specserve.speculation import AdaptiveBudget
from specserve.speculation.cost_model import DraftCost, VerifyCost


class FixedVerifyCost(VerifyCost):
    """A verify cost that measured steps do not move (the tiny model's real steps would)."""

    def observe(self, rows: int, seconds: float) -> None:
        pass


class FreeDrafting(DraftCost):
    """Drafting predicted free: the scripted drafter's Python costs are not what these tests are about."""

    def __call__(self, levels: int, requests: int, backlog: int = 0) -> float:
        return 0.0


def cutting_policy(max_budget: int, max_depth: int, row_cost: float = 0.3, batch: int = 1) -> AdaptiveBudget:
    # A "step" of one second: the real overhead the policy measures (milliseconds on the tiny models)
    # then weighs nothing, and the synthetic verify cost decides.
    step, far = 1.0, batch * (max_budget + 2)
    cost = FixedVerifyCost([1, batch, far], [step, step * 1.000001, step * (1 + row_cost * (far - batch) / batch)])
    return AdaptiveBudget(max_budget=max_budget, max_depth=max_depth, verify_cost=cost, draft_cost=FreeDrafting())


def install(llm, policy) -> None:
    """Make `policy` the budget policy of an LLM's engine (the scheduler asks it too)."""
    llm.engine.budget_policy = policy
    llm.engine.scheduler.budget_policy = policy
