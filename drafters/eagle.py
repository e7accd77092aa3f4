"""The ``eagle`` drafter: an EAGLE head drafts EAGLE-2 dynamic trees from the target's own features.

``eagle:DIR`` loads a head from DIR (``specserve train eagle``, or a public EAGLE-1/2/3 layout;
see drafters/eagle_checkpoint.py); a bare ``eagle`` means the bundle's head when the target is the
bundled default model. The head's KV cache lives on the engine's block allocator: a request's
block table addresses its head entries too, reserved when the request was admitted.

Each step (the shared loop of `level_drafter`, trees grown by `tree_builder` with width = topk):

1. **absorb** — every request's new target features (``DraftRequest.hidden_states``: the tokens
   committed since its last `propose`) are fused (EAGLE-3: ``fc`` over low/mid/high layers) and
   queued, also for requests whose budget is 0 this step (they are fed at their next draft).
2. **catch up** — one batched head forward over every drafting request's queued pairs
   ``(f_i, t_{i+1})`` at positions ``i``, the last pair being (feature of the last committed
   token, root). Its output at the last pair predicts the root's feature and the depth-1 nodes.
   The head's cache then holds exactly the pairs of committed tokens: entries written for tree
   nodes last step sit past them and are overwritten.
3. **levels** ``d = 2 .. depth`` — the frontier (the ``topk`` best nodes of level d-1) is fed as
   (its parent's predicted feature, its token) at position ``len - 3 + d``, all requests in one
   forward, each frontier node seeing only its ancestors among the earlier levels' entries.
4. **cut** — each request keeps its best ``budget`` nodes (EAGLE-2 reranking).

At temperature 0 the tree is the deterministic top-k expansion; at T > 0 siblings are drawn without
replacement from the head's q (compact, `tree_builder`), and the tree's shape never depends on the
drawn values, so verification stays lossless. EAGLE-3's draft vocabulary is mapped to target ids
once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specserve.drafters.base import DraftRequest, TargetInfo, check_int_option, check_storage_option, register
from specserve.drafters.eagle_checkpoint import load_head
from specserve.drafters.level_drafter import LevelDrafter, LevelWork
from specserve.drafters.tree_builder import Frontier, TreeBuilder
from specserve.step_batch import StepBatchBuilder


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    return check_int_option("eagle", name, value, low, high)


@dataclass
class _State:
    num_cached: int = 0  # head pairs cached: pairs 0..num_cached-1 (slots 0..num_cached-1)
    # Queued target features of positions num_cached.., per handover one list over feature_layers; fused
    # into head inputs only when the request drafts (a request at budget 0 pays nothing per step).
    feats: list[list[torch.Tensor]] = field(default_factory=list)
    num_feats: int = 0
    last_feat: torch.Tensor | None = None  # input feature of the last cached pair [1, H]
    generator: torch.Generator | None = None


@register("eagle")
class EagleDrafter(LevelDrafter):
    """EAGLE head drafter (EAGLE-1/2 or EAGLE-3 heads; EAGLE-2 dynamic trees or chains).

    Options:
      depth:      tree depth (levels of drafting), in [1, 32].
      topk:       children per expanded node and nodes expanded per level (1 = a chain), in [1, 16].
      max_budget: most nodes per tree (the engine's per-request budget is capped by it), >= 1; at
                  most the nodes generated, ``topk + (depth - 1) * topk**2``. Default: min(that, 8).
    The defaults (depth 5, topk 2, budget 8) suit small targets on CPU, where verifying a node is
    not free; larger targets and GPUs afford EAGLE-2's wider trees (topk 8-10, budgets of 60).
      seed:       seeds the per-request samplers (temperature > 0), with the request's seed or id.
      storage:    how the CPU kernels store the head's weights (`specserve.kernels.STORAGES`); default beside a
                  quantized target `kernels.drafter_storage`'s (Q4_1 beside 4-bit layers, else int8), else the
                  head's own dtype.
    """

    needs_hidden_states = True
    gives_probs = True
    kv_lookahead = 1  # the pair at slot i is (feature i, token i + 1)

    def __init__(self, target: TargetInfo, path: str | None = None, *, depth: int = 5, topk: int = 2,
                 max_budget: int | None = None, seed: int = 0, storage: str | None = None) -> None:
        self.depth = _check("depth", depth, 1, 32)
        self.topk = self.width = _check("topk", topk, 1, 16)
        full = self.topk + (self.depth - 1) * self.topk * self.topk
        self.max_budget = min(8, full) if max_budget is None else min(_check("max_budget", max_budget, 1, 1 << 20), full)
        self.seed = _check("seed", seed, 0, 2**63 - 1)
        if path is None:
            raise ValueError("the eagle drafter needs a head directory: 'eagle:DIR' (a bare 'eagle' works only where a "
                             "head ships for the target: the tiny model's bundle; none ships for the default model yet)")
        self.path = Path(path).expanduser()
        self.head = load_head(self.path, target, storage=check_storage_option("eagle", storage, target))
        self.mode = self.head.mode
        self.id_map = self.head.draft_to_target.cpu().numpy()  # draft id -> target id
        self.vocab = self.head.cfg.draft_vocab_size
        self.feature_layers = self.head.cfg.feature_layers
        self.hidden_layers = tuple(sorted(set(self.feature_layers)))
        self.device = target.device
        self.cache = None  # the head's KV cache, made by `attach_kv` on the engine's allocator
        self._state: dict[str, _State] = {}
        self._prev: torch.Tensor | None = None  # output features of the last feed, [A, W, H]
        # Cache slots a tree needs past the committed pairs: the frontiers of levels 1..depth-1.
        self.kv_slots_past_root = (self.depth - 1) * self.topk

    # ---- the protocol ---------------------------------------------------------------------------

    def kv_bytes_per_slot(self) -> int:
        return self.head.kv_bytes_per_slot()  # every layer of the head (multi-layer heads have several)

    def attach_kv(self, allocator) -> None:
        self.cache = self.head.new_cache(allocator)

    def describe(self) -> dict:
        """Drafter options plus what was detected in the head's files (`EagleHeadConfig.source`: format and
        version, layers, vocabulary mapping, feature layers, embeddings used, norm order, biases)."""
        from specserve.config import _rope_parameters

        rope = _rope_parameters(self.head.mc.hf_config)
        positions = (f"rope {rope.get('rope_type', 'default')}, theta {rope.get('rope_theta', 10000.0):g} (the head's "
                     f"own config); trained to {self.head.mc.max_position_embeddings}, drafts past it (tables grow)")
        return {**super().describe(), **{k: str(v) for k, v in self.head.cfg.source.items()}, "positions": positions}

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    # ---- the level loop's hooks -----------------------------------------------------------------

    def _new_state(self, num_cached: int) -> _State:
        # A prefix-cache hit of n tokens: pairs 0..n-1 are cached (the cache checked token n, the last pair's);
        # the features of tokens n.. come from the suffix's prefill rows.
        return _State(num_cached)

    @torch.inference_mode()
    def _prepare(self, req: DraftRequest) -> _State:
        state = self._state.setdefault(req.request_id, _State())
        if req.hidden_states:
            missing = [layer for layer in self.hidden_layers if layer not in req.hidden_states]
            if missing:
                raise RuntimeError(f"eagle drafter: the engine handed no features of layer(s) {missing}")
            layers = [req.hidden_states[layer] for layer in self.feature_layers]
            state.feats.append(layers)
            state.num_feats += layers[0].shape[0]
        return state

    def _fused(self, queued: list[list[torch.Tensor]]) -> torch.Tensor:
        """Queued target features (handovers × feature layers, [n_i, H] each) → head inputs [Σn_i, H]."""
        dtype = torch.float32 if self.head.kernels is not None else self.head.fc.dtype
        layers = [torch.cat([q[i] for q in queued]).to(self.device, dtype) for i in range(len(self.feature_layers))]
        return self.head.fuse(layers)

    @torch.inference_mode()
    def _catch_up(self, work: list[LevelWork]) -> torch.Tensor:
        """Feed each request's queued pairs; keep the root pairs' output features, return their logits."""
        builder = StepBatchBuilder(self.cache.allocator)
        ids, feats, rows = [], [], []
        for w in work:
            req, state = w.req, w.state
            length = len(req.token_ids)
            if state.num_cached + state.num_feats != length - 1:
                raise RuntimeError(
                    f"eagle drafter: request {req.request_id!r} has {length} tokens but features for "
                    f"{state.num_cached + state.num_feats} (the engine must hand over every committed token's features)")
            start = min(state.num_cached, length - 2)  # the root pair is always (re)fed: we need its output
            new = np.ascontiguousarray(req.token_ids[start + 1 : length], dtype=np.int64)
            ids.append(new)
            if start < state.num_cached:
                feats.append(state.last_feat)
            if state.feats:
                feats.append(self._fused(state.feats))
            first = builder.add(req.request_id, start, new)
            rows.append(first + len(new) - 1)
            state.last_feat = feats[-1][-1:]
            state.num_cached, state.feats, state.num_feats = length - 1, [], 0
        out = self.head(torch.from_numpy(np.concatenate(ids)).to(self.device), torch.cat(feats), builder.build(),
                        self.cache)
        root = out[torch.tensor(rows, device=out.device)]  # [A, H]
        self._prev = root[:, None]
        return self.head.logits(root)

    @torch.inference_mode()
    def _feed_level(self, work: list[LevelWork], builder: TreeBuilder, front: Frontier, active: np.ndarray,
                    level: int) -> torch.Tensor:
        """Feed the frontier of level ``level - 1`` as (parent's output feature, token) pairs."""
        k = self.width
        rows = np.searchsorted(front.requests, active)
        tokens = self._target_ids(front.tokens[rows])  # [A', k] target ids
        parent_slot = torch.from_numpy(front.parent_slot[rows]).to(self._prev.device)
        act = torch.from_numpy(active).to(self._prev.device)
        feats = self._prev[act[:, None], parent_slot]  # [A', k, H]
        batch = StepBatchBuilder(self.cache.allocator)
        for a, row_tokens in zip(active.tolist(), tokens):
            state = work[a].state
            mask = None if k == 1 else builder.feed_mask(level - 1, a)
            batch.add(work[a].req.request_id, state.num_cached + (level - 2) * k, row_tokens,
                      np.full(k, state.num_cached + level - 2, dtype=np.int64), mask)
        out = self.head(torch.from_numpy(tokens.reshape(-1)).to(self.device), feats.flatten(0, 1), batch.build(),
                        self.cache).view(len(active), k, -1)
        prev = torch.zeros(len(work), k, out.shape[-1], dtype=out.dtype, device=out.device)
        prev[act] = out
        self._prev = prev
        return self.head.logits(out.flatten(0, 1)).view(len(active), k, -1)

    def __repr__(self) -> str:
        return (f"EagleDrafter(path={str(self.path)!r}, mode={self.mode}, depth={self.depth}, topk={self.topk}, "
                f"max_budget={self.max_budget})")
