"""The ``eagle`` drafter: an EAGLE head drafts EAGLE-2 dynamic trees from the target's own features.

``eagle:DIR`` loads a head from DIR (``specserve train eagle``, or a public EAGLE-1/2/3 layout;
see drafters/eagle_checkpoint.py); a bare ``eagle`` means the bundle's head when the target is the
bundled default model. The head's one-layer KV cache lives on the engine's block allocator: a request's
block table addresses its head entries too, reserved when the request was admitted.

Each step, for all requests of the batch together:

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
   forward, each frontier node seeing only its ancestors among the earlier levels' entries (a tail
   mask, see `StepBatch`); the tree grows by `DynamicTree` (drafters/eagle_tree.py).
4. **cut** — each request keeps its best ``budget`` nodes (EAGLE-2 reranking).

At temperature 0 the tree is the deterministic top-k expansion; at T > 0 siblings are drawn
without replacement from q = softmax(head logits / T) with exact per-child q in ``DraftTree.probs``,
and the tree's shape never depends on the drawn values (eagle_tree.py), so verification stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specserve.drafters.base import check_int_option, Drafter, DraftRequest, TargetInfo, register
from specserve.drafters.eagle_checkpoint import load_head
from specserve.drafters.eagle_tree import DynamicTree
from specserve.drafters.siblings import request_generator
from specserve.kv_cache import PagedKVCache
from specserve.step_batch import StepBatchBuilder
from specserve.verify import DraftTree


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    return check_int_option("eagle", name, value, low, high)


@dataclass
class _State:
    num_cached: int = 0  # head pairs cached: pairs 0..num_cached-1 (slots 0..num_cached-1)
    feats: list[torch.Tensor] = field(default_factory=list)  # queued input features of positions num_cached..
    num_feats: int = 0
    last_feat: torch.Tensor | None = None  # input feature of the last cached pair [1, H]
    generator: torch.Generator | None = None


@register("eagle")
class EagleDrafter(Drafter):
    """EAGLE head drafter (EAGLE-1/2 or EAGLE-3 heads; EAGLE-2 dynamic trees or chains).

    Options:
      depth:      tree depth (levels of drafting), in [1, 32].
      topk:       children per expanded node and nodes expanded per level (1 = a chain), in [1, 16].
      max_budget: most nodes per tree (the engine's per-request budget is capped by it), >= 1; at
                  most the nodes generated, ``topk + (depth - 1) * topk**2``. Default: min(that, 8).
    The defaults (depth 5, topk 2, budget 8) suit small targets on CPU, where verifying a node is
    not free; larger targets and GPUs afford EAGLE-2's wider trees (topk 8-10, budgets of 60).
      seed:       seeds the per-request samplers (temperature > 0), with the request's seed or id.
    """

    needs_hidden_states = True
    gives_probs = True

    def __init__(self, target: TargetInfo, path: str | None = None, *, depth: int = 5, topk: int = 2,
                 max_budget: int | None = None, seed: int = 0) -> None:
        self.depth = _check("depth", depth, 1, 32)
        self.topk = _check("topk", topk, 1, 16)
        full = self.topk + (self.depth - 1) * self.topk * self.topk
        self.max_budget = min(8, full) if max_budget is None else min(_check("max_budget", max_budget, 1, 1 << 20), full)
        self.seed = _check("seed", seed, 0, 2**63 - 1)
        if path is None:
            raise ValueError("the eagle drafter needs a head directory: 'eagle:DIR' (a bare 'eagle' only works with "
                             "the bundled default model when the bundle has a head)")
        self.path = Path(path).expanduser()
        self.head = load_head(self.path, target)
        self.mode = self.head.mode
        self._id_map = self.head.draft_to_target.cpu()  # draft id -> target id, on the host where trees are built
        self.feature_layers = self.head.cfg.feature_layers
        self.hidden_layers = tuple(sorted(set(self.feature_layers)))
        self.device = target.device
        self.max_positions = self.head.mc.max_position_embeddings
        self.cache = None  # the head's KV cache, made by `attach_kv` on the engine's allocator
        self._state: dict[str, _State] = {}
        # Cache slots a tree needs past the committed pairs: the frontiers of levels 1..depth-1.
        self.kv_slots_past_root = (self.depth - 1) * self.topk

    # ---- the protocol ---------------------------------------------------------------------------

    def kv_bytes_per_slot(self) -> int:
        mc = self.head.mc
        return PagedKVCache.bytes_per_slot(1, mc.num_kv_heads, mc.head_dim, torch.float32)

    def attach_kv(self, allocator) -> None:
        self.cache = self.head.new_cache(allocator)

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[DraftTree]:
        if len(budgets) != len(requests):
            raise ValueError(f"propose got {len(requests)} requests but {len(budgets)} budgets")
        trees = [DraftTree.empty() for _ in requests]
        work = []
        for i, (req, budget) in enumerate(zip(requests, budgets)):
            budget = int(budget)
            if budget < 0:
                raise ValueError(f"budget for request {req.request_id!r} must be >= 0, got {budget}")
            state = self._state.setdefault(req.request_id, _State())
            self._absorb(req, state)
            cap = min(budget, self.max_budget)
            length = len(req.token_ids)
            levels = min(self.depth, cap, self.max_positions - length + 2)  # level d feeds position length + d - 3
            if cap == 0 or levels < 1:
                continue
            if state.num_cached + state.num_feats != length - 1:
                raise RuntimeError(
                    f"eagle drafter: request {req.request_id!r} has {length} tokens but features for "
                    f"{state.num_cached + state.num_feats} (the engine must hand over every committed token's features)")
            work.append((i, req, cap, levels, state))
        if not work:
            return trees

        root_out, logits = self._catch_up(work)  # [A, H], [A, Vd]
        sampled = [req.temperature > 0 for _, req, _, _, _ in work]
        generators = [self._generator(req, st) if s else None for (_, req, _, _, st), s in zip(work, sampled)]
        tree = DynamicTree(self.topk, self.depth, sampled, generators, logits.shape[-1], "cpu")
        front = tree.add_level(self._logq(logits, work).cpu())
        levels = torch.tensor([lv for _, _, _, lv, _ in work])
        prev = root_out[:, None]  # [A, F, H]: output features of the last feed, by frontier slot
        for level in range(2, self.depth + 1):
            active = (levels >= level).nonzero().flatten()
            if not len(active):
                break
            out = self._feed(work, tree, front, active, prev, level)  # [A', k, H]
            logq = self._logq(self.head.logits(out.flatten(0, 1)), [work[int(a)] for a in active])
            front = tree.add_level(logq.view(len(active), self.topk, -1).cpu(), active)
            prev = torch.zeros(len(work), self.topk, out.shape[-1], dtype=out.dtype, device=out.device)
            prev[active.to(out.device)] = out
        id_map = self._id_map
        vocab = self.head.cfg.vocab_size
        for (i, *_), (tokens, parents, probs) in zip(work, tree.finish([cap for _, _, cap, _, _ in work])):
            if not len(tokens):
                continue
            if probs is not None and self.mode == "eagle3":  # draft vocabulary → q over target ids
                full = torch.zeros(probs.shape[0], vocab)
                full[:, id_map] = probs
                probs = full
            trees[i] = DraftTree(id_map[tokens], parents, probs)
        return trees

    # ---- steps ----------------------------------------------------------------------------------

    def _absorb(self, req: DraftRequest, state: _State) -> None:
        if not req.hidden_states:
            return
        missing = [layer for layer in self.hidden_layers if layer not in req.hidden_states]
        if missing:
            raise RuntimeError(f"eagle drafter: the engine handed no features of layer(s) {missing}")
        dtype = torch.float32 if self.head.kernels is not None else self.head.fc.dtype
        layers = [req.hidden_states[layer].to(self.device, dtype) for layer in self.feature_layers]
        feats = self.head.fuse(layers)  # [n, H]
        state.feats.append(feats)
        state.num_feats += feats.shape[0]

    def _catch_up(self, work) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each request's queued pairs; return the root pairs' output features [A, H] and logits [A, Vd]."""
        builder = StepBatchBuilder(self.cache.allocator)
        ids, feats, rows = [], [], []
        for _, req, _, _, state in work:
            length = len(req.token_ids)
            start = min(state.num_cached, length - 2)  # the root pair is always (re)fed: we need its output
            new = np.ascontiguousarray(req.token_ids[start + 1 : length], dtype=np.int64)
            ids.append(new)
            if start < state.num_cached:
                feats.append(state.last_feat)
            feats.extend(state.feats)
            first = builder.add(req.request_id, start, new)
            rows.append(first + len(new) - 1)
            state.last_feat = feats[-1][-1:]
            state.num_cached, state.feats, state.num_feats = length - 1, [], 0
        out = self.head(torch.from_numpy(np.concatenate(ids)).to(self.device), torch.cat(feats), builder.build(),
                        self.cache)
        root = out[torch.tensor(rows, device=out.device)]
        return root, self.head.logits(root)

    def _feed(self, work, tree: DynamicTree, front, active: torch.Tensor, prev: torch.Tensor, level: int) -> torch.Tensor:
        """Feed the frontier of level ``level - 1`` for the ``active`` requests; output features [A', k, H]."""
        k = self.topk
        pos_in_front = torch.searchsorted(front.requests, active)
        tokens = self._id_map[front.tokens[pos_in_front]]  # [A', k] target ids
        parent_slot = front.parent_slot[pos_in_front]  # [A', k]
        act_dev = active.to(prev.device)
        feats = prev[act_dev[:, None], parent_slot.to(prev.device)]  # [A', k, H]
        builder = StepBatchBuilder(self.cache.allocator)
        for a, row_tokens in zip(active.tolist(), tokens.numpy()):
            _, req, _, _, state = work[a]
            mask = None if k == 1 else tree.feed_mask(level - 1, a).numpy()
            builder.add(req.request_id, state.num_cached + (level - 2) * k, row_tokens,
                        np.full(k, state.num_cached + level - 2, dtype=np.int64), mask)
        out = self.head(tokens.flatten().to(self.device), feats.flatten(0, 1), builder.build(), self.cache)
        return out.view(len(active), k, -1)

    def _logq(self, logits: torch.Tensor, work) -> torch.Tensor:
        """log q per row: log_softmax(logits / T) for sampled requests, log_softmax(logits) for greedy ones."""
        temps = torch.tensor([req.temperature for _, req, _, _, _ in work], dtype=torch.float32, device=logits.device)
        temps = torch.where(temps > 0, temps, 1.0)
        rows = logits.shape[0] // len(work)
        return torch.log_softmax(logits / temps.repeat_interleave(rows)[:, None], dim=-1)

    def _generator(self, req: DraftRequest, state: _State) -> torch.Generator:
        if state.generator is None:
            state.generator = request_generator("eagle", self.seed, req, torch.device("cpu"))
        return state.generator

    def __repr__(self) -> str:
        return (f"EagleDrafter(path={str(self.path)!r}, mode={self.mode}, depth={self.depth}, topk={self.topk}, "
                f"max_budget={self.max_budget})")
