"""An adaptive budget policy on a synthetic cost model, for tests that need it to cut trees.

On the tiny test models a real calibration says speculation rarely pays, so the adaptive policy would
mostly decode plainly and a losslessness test would prove little. This cost model makes a step of up
to `batch` rows cost one unit and each row past them `row_cost / batch` units, so with `batch`
requests decoding the policy keeps nodes worth more than about `row_cost` tokens and cuts the rest:
trees of every size go through the cut.
"""

from __future__ import annotations

import numpy as np

from specserve.budget import DraftPlan, StaticBudget
from specserve.speculation import AdaptiveBudget
from specserve.speculation.cost_model import DraftCost, VerifyCost


class FixedVerifyCost(VerifyCost):
    """A verify cost that measured steps do not move (the tiny model's real steps would)."""

    def observe(self, rows: int, seconds: float, sequences: int = 1) -> None:
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
    """Make `policy` the budget policy of an LLM's engine (its Speculator's)."""
    llm.engine.speculator.policy = policy


class IntermittentBudget(StaticBudget):
    """The drafter's budget on some steps and 0 on others, per request, from a seeded stream (and a
    random depth cap): requests go idle and resume, so drafters that read target features get them
    queued over several steps — the path adaptive speculation takes when it switches a request off."""

    def __init__(self, budget: int, max_depth: int, seed: int) -> None:
        super().__init__(budget)
        self.max_depth = max_depth
        self.rng = np.random.default_rng(seed)

    def plan(self, requests, fixed_rows) -> DraftPlan:
        budgets = [self.budget if self.rng.random() < 0.4 else 0 for _ in requests]
        return DraftPlan(budgets, int(self.rng.integers(1, self.max_depth + 1)))
