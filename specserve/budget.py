"""How much each request drafts this step, and what a step taught us: the budget-policy seam.

A policy answers twice per step: `plan` before drafting (each request's node budget and the batch's
tree depth; 0 = plain decoding) and `cut` after it (each drafted tree may be cut to the nodes worth
verifying). After every step the engine hands it a `StepRecord` — what the step cost and earned. The
static policy lives here; the adaptive one in `specserve.speculation`. Hard limits (remaining tokens,
the context window, the drafter's own maximum) are applied by the scheduler and engine on top of any
policy. A policy never changes what is emitted, only how much is drafted and verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from specserve.verify import DraftTree

if TYPE_CHECKING:
    from specserve.request import Request


@dataclass(frozen=True)
class RequestStepRecord:
    """One verifying request's share of a step.

    budget:   nodes the policy allowed (after hard limits).
    drafted:  nodes its verified tree had (forced tokens included).
    depth:    its tree's depth.
    accepted: draft tokens accepted (the step emitted accepted + 1).
    accepted_nodes: the accepted path's node indices in the verified tree.
    caught_up: its drafter caught up on its backlog this step without drafting (`Drafter.catch_up`).
    """

    request_id: str
    budget: int
    drafted: int
    depth: int
    accepted: int
    accepted_nodes: tuple[int, ...] = ()
    caught_up: bool = False


@dataclass(frozen=True)
class StepRecord:
    """What one step cost and earned (ARCHITECTURE.md, "What crosses each boundary").

    requests:    every request that verified a tree this step (prefills finishing their prompt verify
                 the empty tree and are included with budget 0).
    num_tokens:  rows of the target forward (tree rows plus prefill chunks).
    num_prefill_tokens: of which prompt tokens.
    draft_s:     wall time of drafting (all requests together).
    verify_s:    wall time of the target forward and acceptance.
    step_s:      wall time of the whole step (scheduling, drafting, verify, commit, streaming).
    draft_depth: the plan's tree depth (levels a level drafter ran; 0 when nobody drafted).
    """

    requests: tuple[RequestStepRecord, ...]
    num_tokens: int
    num_prefill_tokens: int
    draft_s: float
    verify_s: float
    step_s: float = 0.0
    draft_depth: int = 0

    @property
    def num_drafting(self) -> int:
        """Requests the drafter was asked to draft for (budget > 0)."""
        return sum(rec.budget > 0 for rec in self.requests)


@dataclass(frozen=True)
class DraftPlan:
    """budgets: per decoding request, the most nodes its drafter may propose (0 = plain decoding);
    depth: the most levels any tree may have this step (None: the drafter's own depth)."""

    budgets: list[int]
    depth: int | None = None


class BudgetPolicy(Protocol):
    # Whether the engine times target forwards at start and hands them to `calibrate(time_forward,
    # max_rows, time_tree)` (`specserve.speculation.calibration`).
    wants_calibration: bool

    def plan(self, requests: list[Request], fixed_rows: int) -> DraftPlan:
        """Budgets before drafting. fixed_rows: forward rows this step has whatever is drafted (every
        decode's root plus prefill chunk tokens)."""

    def cut(self, requests: list[Request], trees: list[DraftTree], budgets: list[int], fixed_rows: int,
            draft_s: float) -> tuple[list[DraftTree], list[float | None]]:
        """The drafted trees (requests with budget 0 hold forced or empty trees, which stay as they are),
        cut to what is worth verifying; with each tree's predicted accepted length (None: no prediction).
        Kept nodes must be closed under ancestors and keep every earlier sibling of a kept sampled node."""

    def observe(self, record: StepRecord) -> None:
        """Learn from a finished step."""

    def release(self, request_id: str) -> None:
        """The request finished: forget it."""


class StaticBudget:
    """Every request gets the same budget (the drafter's default) and keeps its whole tree; 0 means
    plain decoding."""

    wants_calibration = False

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"draft budget must be >= 0, got {budget}")
        self.budget = budget

    def plan(self, requests: list[Request], fixed_rows: int) -> DraftPlan:
        return DraftPlan([self.budget] * len(requests))

    def cut(self, requests, trees, budgets, fixed_rows, draft_s):
        return trees, [None] * len(trees)

    def observe(self, record: StepRecord) -> None:
        """A static budget learns nothing."""

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""
