"""Step hooks: the one way per-request rules (a grammar today; penalties, logit bias and tool calls next)
reach the step. The engine, the Speculator and the Verifier call these protocols and name no rule.

Two scopes (ARCHITECTURE.md, "Where things plug in"):

- A **`RequestRule`** belongs to one request. A `RuleFactory` installed on the engine's `StepHooks` makes
  it when the request is admitted (or declines: most requests carry no rule), and every step asks it,
  where it applies:
    * `process_logits` — edit the request's verify rows' logits in place *before* greedy and sampled
      acceptance, so what it masks is masked for the argmax, the sampled distribution and the
      residuals alike (a grammar's forbidden tokens);
    * `forced_tokens` — tokens it leaves no choice about, drafted for free as a chain from the root
      (outside the drafter's budget, inside the KV reservation `EngineConfig.max_forced_tokens`),
      verified like any draft node, never trusted blindly;
    * `draft_mask` — what a drafter masks its own proposals with (`DraftMask`), so its q is the masked q;
    * `draft_logits` — how a drafter edits its own logits the way the rule edits the target's
      (`DraftLogits`: penalties), so its drafts follow what they will be verified against;
    * `filter_tree` — drop proposed nodes the rule forbids before they cost a verify row;
    * `accept_token` — told every emitted token, in order; may stop the request (`TokenVerdict`).
  A row's distribution is that of the token *after* it (verify/tree.py): row 0 the root's, row i + 1
  node i's.
- A **`LogitsProcessor`** or **`ForcedTokens`** source installed on `StepHooks` directly sees every
  request of the step: the batch-level seams (tests plug scripted ones in here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch

from specserve.verify import DraftTree

if TYPE_CHECKING:
    from specserve.request import Request


@dataclass(frozen=True)
class VerifyRows:
    """The verify rows of a step: request b owns rows ``cu_rows[b] .. cu_rows[b+1] - 1`` — its root row
    first, then node i's row at ``cu_rows[b] + 1 + i``. A prefill finishing its prompt owns one row
    (its last prompt token: the empty tree's root)."""

    requests: Sequence[Request]
    trees: Sequence[DraftTree]
    cu_rows: np.ndarray  # int64[B+1]

    def node_of_row(self, row: int) -> tuple[int, int]:
        """(request index, node index or -1 for the root) of a verify row."""
        b = int(np.searchsorted(self.cu_rows, row, side="right") - 1)
        return b, row - int(self.cu_rows[b]) - 1


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, rows: VerifyRows) -> None:
        """Modify logits float32[R, vocab] (the step's verify rows, on the model's device) in place."""


class ForcedTokens(Protocol):
    def __call__(self, request: Request) -> Sequence[int]:
        """Tokens forced right after the request's root (empty: none this step)."""


class DraftMask(Protocol):
    def allowed(self, path: Sequence[int] = ()) -> np.ndarray | None:
        """bool[vocab] of the tokens allowed after the root + `path` (None: no restriction). Read-only:
        the mask's own state is as it was after the call."""


class DraftLogits(Protocol):
    def adjust(self, row: np.ndarray, path: Sequence[int], draft_columns: np.ndarray) -> None:
        """Edit float32[V_draft] — a drafter's logits for the token after the root + `path` (target ids) —
        in place, as the rule edits the target's verify rows (penalties, bias), so drafts follow the
        distribution they will be verified against. draft_columns: int64[V_target], each target id's
        column in the row (-1: not in the drafter's vocabulary)."""


@dataclass(frozen=True)
class TokenVerdict:
    """What a rule says of an emitted token. reason: the request's finish reason ("stop", "error");
    keep: whether the token is part of the output (False: the request ends without it); error: why,
    when reason is "error"."""

    reason: str
    keep: bool = True
    error: str | None = None


class RequestRule:
    """One request's rule in the step. Every method's default does nothing, so a rule overrides what it
    needs. Never called for tokens the request did not emit: `accept_token` sees accepted tokens only.

    constrains_output: the rule enforces the request's `SamplingParams.constraint` (an engine refuses a
    constrained request that no rule takes: its constraint would be silently ignored)."""

    constrains_output: ClassVar[bool] = False

    def process_logits(self, logits: torch.Tensor, tree: DraftTree) -> None:
        """Edit float32[N+1, vocab] — this request's verify rows, root row first (a view: in place)."""

    def forced_tokens(self) -> Sequence[int]:
        return ()

    def draft_mask(self) -> DraftMask | None:
        return None

    def draft_logits(self) -> DraftLogits | None:
        return None

    def filter_tree(self, tree: DraftTree) -> DraftTree:
        return tree

    def accept_token(self, token: int) -> TokenVerdict | None:
        return None

    def release(self) -> None:
        """The request finished or was cancelled."""


class RuleFactory(Protocol):
    def __call__(self, request: Request) -> RequestRule | None:
        """The rule for a request being admitted (None: none); ValueError refuses the request."""


@dataclass
class StepHooks:
    """What an engine's step consults besides the model and the drafter (empty by default)."""

    rule_factories: list[RuleFactory] = field(default_factory=list)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    forced_tokens: list[ForcedTokens] = field(default_factory=list)

    def rules_for(self, request: Request) -> tuple[RequestRule, ...]:
        """Each factory's rule for a request being admitted; ValueError when one refuses it or when its
        output constraint has no rule to enforce it."""
        rules = tuple(rule for make in self.rule_factories if (rule := make(request)) is not None)
        if request.params.constraint is not None and not any(rule.constrains_output for rule in rules):
            raise ValueError("this engine enforces no output constraints (json_schema / regex / grammar / choice): "
                             "build it through specserve.LLM, which installs them")
        return rules

    def forced(self, request: Request) -> list[int]:
        """The first non-empty forced tokens of the request's rules, else of the batch-level sources."""
        for rule in request.rules:
            tokens = list(rule.forced_tokens())
            if tokens:
                return tokens
        for source in self.forced_tokens:
            tokens = list(source(request))
            if tokens:
                return tokens
        return []

    @staticmethod
    def draft_mask(request: Request) -> DraftMask | None:
        for rule in request.rules:
            mask = rule.draft_mask()
            if mask is not None:
                return mask
        return None

    @staticmethod
    def draft_logits(request: Request) -> tuple[DraftLogits, ...]:
        return tuple(adjust for rule in request.rules if (adjust := rule.draft_logits()) is not None)

    @staticmethod
    def filter_tree(request: Request, tree: DraftTree) -> DraftTree:
        for rule in request.rules:
            if tree.num_nodes:
                tree = rule.filter_tree(tree)
        return tree

    @staticmethod
    def accept_token(request: Request, token: int) -> TokenVerdict | None:
        """Tell every rule; the first verdict that drops the token wins, else the first stop."""
        verdicts = [v for rule in request.rules if (v := rule.accept_token(token)) is not None]
        return next((v for v in verdicts if not v.keep), verdicts[0] if verdicts else None)

    @staticmethod
    def release(request: Request) -> None:
        for rule in request.rules:
            rule.release()
