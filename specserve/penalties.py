"""Penalties, logit bias and min_tokens as step hooks: a request whose `SamplingParams.penalized` gets a
`PenaltyRule` that edits its verify rows' logits before acceptance (specserve/step_hooks.py), so greedy
and sampled speculation stay exact relative to plain penalised decoding.

Definitions (each row's logits, in this order):
  repetition_penalty r (transformers' / vLLM's): for every token in the prompt or generated so far,
      logit / r if logit > 0 else logit × r;
  frequency_penalty f, presence_penalty p (OpenAI's): logit -= f × count + p × (count > 0), where count
      is how often the token was generated (the prompt does not count);
  logit_bias: logit += bias[token];
  min_tokens m: end-of-sequence tokens get -inf while fewer than m tokens were generated.

Under speculation "generated so far" is per row: row 0 (the root) sees the committed output, row i + 1
(node i) the committed output plus the drafted tokens on the path root → node i, node i included — what
plain decoding would have generated had it taken that path. The tree's ancestor mask gives every row its
path at once, so one small matrix product counts them all.

Cost: only the columns a penalty can touch are gathered — the tokens of the prompt (repetition only),
the output and the tree — so a step costs O(rows × distinct tokens), not O(rows × vocabulary).
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.step_hooks import RequestRule
from specserve.verify import DraftTree

__all__ = ["PenaltyRule", "PenaltyRules"]


class PenaltyRule(RequestRule):
    """One request's penalties: counts of its committed output tokens, advanced by `accept_token`."""

    def __init__(self, params, prompt_ids: np.ndarray, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.presence, self.frequency = float(params.presence_penalty), float(params.frequency_penalty)
        self.repetition = float(params.repetition_penalty)
        self.min_tokens = int(params.min_tokens)
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
        self.counts = np.zeros(vocab_size, dtype=np.float32)  # float32[V]: times each token was generated
        self.generated = 0
        self.output_tokens: list[int] = []  # distinct generated tokens, first appearance order
        # The repetition penalty also reaches prompt tokens; the others only generated ones.
        self.prompt_tokens = np.unique(prompt_ids) if self.repetition != 1 else np.zeros(0, dtype=np.int64)
        bias = params.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.int64)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
        self.counted = self.presence != 0 or self.frequency != 0 or self.repetition != 1
        self._fixed: tuple | None = None  # `_fixed_columns`, keyed by the drafter's column map

    def process_logits(self, logits: torch.Tensor, tree: DraftTree) -> None:
        """logits float32[N+1, V] (this request's verify rows, in place)."""
        if self.counted:
            self._penalise(logits, tree)
        if self.bias_ids.numel():
            logits[:, self.bias_ids.to(logits.device)] += self.bias_values.to(logits.device)
        if self.min_tokens > self.generated and self.eos.numel():
            # Row r emits the token after generated + depth(r) tokens: banned while that is < min_tokens.
            depths = np.concatenate([[0], tree.depths.numpy()])  # int64[N+1]
            rows = torch.from_numpy(np.flatnonzero(self.generated + depths < self.min_tokens)).to(logits.device)
            eos = self.eos.to(logits.device)
            logits[rows[:, None], eos[None, :]] = float("-inf")

    def _penalise(self, logits: torch.Tensor, tree: DraftTree) -> None:
        tree_tokens = tree.tokens.numpy()
        cols = np.unique(np.concatenate([self.prompt_tokens, np.asarray(self.output_tokens, dtype=np.int64),
                                         tree_tokens]))  # int64[C]: the only columns any penalty touches
        if not len(cols):
            return
        # counts float32[N+1, C]: committed counts, plus each row's own drafted path (row 0: none).
        counts = np.repeat(self.counts[cols][None, :], tree.num_nodes + 1, axis=0)
        if tree.num_nodes:
            onehot = np.zeros((tree.num_nodes, len(cols)), dtype=np.float32)  # node j -> its token's column
            onehot[np.arange(tree.num_nodes), np.searchsorted(cols, tree_tokens)] = 1.0
            on_path = tree.ancestor_mask.numpy()[:, 1:].astype(np.float32)  # [N+1, N]: node j on row r's path
            counts += on_path @ onehot
        index = torch.from_numpy(cols).to(logits.device)
        in_prompt = torch.from_numpy(np.isin(cols, self.prompt_tokens)).to(logits.device)
        values = self._penalised(logits.index_select(1, index), torch.from_numpy(counts).to(logits.device), in_prompt)
        logits.index_copy_(1, index, values)

    def _penalised(self, values: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor) -> torch.Tensor:
        """The penalties of the module docstring, verify rows and drafters alike: values and counts
        float32[..., C] (logits and generation counts of C tokens), in_prompt bool[C]."""
        if self.repetition != 1:
            seen = (counts > 0) | in_prompt
            scaled = torch.where(values > 0, values / self.repetition, values * self.repetition)
            values = torch.where(seen, scaled, values)
        if self.frequency:
            values = values - self.frequency * counts
        if self.presence:
            values = values - self.presence * (counts > 0).to(values.dtype)
        return values

    def draft_logits(self):
        return self  # drafters that draft from their own logits apply the same penalties (`adjust`)

    def adjust(self, row: np.ndarray, path, draft_columns: np.ndarray) -> None:
        """A drafter's row float32[V_draft] for the token after the root + `path` (target ids), edited as
        `process_logits` edits the verify row of the node at the end of that path (draft_columns:
        int64[V_target], each target id's column in the row, -1 where the drafter's vocabulary lacks it):
        drafts then follow the penalised distribution they are verified against, instead of being
        rejected for what the penalties took away."""

        def columns(target_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """(their draft columns, the target ids that have one)."""
            ids = target_ids[target_ids < len(draft_columns)]
            cols = draft_columns[ids]
            return cols[cols >= 0], ids[cols >= 0]

        if self.counted:
            path = np.asarray(path, dtype=np.int64)
            cols, targets = columns(np.unique(np.concatenate(
                [self.prompt_tokens, np.asarray(self.output_tokens, dtype=np.int64), path])))
            counts = self.counts[targets]
            if len(path):
                counts = counts + (targets[:, None] == path[None, :]).sum(1).astype(np.float32)
            values = self._penalised(torch.from_numpy(row[cols]), torch.from_numpy(counts),
                                     torch.from_numpy(np.isin(targets, self.prompt_tokens)))
            row[cols] = values.numpy()
        if self.bias_ids.numel() or self.eos.numel():
            bias_cols, bias_values, eos_cols = self._fixed_columns(draft_columns, columns)
            row[bias_cols] += bias_values
            if self.min_tokens > self.generated + len(path):
                row[eos_cols] = -np.inf

    def _fixed_columns(self, draft_columns: np.ndarray, columns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logit_bias's draft columns, their biases, the EOS tokens' draft columns) for this drafter's
        column map: the same for every node of every step, so found once per map."""
        if self._fixed is None or self._fixed[0] is not draft_columns:
            bias_cols, bias_targets = columns(self.bias_ids.numpy())
            bias_values = self.bias_values.numpy()[np.isin(self.bias_ids.numpy(), bias_targets)]
            self._fixed = (draft_columns, bias_cols, bias_values, columns(self.eos.numpy())[0])
        return self._fixed[1:]

    def accept_token(self, token: int):
        if self.counts[token] == 0:
            self.output_tokens.append(token)
        self.counts[token] += 1
        self.generated += 1
        return None


class PenaltyRules:
    """The rule factory an `LLM` installs on its engine: a PenaltyRule for each penalised request; a
    logit_bias naming a token outside the vocabulary refuses the request (ValueError)."""

    def __init__(self, vocab_size: int, eos_token_ids) -> None:
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)

    def __call__(self, request) -> PenaltyRule | None:
        params = request.params
        if not params.penalized:
            return None
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return PenaltyRule(params, request.token_ids[: request.prompt_len], self.vocab_size, self.eos_token_ids)
