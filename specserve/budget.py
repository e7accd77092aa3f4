"""How many draft nodes each request may have this step, and what a step taught us.

The policy is its own object so the adaptive one (batch size, measured verify cost, measured
acceptance) replaces the static one without touching the step loop. After every step the engine hands
the policy a `StepRecord` — the only thing a policy learns from. Hard limits (remaining tokens, the
context window, the drafter's own maximum) are applied by the scheduler and engine on top of any policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specserve.request import Request


@dataclass(frozen=True)
class RequestStepRecord:
    """One verifying request's share of a step.

    budget:   nodes the policy allowed (after hard limits).
    drafted:  nodes its tree had (forced tokens included).
    depth:    its tree's depth.
    accepted: draft tokens accepted (the step emitted accepted + 1).
    """

    request_id: str
    budget: int
    drafted: int
    depth: int
    accepted: int


@dataclass(frozen=True)
class StepRecord:
    """What one step cost and earned (design.md §3).

    requests:    every request that verified a tree this step (prefills finishing their prompt verify
                 the empty tree and are included with budget 0).
    num_tokens:  rows of the target forward (tree rows plus prefill chunks).
    num_prefill_tokens: of which prompt tokens.
    draft_s:     wall time of drafting (all requests together).
    verify_s:    wall time of the target forward and acceptance.
    """

    requests: tuple[RequestStepRecord, ...]
    num_tokens: int
    num_prefill_tokens: int
    draft_s: float
    verify_s: float


class BudgetPolicy(Protocol):
    def budgets(self, requests: list[Request]) -> list[int]:
        """Nodes each decoding request may draft this step (0 = plain decoding for it)."""

    def observe(self, record: StepRecord) -> None:
        """Learn from a finished step."""


class StaticBudget:
    """Every request gets the same budget (the drafter's default); 0 means plain decoding."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"draft budget must be >= 0, got {budget}")
        self.budget = budget

    def budgets(self, requests: list[Request]) -> list[int]:
        return [self.budget] * len(requests)

    def observe(self, record: StepRecord) -> None:
        """A static budget learns nothing."""
