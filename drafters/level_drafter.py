"""Drafters that run their own model once per tree level: the draft model and EAGLE heads.

Each step, for all drafting requests of the batch together:

1. **catch up** (`_catch_up`, per drafter) — one batched forward over what each request committed
   since its last draft; its output at the root gives the depth-1 distribution.
2. **levels** d = 2 .. depth — the frontier of level d-1 (the `width` best nodes, `TreeBuilder`) is fed
   in one batched forward (`_feed_level`, per drafter) at cache slots past the committed entries, each
   frontier node seeing only its ancestors among the earlier levels' slots (a tail mask); its logits
   give the next level.
3. **cut** — each request keeps its best `budget` nodes (`TreeBuilder.finish`).

Constrained requests (`DraftRequest.mask`): before a level's logits reach the builder, every token
the grammar forbids after that frontier node's path gets -inf, so forbidden tokens are never drafted
and a sampled node's q is the masked draft distribution (sampling stays exact).

Tree growth, reranking and sampling run in compiled code on the host (`tree_builder`); only logits
cross into it, once per level. What each drafter feeds, and how it turns a frontier into model inputs,
is its own.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from specserve.drafters.base import Drafter, DraftRequest
from specserve.drafters.draft_rng import request_generator
from specserve.drafters.tree_builder import (Frontier, TreeBuilder, adjust_level, allowed_columns, draft_columns,
                                             mask_level, to_target_ids)
from specserve.verify import DraftTree


@dataclass
class LevelWork:
    """One drafting request of a `propose` call: its index in the call, view, node cap and levels."""

    index: int
    req: DraftRequest
    cap: int
    levels: int
    state: object


class LevelDrafter(Drafter):
    """Shared propose loop; subclasses set depth/topk/width/max_budget/seed and implement the hooks."""

    catches_up = True  # `_catch_up` feeds what was committed since the last draft
    drafts_by_level = True  # one drafter forward per level

    depth: int
    topk: int
    width: int
    seed: int
    vocab: int  # of the drafter's logits: the target's, or a draft vocabulary (EAGLE-3 heads, draft models)
    # A draft vocabulary's ids -> target ids int64[vocab]; None: the logits cover the target's vocabulary.
    # The tree builder works in draft ids; feeds, masks and the finished trees go through this map, so a
    # token outside the draft vocabulary is simply never drafted (verification is unchanged: lossless).
    id_map: np.ndarray | None = None
    _columns: np.ndarray | None = None  # `draft_columns` of id_map, made once (penalised requests need it)

    def propose(self, requests: list[DraftRequest], budgets: list[int], depth: int | None = None) -> list[DraftTree]:
        if len(budgets) != len(requests):
            raise ValueError(f"propose got {len(requests)} requests but {len(budgets)} budgets")
        trees = [DraftTree.empty() for _ in requests]
        work: list[LevelWork] = []
        for i, (req, budget) in enumerate(zip(requests, budgets)):
            budget = int(budget)
            if budget < 0:
                raise ValueError(f"budget for request {req.request_id!r} must be >= 0, got {budget}")
            state = self._prepare(req)
            cap = min(budget, self.max_budget)
            levels = min(self.depth if depth is None else depth, cap)
            if cap > 0 and levels >= 1:
                work.append(LevelWork(i, req, cap, levels, state))
        if not work:
            return trees
        logits = _numpy(self._catch_up(work))  # [A, V]
        temps = np.array([w.req.temperature for w in work], dtype=np.float32)
        builder = TreeBuilder(self.topk, self.depth, self.width, temps, self._uniforms(work, temps), self.vocab)
        grammars = [w.req.mask for w in work]
        constrained = any(g is not None for g in grammars)
        adjusters = [w.req.adjust for w in work]
        adjusted = any(adjusters)
        if adjusted:
            if self._columns is None:
                self._columns = draft_columns(self.id_map, self.vocab)
            adjust_level(logits[:, None], adjusters, builder, None, None, self._target_ids, self._columns)
        if constrained:
            mask_level(logits[:, None], grammars, builder, None, None, self._target_ids, self._draft_allowed)
        front = builder.add_level(logits)
        levels = np.array([w.levels for w in work])
        for level in range(2, self.depth + 1):
            active = np.flatnonzero(levels >= level)
            if not active.size:
                break
            logits = _numpy(self._feed_level(work, builder, front, active, level))  # [A', W, V]
            if adjusted:
                adjust_level(logits, adjusters, builder, front, active, self._target_ids, self._columns)
            if constrained:
                mask_level(logits, grammars, builder, front, active, self._target_ids, self._draft_allowed)
            front = builder.add_level(logits, active)
        for w, (tokens, parents, q_ids, q_probs, scores) in zip(work, builder.finish([w.cap for w in work])):
            if len(tokens):
                trees[w.index] = self._tree(tokens, parents, q_ids, q_probs, scores)
        return trees

    # ---- prefix caching: both subclasses keep `_state[request_id].num_cached` (their valid KV slots) ----

    def cached_prefix_len(self, request_id: str) -> int:
        state = self._state.get(request_id)
        return state.num_cached if state is not None else 0

    def start_from_prefix(self, request_id: str, num_tokens: int) -> None:
        self._state[request_id] = self._new_state(num_tokens)

    def catch_up(self, requests: list[DraftRequest]) -> None:
        """The catch-up forward of `propose` alone, for requests with more than their root to feed (a part
        of a hybrid that drafted them this step has nothing left to feed: it is skipped)."""
        work = []
        for i, req in enumerate(requests):
            state = self._prepare(req)  # queues the handed-over features either way
            if len(req.token_ids) - 1 - self.kv_lookahead > state.num_cached:
                work.append(LevelWork(i, req, 0, 0, state))
        if work:
            self._catch_up(work)

    @abstractmethod
    def _new_state(self, num_cached: int) -> object:
        """A fresh request state whose first `num_cached` KV slots are valid."""

    def _target_ids(self, ids: np.ndarray) -> np.ndarray:
        """Draft-vocabulary ids (any shape) as target ids."""
        return to_target_ids(self.id_map, ids)

    def _draft_allowed(self, allowed: np.ndarray) -> np.ndarray:
        """bool[target V] (a grammar's allowed tokens) -> bool[draft V]."""
        return allowed_columns(self.id_map, allowed, self.vocab)

    def _uniforms(self, work: list[LevelWork], temps: np.ndarray) -> np.ndarray | None:
        """One uniform per generated node for each sampled request, from its own seeded stream."""
        if not (temps > 0).any():
            return None
        size = self.topk + (self.depth - 1) * self.width * self.topk
        out = np.zeros((len(work), size))
        for a, w in enumerate(work):
            if temps[a] > 0:
                out[a] = torch.rand(size, generator=self._generator(w), dtype=torch.float64).numpy()
        return out

    def _generator(self, w: LevelWork) -> torch.Generator:
        state = w.state
        if getattr(state, "generator", None) is None:
            state.generator = request_generator(self.name, self.seed, w.req, torch.device("cpu"))
        return state.generator

    def _tree(self, tokens: np.ndarray, parents: np.ndarray, q_ids: np.ndarray | None,
              q_probs: np.ndarray | None, scores: np.ndarray) -> DraftTree:
        """A finished request's tree from the builder's draft-vocabulary ids (mapped to target ids)."""
        tokens = to_target_ids(self.id_map, tokens)
        q_ids = None if q_ids is None else to_target_ids(self.id_map, q_ids)  # -1 pads a node's compact q
        q = (torch.from_numpy(q_ids), torch.from_numpy(q_probs)) if q_ids is not None else (None, None)
        return DraftTree(torch.from_numpy(tokens), torch.from_numpy(parents), q_ids=q[0], q_probs=q[1],
                         scores=torch.from_numpy(scores))

    # ---- per drafter ------------------------------------------------------------------------------

    @abstractmethod
    def _prepare(self, req: DraftRequest) -> object:
        """Take what the engine handed over (features, ...) for every request, drafting or not; return
        the request's state object."""

    @abstractmethod
    def _catch_up(self, work: list[LevelWork]) -> torch.Tensor:
        """Feed what each request committed since its last draft; logits at its root [A, V]."""

    @abstractmethod
    def _feed_level(self, work: list[LevelWork], builder: TreeBuilder, front: Frontier, active: np.ndarray,
                    level: int) -> torch.Tensor:
        """Feed the frontier of level ``level - 1`` of the `active` requests; logits [A', W, V]."""


def _numpy(logits: torch.Tensor | np.ndarray) -> np.ndarray:
    """The logits for the tree builder, on the host (one copy per level from an accelerator)."""
    if isinstance(logits, np.ndarray):
        return logits
    if logits.device.type == "cpu" and logits.dtype is torch.float32:
        return logits.numpy()
    return logits.detach().float().cpu().numpy()
