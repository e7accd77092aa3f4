"""The seams of the step that later features fill: logits processors and forced tokens.

- A **logits processor** sees the target's logits of every verify row of the step, in place, *before*
  greedy and sampled acceptance — so whatever it masks (a grammar's forbidden tokens) is masked for
  the argmax, the sampled distribution and the residuals alike. `VerifyRows` tells it which request
  and which tree node each row belongs to (a row's distribution is that of the token *after* it).
- **Forced tokens**: tokens a constraint leaves no choice about join the request's tree as a chain
  from its root, outside the drafter's budget (the drafter is not asked that step) but inside the
  KV reservation (`EngineConfig.max_forced_tokens`); they are verified like any draft node, never
  trusted blindly, so tokenisation stays the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specserve.request import Request
from specserve.verify import DraftTree


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
        """Tokens a constraint forces right after the request's root (empty: none this step)."""
