"""The target forward of one step: a `ScheduledStep` and the decodes' trees become ONE `StepBatch`.

Row layout of the batch: every decoding request brings its root (the pending token) and its tree's
nodes — positions ``committed_len + depth``, the tree's ancestor mask, logits at every row — then every
prefill chunk its prompt tokens (causal; logits only at the prompt's last token, when the chunk
completes the prompt). The logits therefore come out in `VerifyRows` order: decodes' verify rows, then
one row per completed prompt (its first token is that empty tree's bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.kv_cache import PagedKVCache
from specserve.model import LlamaModel
from specserve.request import Request
from specserve.scheduler import ScheduledStep
from specserve.step_batch import StepBatchBuilder
from specserve.verify import DraftTree


@dataclass(frozen=True)
class StepForward:
    """What the step's forward produced.

    verifying:  requests with verify rows: the decodes, then the prefills that completed their prompt.
    trees:      their trees (empty for the completed prompts).
    logits:     float32[R, vocab] their verify rows, request after request (`VerifyRows` order).
    first_rows: per scheduled sequence (decodes, then prefill chunks), its first row in the batch:
                hidden states are returned for every row, so a sequence's features start there.
    hidden:     {layer: float[T, hidden]} the target features of every row (empty when no drafter reads them).
    num_tokens: rows of the batch.
    prompt_rows: for prefill chunks of requests asking for prompt log-probabilities, (request, first
                position predicted, raw logits float32[m, vocab]): row j predicts prompt token start + j.
    """

    verifying: list[Request]
    trees: list[DraftTree]
    logits: torch.Tensor
    first_rows: list[int]
    hidden: dict[int, torch.Tensor]
    num_tokens: int
    prompt_rows: list = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, hidden_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.cache = cache
        self.hidden_layers = hidden_layers

    def run(self, step: ScheduledStep, trees: list[DraftTree]) -> StepForward:
        builder = StepBatchBuilder(self.cache.allocator)
        hidden = bool(self.hidden_layers)
        first_rows = []
        for r, tree in zip(step.decodes, trees):
            tokens, positions, mask = verify_rows(r.token_ids[-1:], r.num_cached, tree)
            first_rows.append(builder.add(r.request_id, r.num_cached, tokens, positions, mask, logits="all", hidden=hidden))
        verify_count = sum(t.num_nodes + 1 for t in trees)
        keep = None  # logit rows that are verify rows, when prompt rows sit among them
        prompt_spans = []  # (request, first predicted position, first logit row, rows)
        for chunk in step.prefills:
            req = chunk.request
            logits = "last" if chunk.completes_prompt else "none"
            if req.params.prompt_logprobs is not None:
                # Logits at every prompt row: row p predicts token p + 1 (the last completing row is the
                # verify row of the first output token, as usual).
                logits = "all"
                if keep is None:
                    keep = list(range(verify_count))
                n = chunk.end - chunk.start
                m = n - 1 if chunk.completes_prompt else n
                prompt_spans.append((req, chunk.start + 1, verify_count, m))
                if chunk.completes_prompt:
                    keep.append(verify_count + m)
                verify_count += n
            elif chunk.completes_prompt:
                if keep is not None:
                    keep.append(verify_count)
                verify_count += 1
            first_rows.append(builder.add(req.request_id, chunk.start, req.token_ids[chunk.start:chunk.end],
                                          logits=logits, hidden=hidden))
        batch = builder.build()
        out = self.model.forward(batch, self.cache, self.hidden_layers)
        logits = out.logits
        prompt_rows = [(req, start, logits[row:row + m]) for req, start, row, m in prompt_spans if m]
        if keep is not None:
            logits = logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]
        done = [c.request for c in step.prefills if c.completes_prompt]
        return StepForward(
            verifying=list(step.decodes) + done,
            trees=list(trees) + [DraftTree.empty()] * len(done),
            logits=logits,
            first_rows=first_rows,
            hidden=out.hidden_states,
            num_tokens=batch.num_tokens,
            prompt_rows=prompt_rows,
        )

    def forward_scratch(self, seq_id: str, start: int, tokens: np.ndarray, tree: DraftTree | None = None) -> torch.Tensor:
        """A forward of a sequence outside the scheduler (cost calibration): `tokens` at `start`, causal — or
        laid out as a verify step when `tree` is given (tokens[0] the root, then the tree's nodes). The
        sequence's blocks are the caller's. Returns float32[len(tokens), vocab], logits at every row."""
        builder = StepBatchBuilder(self.cache.allocator)
        positions = mask = None
        if tree is not None:
            tokens, positions, mask = verify_rows(tokens[:1], start, tree)
        builder.add(seq_id, start, tokens, positions, mask, logits="all")
        return self.model.forward(builder.build(), self.cache, self.hidden_layers).logits


def verify_rows(root: np.ndarray, num_cached: int, tree: DraftTree) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The rows a decode brings to the batch: (tokens int64[N+1] — its root then the tree's nodes,
    positions int64[N+1] — ``num_cached + depth``, mask bool[N, N] — the tree's ancestor mask); positions
    and mask are None for the empty tree (one causal row)."""
    if not tree.num_nodes:
        return root, None, None
    tokens = np.concatenate([root, tree.tokens.numpy()])
    positions = num_cached + np.concatenate([[0], tree.depths.numpy()])
    return tokens, positions, tree.ancestor_mask.numpy()
