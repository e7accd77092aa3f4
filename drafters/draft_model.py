"""The ``draft`` drafter: a small LM that shares the target's tokenizer proposes chains or top-k trees.

``draft:DIR`` loads DIR (Hugging Face layout, e.g. from ``specserve train draft``) into our own
`LlamaModel`, whose KV cache lives on the engine's block allocator (a request's block table addresses
its draft entries too); a bare ``draft`` means the bundled draft model when the target is the bundled
default model.

Each step, for all requests of the batch together:

1. **catch up** — one batched forward over every request's tokens the draft has not cached yet
   (the tokens accepted last step and the new root; the whole prompt the first time). The logits at
   the root give the distribution of depth-1 nodes. Whatever the draft wrote past the root last step
   (its own tree) is simply overwritten.
2. **levels** ``d = 1 .. depth`` — every *expanded* node of level d-1 (the root for d = 1) gets
   ``topk`` children: at temperature 0 its top-k tokens; at temperature T > 0 ``topk`` tokens drawn
   *without replacement* from q = softmax(logits / T) (inverse-CDF draws, the request's own generator).
   Child j's stored distribution ``probs[j]`` is q with children 0..j-1 removed and renormalised —
   exactly what it was drawn from, as the stochastic verifier requires. The ``width`` best nodes of
   level d are expanded next (greedy: by cumulative draft log-probability; sampled: by an estimate of
   the chance the verifier walks through them, which favours first-drawn siblings); one batched
   forward feeds them.

Why this stays lossless at T > 0: which siblings a node gets (how many, from which q) is fixed
before they are drawn — never chosen by looking at their own values — and which nodes are expanded
only decides the number of *their* future children. A tree is cut to its budget in generation order
(level by level, keeping one node for every deeper level so small budgets still buy depth); how many
nodes a level keeps depends on the budget and the level sizes only, never on the values being cut.

With ``width == 1`` the expanded nodes form a chain, so each level feeds one token per request on
top of the cached ancestors. With ``width > 1`` the expanded nodes of all levels are fed again with
their ancestor mask each level (our attention sees every cached slot, so non-ancestor siblings must
not stay in the cache); the cost grows with depth × width.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from specserve.drafters.base import check_int_option, Drafter, DraftRequest, TargetInfo, register
from specserve.drafters.siblings import SAMPLED_SIBLING_LOGP, request_generator, sample_siblings
from specserve.verify import DraftTree, tree_kernels

from specserve.kv_cache import PagedKVCache
from specserve.step_batch import StepBatchBuilder
from specserve.model import LlamaModel


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    return check_int_option("draft", name, value, low, high)


@dataclass
class _RequestState:
    num_cached: int = 0  # tokens of the request whose draft KV is valid (slots 0..num_cached-1)
    generator: torch.Generator | None = None


@register("draft")
class DraftModelDrafter(Drafter):
    """Draft-model drafter (chains or top-k trees with draft probabilities).

    Options:
      depth:      tree depth (draft tokens along one path), in [1, 64].
      topk:       children of each expanded node (1 = chain), in [1, 64].
      width:      nodes expanded per level (the best by cumulative draft log-probability), in [1, 64].
      max_budget: most nodes per tree, >= 1; at most the full tree, ``topk * (1 + (depth - 1) * width)``.
      seed:       seeds the per-request draft samplers (temperature > 0), with the request's seed or id.
    """

    needs_hidden_states = False
    gives_probs = True

    def __init__(
        self,
        target: TargetInfo,
        path: str | None = None,
        *,
        depth: int = 4,
        topk: int = 1,
        width: int = 1,
        max_budget: int | None = None,
        seed: int = 0,
    ) -> None:
        self.depth = _check("depth", depth, 1, 64)
        self.topk = _check("topk", topk, 1, 64)
        self.width = _check("width", width, 1, 64)
        full = self.topk * (1 + (self.depth - 1) * self.width)
        self.max_budget = full if max_budget is None else min(_check("max_budget", max_budget, 1, 1 << 20), full)
        self.seed = _check("seed", seed, 0, 2**63 - 1)
        self.path = _resolve_path(target, path)
        target_model = target.model
        self.model = LlamaModel.from_pretrained(self.path, target.device, target.dtype,
                                                cpu_kernels=target_model is None or target_model.kernels is not None)
        cfg = self.model.config
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {str(self.path)!r} has vocab_size {cfg.vocab_size} but the target has {target.vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        _check_same_tokenizer(self.path, target.model_dir)
        self.max_positions = cfg.max_position_embeddings
        self.device = target.device
        self.cache = None  # made by `attach_kv` on the engine's allocator
        self._state: dict[str, _RequestState] = {}
        # Slots a tree needs past the root: the expanded nodes that are fed (all but the last level).
        self.kv_slots_past_root = (self.depth - 1) * (1 if self.width == 1 else self.width)

    # ---- the protocol ---------------------------------------------------------------------------

    def kv_bytes_per_slot(self) -> int:
        cfg = self.model.config
        dtype = torch.float32 if self.model.kernels is not None else self.model.dtype
        return PagedKVCache.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)

    def attach_kv(self, allocator) -> None:
        self.cache = self.model.new_cache(allocator)

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[DraftTree]:
        if len(budgets) != len(requests):
            raise ValueError(f"propose got {len(requests)} requests but {len(budgets)} budgets")
        trees = [DraftTree.empty() for _ in requests]
        work: list[_Work] = []
        for i, (req, budget) in enumerate(zip(requests, budgets)):
            budget = int(budget)
            if budget < 0:
                raise ValueError(f"budget for request {req.request_id!r} must be >= 0, got {budget}")
            cap = min(budget, self.max_budget)
            length = len(req.token_ids)
            levels = min(self.depth, self.max_positions - length + 1, cap)  # level d feeds position length + d - 2
            if cap == 0 or levels < 1:
                continue
            work.append(_Work(i, req, cap, levels, self._state.setdefault(req.request_id, _RequestState())))
        if not work:
            return trees

        logits = self._catch_up(work)  # [A, V]: distribution after each root
        frontier = [[-1] for _ in work]  # per work item: nodes whose children come next (-1 = root)
        for level in range(1, self.depth + 1):
            rows = [(w, node) for w, nodes in zip(work, frontier) for node in nodes]
            self._add_children(rows, logits, level)
            if level == self.depth:
                break
            frontier = [self._expand(w, level) if level < w.levels and len(w.tokens) < w.cap else [] for w in work]
            if not any(frontier):
                break
            logits = self._feed(work, frontier, level)
        for w in work:
            if w.tokens:
                probs = torch.stack(w.probs) if w.sampled else None
                trees[w.index] = DraftTree(torch.tensor(w.tokens, dtype=torch.int64),
                                           torch.tensor(w.parents, dtype=torch.int64), probs)
        return trees

    # ---- steps ----------------------------------------------------------------------------------

    def _catch_up(self, work: list["_Work"]) -> torch.Tensor:
        """Feed each request's uncached tokens (through its root); return the root rows' logits [A, V]."""
        builder = StepBatchBuilder(self.cache.allocator)
        for w in work:
            length = len(w.req.token_ids)
            start = min(w.state.num_cached, length - 1)  # the root is always (re)fed: we need its logits
            builder.add(w.req.request_id, start, np.ascontiguousarray(w.req.token_ids[start:length], dtype=np.int64),
                        logits="last")
            w.state.num_cached = length
            w.length = length
        return self.model.forward(builder.build(), self.cache).logits  # [A, V] float32

    def _feed(self, work: list["_Work"], frontier: list[list[int]], level: int) -> torch.Tensor:
        """Run the newly expanded nodes (level ``level``) through the draft; logits [R, V] in frontier order."""
        builder = StepBatchBuilder(self.cache.allocator)
        for w, nodes in zip(work, frontier):
            if not nodes:
                continue
            if self.width == 1:  # the expanded nodes are a chain: cached ancestors + one new token
                (node,) = nodes
                builder.add(w.req.request_id, w.length + level - 1, np.array([w.tokens[node]], dtype=np.int64),
                            np.array([w.length - 1 + level], dtype=np.int64), logits="all")
                continue
            w.expanded.extend(nodes)
            fed = w.expanded
            index = {n: j for j, n in enumerate(fed)}
            # Every ancestor of an expanded node was expanded too: the fed nodes' mask is the tree's
            # ancestor mask restricted to them.
            rows_fed = np.asarray(fed, dtype=np.int64) + 1
            tree_mask = tree_kernels.ancestor_mask(np.asarray(w.parents, dtype=np.int64))
            depth = np.array([w.depths[n] for n in fed], dtype=np.int64)
            builder.add(w.req.request_id, w.length, np.array([w.tokens[n] for n in fed], dtype=np.int64),
                        w.length - 1 + depth, tree_mask[np.ix_(rows_fed, rows_fed)],
                        logits=np.array([index[n] for n in nodes], dtype=np.int64))  # the new frontier's rows
        return self.model.forward(builder.build(), self.cache).logits

    def _add_children(self, rows: list[tuple["_Work", int]], logits: torch.Tensor, level: int) -> None:
        """Give each (request, parent node) row ``topk`` children, in row order, up to each tree's cap.

        logits: float32[R, V], row r = the draft's next-token logits after row r's parent.
        """
        k = self.topk
        temps = torch.tensor([w.req.temperature for w, _ in rows], dtype=torch.float32, device=logits.device)
        sampled = temps > 0
        logq = torch.log_softmax(logits / torch.where(sampled, temps, 1.0)[:, None], dim=-1)  # [R, V]
        top = logq.topk(k, dim=-1)  # greedy rows: the k most likely tokens, best first
        ids, valid = top.indices, torch.isfinite(top.values)  # [R, k]
        probs_cpu = None
        if bool(sampled.any()):
            rows_s = sampled.nonzero().flatten()
            owners = [rows[int(r)][0] for r in rows_s]
            generators = [self._generator(w) for w in owners]
            tokens_s, valid_s, probs = sample_siblings(logq[rows_s].exp(), generators, k)
            ids[rows_s], valid[rows_s] = tokens_s, valid_s
            probs_cpu = torch.zeros(len(rows), k, logq.shape[1])
            probs_cpu[rows_s.cpu()] = probs.float().cpu()
        child_logq = logq.gather(-1, ids).cpu().tolist()
        ids, valid = ids.cpu().tolist(), valid.cpu().tolist()
        for r, (w, parent) in enumerate(rows):
            base = 0.0 if parent == -1 else w.scores[parent]
            limit = w.cap - (w.levels - level)  # keep one node for each deeper level (depth first)
            for j in range(k):
                if len(w.tokens) >= limit or not valid[r][j]:
                    break
                w.tokens.append(ids[r][j])
                w.parents.append(parent)
                w.depths.append(level)
                w.scores.append(base + (SAMPLED_SIBLING_LOGP[j] if w.sampled else child_logq[r][j]))
                if w.sampled:
                    w.probs.append(probs_cpu[r, j])
        for w in {id(w): w for w, _ in rows}.values():
            w.level_nodes[level] = [n for n in range(len(w.tokens)) if w.depths[n] == level]

    def _expand(self, w: "_Work", level: int) -> list[int]:
        """The ``width`` best nodes of ``level`` by cumulative draft log-probability (ties: lower index)."""
        nodes = w.level_nodes.get(level, [])
        return sorted(nodes, key=lambda n: (-w.scores[n], n))[: self.width]

    def _generator(self, w: "_Work") -> torch.Generator:
        state = w.state
        if state.generator is None:
            state.generator = request_generator("draft", self.seed, w.req, self.device)
        return state.generator

    def __repr__(self) -> str:
        return (f"DraftModelDrafter(path={str(self.path)!r}, depth={self.depth}, topk={self.topk}, width={self.width}, "
                f"max_budget={self.max_budget})")


class _Work:
    """One request's tree under construction during a `propose` call (host-side lists, small)."""

    def __init__(self, index: int, req: DraftRequest, cap: int, levels: int, state: _RequestState) -> None:
        self.index, self.req, self.cap, self.levels, self.state = index, req, cap, levels, state
        self.sampled = req.temperature > 0
        self.key = ""
        self.length = 0
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.probs: list[torch.Tensor] = []
        self.expanded: list[int] = []
        self.level_nodes: dict[int, list[int]] = {}


def _resolve_path(target: TargetInfo, path: str | None) -> Path:
    # create_drafter already swapped a bare "draft" for the bundle's when the target is the default model.
    if path is None:
        raise ValueError("the draft drafter needs a model directory: 'draft:DIR' (a bare 'draft' only works with the "
                         "bundled default model)")
    return Path(path).expanduser()


def _check_same_tokenizer(draft_dir: Path, target_dir: str | None) -> None:
    """When both directories ship a tokenizer.json, their vocabularies and added tokens must be equal."""
    if target_dir is None:
        return
    a, b = Path(draft_dir) / "tokenizer.json", Path(target_dir) / "tokenizer.json"
    if not (a.is_file() and b.is_file()):
        return

    def key(path: Path):
        data = json.loads(path.read_text())
        return (data.get("model", {}).get("vocab"), data.get("added_tokens"))

    if key(a) != key(b):
        raise ValueError(f"draft model {str(draft_dir)!r} has a different tokenizer than the target {str(target_dir)!r}")
