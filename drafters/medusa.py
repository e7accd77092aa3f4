"""The ``medusa`` drafter: K heads on the target's last feature propose a token tree in one shot.

``medusa:DIR`` loads heads from DIR — our layout (``specserve train medusa``) or a public Medusa
layout (Medusa-1, v2, or a jointly fine-tuned Medusa-2 target; see `medusa_heads`); a bare ``medusa``
means the target's own heads when its directory holds some (Medusa-2), else the bundle's heads when the
target is the bundled default model. The heads read the target's final normed hidden state
(transformers' hidden layer ``num_layers``, what its LM head reads) at the last committed position,
whose next token is the root: head 0 proposes the depth-1 nodes (the token after the root), head k the
depth-(k+1) nodes. No draft forward, no draft KV: one small matmul per step for the whole batch.
Root-token heads (`medusa_heads`) also read the target's embedding of the root, which the request
already holds, so they cost one more small product and no extra pass. Parent-token heads also read, from head 1
on, the embedding of the node whose children they guess: their (static) trees grow level by level, one heads call
per level over every node with children, each node's children chosen from its own row of logits.

Trees (``tree=``):

- ``static`` — a fixed tree of rank paths (``choices``, Medusa's format: ``[[0], [1], [0, 0], ...]``,
  the checkpoint's own list or `medusa_tree.DEFAULT_CHOICES` by default), cut to each request's budget
  by its priority order (every cut is ancestor-closed).
- ``dynamic`` — per request, the ``budget`` best nodes grown by the shared `tree_builder` (each node's
  ``topk`` candidates, scored by cumulative head log-probability; every node of depth d reads head d-1).

Verification is greedy at temperature 0 (tokens are the heads' top ranks). At temperature T > 0 it is
lossless rejection sampling with the heads' distributions q_d = softmax(head logits / T), kept compact:
every node draws its own children from q_{d+1} without replacement (`tree_builder.draw_siblings`, exact
per-child q); siblings are drawn in node order, so in a tree listing them by rank the node of rank j is
the j-th draw. The tree's shape never depends on the tokens drawn into it — static trees are fixed,
sampled dynamic trees are scored by sibling rank only — so the shape carries no information about the
draws and the verifier's output follows the target exactly. Medusa's "typical acceptance" is lossy and
is not offered.
"""

from __future__ import annotations

import numpy as np
import torch
from specserve.drafters.base import check_int_option, check_storage_option, Drafter, DraftRequest, TargetInfo, register
from specserve.drafters.medusa_heads import has_heads, load_heads
from specserve.drafters.medusa_tree import DEFAULT_CHOICES, StaticTree, parse_choices, sample_static_tree
from specserve.drafters.draft_rng import request_generator
from specserve.drafters.tree_builder import (DRAFT_Q_SUPPORT, TreeBuilder, allowed_columns, draw_siblings,
                                             log_normalizer, mask_level, to_target_ids, top_columns)
from specserve.speculation.node_values import path_products
from specserve.verify import DraftTree

TREES = ("static", "dynamic")
# Default nodes per tree: on the 2-core CPU, 8 nodes is where the larger tree stops paying for its
# verify rows (BENCHMARKS.md, Medusa heads); the adaptive budget policy will choose per step.
DEFAULT_BUDGET = 8


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    return check_int_option("medusa", name, value, low, high)


@register("medusa")
class MedusaDrafter(Drafter):
    """Medusa heads drafter (static or dynamic trees, with draft probabilities).

    Options:
      tree:       "static" (default) or "dynamic" (not for heads that read their parent's token).
      choices:    static tree: list of rank paths, or that list as a JSON string (default: the
                  checkpoint's list, else `DEFAULT_CHOICES`). Every prefix of a path must be a path.
      topk:       dynamic tree: candidate ranks per node, in [1, 64] (default 4).
      depth:      heads used = deepest tree level, in [1, num_heads] (default all heads).
      max_budget: most nodes per tree, >= 1 (default 8, or the whole tree when smaller).
      seed:       seeds the per-request samplers (temperature > 0), with the request's seed or id.
      storage:    how the CPU kernels store the heads' weights (`specserve.kernels.STORAGES`: "int8", "q4_1",
                  "int4", "float16", ...; default beside a quantized target `kernels.drafter_storage`'s — Q4_1 beside
                  4-bit layers, else int8 — else the target's storage).
                  The heads' bytes are their time: each drafting step streams them cold after the target's
                  forward (BENCHMARKS.md, "Medusa heads that read the root token").
    """

    needs_hidden_states = True
    gives_probs = True
    # Each tree level is one head's products (its block, root product and LM head: a third of the heads'
    # bytes each), so a shallower tree drafts for less: the adaptive policy chooses the depth. At T = 1 on
    # the default model the third level was seldom accepted yet cost as much as the first.
    drafts_by_level = True

    def __init__(
        self,
        target: TargetInfo,
        path: str | None = None,
        *,
        tree: str = "static",
        choices: object = None,
        topk: int | None = None,
        depth: int | None = None,
        max_budget: int | None = None,
        seed: int = 0,
        storage: str | None = None,
    ) -> None:
        if tree not in TREES:
            raise ValueError(f"medusa drafter option tree must be one of {list(TREES)}, got {tree!r}")
        if path is None and target.model_dir is not None and has_heads(target.model_dir):
            path = target.model_dir  # a Medusa-2 target: its own directory holds the heads
        if path is None:
            raise ValueError("the medusa drafter needs a heads directory: 'medusa:DIR' (a bare 'medusa' works with a "
                             "target whose directory holds Medusa heads, or the bundled default model when the "
                             "bundle has Medusa heads)")
        if tree == "static" and topk is not None:
            raise ValueError("medusa drafter option topk applies to tree='dynamic' (a static tree's ranks come from choices)")
        if tree == "dynamic" and choices is not None:
            raise ValueError("medusa drafter option choices applies to tree='static'")
        self.seed = _check("seed", seed, 0, 2**63 - 1)
        storage = check_storage_option("medusa", storage, target)
        model_type = getattr(getattr(target.model, "config", None), "model_type", None)
        loaded = load_heads(path, hidden_size=target.hidden_size, vocab_size=target.vocab_size, model_type=model_type,
                            target_dir=target.model_dir)
        heads = loaded.heads
        if heads.parent_token and tree == "dynamic":
            raise ValueError(f"medusa heads in {str(path)!r} read their parent's token and draft static trees only "
                             "(tree='static')")
        self.parent_token = heads.parent_token
        self.path = str(path)
        self._target_dir = target.model_dir
        self.layout = loaded.layout
        self.format = loaded.format
        self.num_heads = heads.num_heads
        self.depth = heads.num_heads if depth is None else _check("depth", depth, 1, heads.num_heads)
        self.tree = tree
        # Tree tokens are columns of the heads' logits; a draft vocabulary maps them to target ids.
        self.id_map = heads.draft_to_target.numpy() if heads.draft_to_target is not None else None
        vocab = self.columns = heads.draft_vocab_size or target.vocab_size
        if tree == "static":
            self.topk = None
            if choices is not None:
                static = StaticTree.from_choices(parse_choices(choices))
                if static.max_depth > self.depth:
                    deepest = max(static.choices, key=len)
                    raise ValueError(f"medusa choices path {list(deepest)} has depth {len(deepest)} but only {self.depth} "
                                     f"head(s) are used (depth option / {self.num_heads} heads in the checkpoint)")
            else:
                recorded = loaded.config.get("choices") if loaded.layout == "specserve" else None
                static = StaticTree.from_choices(recorded or DEFAULT_CHOICES).limited_to(self.depth)
            if static.max_rank >= vocab:
                raise ValueError(f"medusa choices use rank {static.max_rank} but the vocabulary has {vocab} tokens")
            self.static = static
            full = static.num_nodes
            default_budget = min(DEFAULT_BUDGET, full)
        else:
            self.static = None
            self.topk = _check("topk", 4 if topk is None else topk, 1, min(64, vocab))
            full = sum(self.topk**d for d in range(1, self.depth + 1))
            default_budget = min(DEFAULT_BUDGET, full)
        self.max_budget = default_budget if max_budget is None else min(_check("max_budget", max_budget, 1, 1 << 20), full)
        self.device, self.dtype = target.device, target.dtype
        self.heads = heads.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.lm_weight = None
        self.root_embed = None  # the target's token embeddings [V, H], for heads that read the root (and parent) token
        if heads.root_token:
            if target.model is None or getattr(target.model, "embed", None) is None:
                raise ValueError(f"medusa heads in {self.path!r} read the root token through the target's embeddings, "
                                 "but the target model is not available")
            self.root_embed = target.model.embed.detach()
        if heads.lm_heads is None:
            if target.model is None or getattr(target.model, "lm_head", None) is None:
                raise ValueError(f"medusa heads in {self.path!r} share the target's LM head, but the target model is "
                                 "not available")
            self.lm_weight = target.model.lm_head.detach()
        self.kernels = _HeadKernels.build(self.heads, target, self.depth, storage)
        self.feature_layer = target.num_layers
        self.hidden_layers = (target.num_layers,)
        # request -> (its feature [H]: a float32 array on the CPU kernels, else a tensor; the feature's position)
        self._features: dict[str, tuple] = {}
        self._static_by_depth: dict[int, StaticTree] = {}  # the static tree limited to fewer levels
        self._generators: dict[str, torch.Generator] = {}

    # ---- the protocol ---------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        self._features.pop(request_id, None)
        self._generators.pop(request_id, None)

    def propose(self, requests: list[DraftRequest], budgets: list[int], depth: int | None = None) -> list[DraftTree]:
        """Trees of at most `depth` levels (None: every head's), each cut to its budget. The heads the trees can
        reach run in one pass: a static tree cut to the largest budget reaches only its first levels (a 1-node
        tree reads head 0 alone, a third of three heads' bytes)."""
        if len(budgets) != len(requests):
            raise ValueError(f"propose got {len(requests)} requests but {len(budgets)} budgets")
        trees = [DraftTree.empty() for _ in requests]
        work: list[tuple[int, DraftRequest, int]] = []
        for i, (req, budget) in enumerate(zip(requests, budgets)):
            budget = int(budget)
            if budget < 0:
                raise ValueError(f"budget for request {req.request_id!r} must be >= 0, got {budget}")
            self._absorb(req)  # even at budget 0: features are handed over only once
            feature = self._features.get(req.request_id)
            # The feature must be the last committed position's (the root's predecessor); a request
            # whose feature is missing or stale gets no draft rather than a wrong-position one.
            if budget and feature is not None and feature[1] == len(req.token_ids) - 2:
                work.append((i, req, min(budget, self.max_budget)))
        if not work:
            return trees
        levels = self.depth if depth is None else max(1, min(int(depth), self.depth))
        static = self._static_tree(levels)
        reach = levels if static is None else int(static.depths[: max(c for _, _, c in work)].max())
        # float32[A, H] on the kernels (numpy throughout: each torch call runs on caches the forward just emptied),
        # else a tensor on the heads' device
        features = [self._features[req.request_id][0] for _, req, _ in work]
        feats = np.stack(features) if self.kernels is not None else torch.stack(features)
        root_ids = (np.fromiter((req.token_ids[-1] for _, req, _ in work), dtype=np.int64, count=len(work))
                    if self.root_embed is not None else None)  # [A]: each request's root token
        temps = np.array([req.temperature for _, req, _ in work], dtype=np.float32)
        reqs, caps = [req for _, req, _ in work], [cap for _, _, cap in work]
        if self.parent_token:
            made = self._parent_trees(feats, root_ids, reqs, temps, caps, static)
        else:
            logits = self._head_logits(feats, root_ids, 0, reach)  # float32[A, reach, V']
            if static is None:
                made = self._dynamic_trees(logits, reqs, temps, caps, levels)
            else:
                made = self._static_trees(logits, reqs, temps, caps, static)
        for (i, _, _), tree in zip(work, made):
            trees[i] = tree
        return trees

    def _head_logits(self, feats, root_ids: np.ndarray | None, first: int, count: int,
                     parent_ids: np.ndarray | None = None) -> np.ndarray:
        """float32[R, count, V']: heads ``first`` .. ``first + count - 1`` on R rows: feats [R, H] (a float32 array on
        the kernels, else a tensor), root_ids int64[R] (root-token heads), parent_ids int64[R] target ids (parent-token
        heads from head 1 on: the node each row expands)."""
        if self.kernels is not None:
            return self.kernels(feats, count, root_ids, first, parent_ids)
        with torch.inference_mode():
            roots = parents = None
            if self.root_embed is not None:  # [R, H]: each row's root token, embedded as the target does
                roots = self.root_embed[torch.from_numpy(root_ids).to(self.root_embed.device)].to(self.device, self.dtype)
            if parent_ids is not None:
                parents = self.root_embed[torch.from_numpy(parent_ids).to(self.root_embed.device)].to(self.device, self.dtype)
            logits = self.heads(feats, self.lm_weight, heads=count, first=first, root_embed=roots, parent_embed=parents)
            return logits.transpose(0, 1).float().cpu().numpy()

    # ---- trees ----------------------------------------------------------------------------------

    def _absorb(self, req: DraftRequest) -> None:
        hidden = req.hidden_states
        if hidden is None:
            return
        if self.feature_layer not in hidden:
            raise ValueError(f"medusa needs hidden layer {self.feature_layer}; got layers {sorted(hidden)}")
        rows = hidden[self.feature_layer]
        if rows.shape[0]:
            last = rows[-1].detach()
            # The CPU kernels read it as a float32 array; the torch heads as a tensor on their device and dtype.
            feature = last.float().numpy() if self.kernels is not None else last.to(self.device, self.dtype)
            self._features[req.request_id] = (feature, len(req.token_ids) - 2)

    def _uniforms(self, reqs: list[DraftRequest], temps: np.ndarray, size: int) -> np.ndarray | None:
        """One uniform per possible node of each sampled request, from its own seeded stream."""
        if not (temps > 0).any():
            return None
        out = np.zeros((len(reqs), size))
        for a, req in enumerate(reqs):
            if temps[a] > 0:
                out[a] = torch.rand(size, generator=self._generator(req), dtype=torch.float64).numpy()
        return out

    def _static_tree(self, levels: int) -> StaticTree | None:
        """The static tree without its nodes deeper than `levels` (None for dynamic trees); built once per depth."""
        if self.static is None or levels >= self.static.max_depth:
            return self.static
        tree = self._static_by_depth.get(levels)
        if tree is None:
            tree = self._static_by_depth[levels] = self.static.limited_to(levels)
        return tree

    def _dynamic_trees(self, logits: np.ndarray, reqs: list[DraftRequest], temps: np.ndarray,
                       caps: list[int], levels: int) -> list[DraftTree]:
        """logits: float32[A, D >= levels, V]. The shared builder grows every request's tree from its heads'
        logits, `levels` deep: all nodes of depth d read head d-1 (they share the target feature), so a level's
        rows repeat it."""
        width = max(caps)
        size = self.topk + (levels - 1) * width * self.topk
        builder = TreeBuilder(self.topk, levels, width, temps, self._uniforms(reqs, temps, size), logits.shape[-1])
        grammars = [req.mask for req in reqs]
        constrained = any(g is not None for g in grammars)
        level = logits[:, 0][:, None].copy()
        if constrained:
            mask_level(level, grammars, builder, None, None, self._target_ids, self._draft_allowed)
        front = builder.add_level(level)
        for d in range(1, levels):
            level = np.repeat(logits[:, d][:, None], width, axis=1)
            if constrained:
                mask_level(level, grammars, builder, front, None, self._target_ids, self._draft_allowed)
            front = builder.add_level(level)
        return [_tree(t, p, qi, qp, sc, self.id_map) for t, p, qi, qp, sc in builder.finish(caps)]

    def _target_ids(self, ids: np.ndarray) -> np.ndarray:
        """Logit columns -> target ids."""
        return to_target_ids(self.id_map, ids)

    def _draft_allowed(self, allowed: np.ndarray) -> np.ndarray:
        """A grammar's bool[target V] mask -> bool[columns]."""
        return allowed_columns(self.id_map, allowed, self.columns)

    def _static_trees(self, logits: np.ndarray, reqs: list[DraftRequest], temps: np.ndarray,
                      caps: list[int], s: StaticTree) -> list[DraftTree]:
        """The static tree `s`'s prefix of each cap: greedy nodes take their depth's head's rank-j token;
        sampled nodes are their parent's j-th draw without replacement from that head's compact q."""
        out = []
        uniforms = self._uniforms(reqs, temps, s.num_nodes)
        for a, cap in enumerate(caps):
            parents, depths, ranks = s.parents[:cap], s.depths[:cap], s.ranks[:cap]
            if reqs[a].mask is not None:
                out.append(_constrained_static_tree(logits[a], reqs[a].mask, parents, depths, ranks, float(temps[a]),
                                                    uniforms[a] if uniforms is not None else None, self.id_map))
                continue
            if temps[a] <= 0:
                order = _top_ranks(logits[a], int(ranks.max()) + 1)  # [D, ranks]: each head's best columns
                tokens = order[depths - 1, ranks]
                normalizers = np.array([log_normalizer(row) for row in logits[a][: int(depths.max())]])
                own = logits[a][depths - 1, tokens] - normalizers[depths - 1]  # each node's head log-prob
                out.append(_tree(tokens, parents, None, None, _greedy_scores(own, parents), id_map=self.id_map))
                continue
            tokens, q_ids, q_probs, keep = sample_static_tree(logits[a], float(temps[a]), parents, depths, uniforms[a])
            # A node whose draw failed (q's support ran out) takes its subtree along.
            index = np.cumsum(keep) - 1
            new_parents = np.where(parents >= 0, index[np.maximum(parents, 0)], -1)[keep]
            out.append(_tree(tokens[keep], new_parents, q_ids[keep], q_probs[keep], id_map=self.id_map))
        return out

    def _parent_trees(self, feats, root_ids: np.ndarray, reqs: list[DraftRequest], temps: np.ndarray,
                      caps: list[int], s: StaticTree) -> list[DraftTree]:
        """Parent-token heads' static trees (`s`'s prefix of each cap), grown level by level: the root rows read
        head 0, then every kept node of depth d with children in its request's tree is a row of head d, reading its
        own token; each row's children are chosen from its own logits as `_RowTree` chooses them. One heads call
        per level for the whole batch (a level's heads' weights stream once)."""
        uniforms = self._uniforms(reqs, temps, s.num_nodes)
        trees = [_RowTree(s.parents[:cap], s.depths[:cap], s.ranks[:cap], float(temps[a]),
                          uniforms[a] if uniforms is not None else None, reqs[a].mask, self.id_map)
                 for a, cap in enumerate(caps)]
        rows = [(a, -1) for a in range(len(reqs))]  # (request, node) of each row; -1: the root
        logits = self._head_logits(feats, root_ids, 0, 1)[:, 0]  # float32[A, V']
        for level in range(1, s.max_depth + 1):
            for (a, node), row in zip(rows, logits):
                trees[a].expand(node, row)
            rows = [(a, node) for a, tree in enumerate(trees) for node in tree.expandable(level)]
            if not rows:  # (always so at s's deepest level)
                break
            which = np.array([a for a, _ in rows], dtype=np.int64)
            parents = np.array([trees[a].tokens[node] for a, node in rows], dtype=np.int64)
            logits = self._head_logits(feats[which], root_ids[which], level, 1, to_target_ids(self.id_map, parents))[:, 0]
        return [tree.finish() for tree in trees]

    def _generator(self, req: DraftRequest) -> torch.Generator:
        generator = self._generators.get(req.request_id)
        if generator is None:
            generator = self._generators[req.request_id] = request_generator("medusa", self.seed, req, self.device)
        return generator

    def describe(self) -> dict:
        """Drafter options plus what the heads' files say (`describe_heads`: format, version, heads, LM head)."""
        from specserve.drafters.medusa_heads import describe_heads

        tree = f"static, {self.static.num_nodes} nodes" if self.static is not None else f"dynamic, topk {self.topk}"
        return {**super().describe(), "tree": tree, **describe_heads(self.path, self._target_dir)}

    def __repr__(self) -> str:
        shape = f"{self.static.num_nodes} static nodes" if self.static is not None else f"dynamic topk={self.topk}"
        return (f"MedusaDrafter(path={self.path!r}, layout={self.layout}, heads={self.num_heads}, depth={self.depth}, "
                f"tree={shape}, max_budget={self.max_budget})")


def _constrained_static_tree(logits: np.ndarray, grammar, parents: np.ndarray, depths: np.ndarray,
                             ranks: np.ndarray, temperature: float, uniforms: np.ndarray | None,
                             id_map: np.ndarray | None = None) -> DraftTree:
    """A static tree under a grammar: every expanded row's head logits (logits float32[D, V'], row d: the head of
    depth d + 1's nodes) masked with the grammar's state after that row's path (`_RowTree`)."""
    tree = _RowTree(parents, depths, ranks, temperature, uniforms, grammar, id_map)
    for row in range(-1, len(parents)):
        if row in tree.children:  # (a leaf of the deepest level has no head row)
            tree.expand(row, logits[depths[row] if row >= 0 else 0])
    return tree.finish()


class _RowTree:
    """A static tree's tokens chosen row by row: each expanded row (the root, -1, or a node) gives its children from
    one row of logits — its depth's head's (a grammar's trees), or its own (parent-token heads). Greedy: the child of
    rank j takes the row's j-th best column, and the tree's scores are the heads' log-probabilities summed down each
    path (what the adaptive policy calibrates and cuts by); sampled: the j-th draw without replacement from the
    row's compact q (`draw_siblings`, so q is exactly what each node was drawn from; no scores: the policy ranks
    sampled nodes by shape alone). Under a grammar the row is first masked with
    the grammar's state after the row's path (one mask per row: sampling stays exact under the mask). A node with no
    token left (fewer allowed columns than its rank, or q's support ran out) is dropped with its subtree.

    parents, depths, ranks: int64[N] (`StaticTree`'s, cut to a budget); uniforms float64[>= N] (node i's draw uses
    uniforms[i]) when temperature > 0; grammar None or the request's; tokens are logit columns (``id_map``: a draft
    vocabulary's target ids).
    """

    def __init__(self, parents: np.ndarray, depths: np.ndarray, ranks: np.ndarray, temperature: float,
                 uniforms: np.ndarray | None, grammar, id_map: np.ndarray | None) -> None:
        n = len(parents)
        self.parents, self.depths, self.ranks = parents, depths, ranks
        self.temperature, self.uniforms, self.grammar, self.id_map = temperature, uniforms, grammar, id_map
        self.tokens = np.zeros(n, dtype=np.int64)
        self.own = np.zeros(n, dtype=np.float64)  # greedy: each node's log-probability under its row
        self.keep = np.zeros(n, dtype=np.bool_)
        self.support = max(DRAFT_Q_SUPPORT, n)
        self.q_ids = np.full((n, self.support), -1, dtype=np.int64)
        self.q_probs = np.zeros((n, self.support), dtype=np.float32)
        self.children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents.tolist()):
            self.children.setdefault(parent, []).append(i)

    def expandable(self, depth: int) -> list[int]:
        """The kept nodes of ``depth`` that have children: the rows the next level expands."""
        return [i for i in np.flatnonzero((self.depths == depth) & self.keep).tolist() if i in self.children]

    def expand(self, row: int, logits: np.ndarray) -> None:
        """Choose row's children (if any, and if the row itself was kept) from logits float32[V']."""
        kids = self.children.get(row)
        if not kids or (row >= 0 and not self.keep[row]):
            return
        if self.grammar is not None:
            path, node = [], row
            while node >= 0:
                path.append(int(self.tokens[node]))
                node = int(self.parents[node])
            allowed = self.grammar.allowed(to_target_ids(self.id_map, np.array(path[::-1], dtype=np.int64)).tolist())
            logits = (np.where(allowed_columns(self.id_map, allowed, len(logits)), logits, -np.inf).astype(np.float32)
                      if allowed is not None else np.full_like(logits, -np.inf))
        if self.temperature <= 0:
            count = int(self.ranks[kids].max()) + 1
            if self.grammar is None:
                candidates, values = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.float64)
                top_columns(np.ascontiguousarray(logits), count, candidates, values)
                candidates = candidates[candidates >= 0]
            else:
                candidates = np.flatnonzero(logits > -np.inf)
                candidates = candidates[np.argsort(-logits[candidates], kind="stable")]
            normalizer = log_normalizer(np.ascontiguousarray(logits))
            for i in kids:
                if self.ranks[i] < len(candidates):
                    self.tokens[i], self.keep[i] = candidates[self.ranks[i]], True
                    self.own[i] = logits[self.tokens[i]] - normalizer
            return
        count, support = len(kids), self.support
        c_tokens, c_ids = np.zeros(count, np.int64), np.full((count, support), -1, np.int64)
        c_probs = np.zeros((count, support), np.float32)
        drawn = draw_siblings(np.ascontiguousarray(logits, dtype=np.float32), self.temperature, count,
                              self.uniforms[kids], c_ids, c_probs, c_tokens, np.empty(support, np.int64),
                              np.empty(support, np.float64), np.empty(support, np.float64))
        for j in range(drawn):
            i = kids[j]
            self.tokens[i], self.q_ids[i], self.q_probs[i], self.keep[i] = c_tokens[j], c_ids[j], c_probs[j], True

    def finish(self) -> DraftTree:
        """The kept nodes as a `DraftTree` (target ids; q where sampled)."""
        keep = self.keep
        index = np.cumsum(keep) - 1
        new_parents = np.where(self.parents >= 0, index[np.maximum(self.parents, 0)], -1)[keep]
        if self.temperature <= 0:
            scores = _greedy_scores(self.own, self.parents)[keep]  # a kept node's ancestors are kept
            return _tree(self.tokens[keep], new_parents, None, None, scores, id_map=self.id_map)
        return _tree(self.tokens[keep], new_parents, self.q_ids[keep], self.q_probs[keep], id_map=self.id_map)


def _greedy_scores(own: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """float32[N]: each node's own log-probability summed down its path (a greedy tree's scores: the heads' guess
    at log P(accepted), which the adaptive policy calibrates per own term)."""
    return np.log(path_products(np.exp(own), parents)).astype(np.float32)


def _top_ranks(logits: np.ndarray, count: int) -> np.ndarray:
    """int64[D, count]: each row's ``count`` best columns, best first, ties to the lower column (what a stable
    argsort of -logits begins with; a scan instead of a sort of the whole vocabulary)."""
    out = np.empty((logits.shape[0], count), dtype=np.int64)
    values = np.empty(count, dtype=np.float64)
    for d in range(logits.shape[0]):
        top_columns(np.ascontiguousarray(logits[d]), count, out[d], values)
    return out


def _tree(tokens: np.ndarray, parents: np.ndarray, q_ids: np.ndarray | None, q_probs: np.ndarray | None,
          scores: np.ndarray | None = None, id_map: np.ndarray | None = None) -> DraftTree:
    """scores: the dynamic builder's (static trees have none: the adaptive policy ranks them by depth).
    tokens and q_ids are logit columns, mapped to target ids through ``id_map`` (a draft vocabulary)."""
    if not len(tokens):
        return DraftTree.empty()
    tokens = to_target_ids(id_map, tokens)
    q_ids = None if q_ids is None else to_target_ids(id_map, q_ids)
    q = ((torch.from_numpy(np.ascontiguousarray(q_ids)), torch.from_numpy(np.ascontiguousarray(q_probs)))
         if q_ids is not None else (None, None))
    return DraftTree(torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)),
                     torch.from_numpy(np.ascontiguousarray(parents, dtype=np.int64)), q_ids=q[0], q_probs=q[1],
                     scores=None if scores is None else torch.from_numpy(np.ascontiguousarray(scores, dtype=np.float32)))


class _HeadKernels:
    """The heads' products on the CPU kernels, all in ONE compiled call (`kernels.medusa_heads`): each head's root
    product and residual blocks, then its own LM head — or ONE pass over the target's LM head for every head's rows
    together when the heads share it (the target's packed weights)."""

    @classmethod
    def build(cls, heads, target, depth: int, storage: str | None = None) -> "_HeadKernels | None":
        """None off the CPU kernels: the heads then run as torch modules (a storage option was refused there, by
        `check_storage_option`)."""
        return None if target.kernels is None else cls(heads, target.kernels, depth, storage)

    def __init__(self, heads, target_kernels, depth: int, storage: str | None = None) -> None:
        from specserve.kernels import PackedLinear, drafter_storage
        from specserve.kernels.medusa_heads import medusa_heads

        # A quantized target's heads run quantized too (`drafter_storage`; 3 heads over 4,096 tokens: 31 MB as float32,
        # 8 as int8, 4.8 as Q4_1 beside the default model's 4-bit layers).
        storage = storage or drafter_storage(target_kernels) or target_kernels.storage
        self.blocks = [[PackedLinear(heads.weight[k, layer], heads.bias[k, layer], storage)
                        for layer in range(heads.num_layers)] for k in range(depth)]
        self.roots = ([PackedLinear(heads.root_weight[k], None, storage) for k in range(depth)]
                      if heads.root_weight is not None else None)
        self.parents = ([PackedLinear(heads.parent_weight[k - 1], None, storage) for k in range(1, depth)]
                        if heads.parent_weight is not None else None)  # head k's at k - 1
        self.lm_heads = ([PackedLinear(heads.lm_heads[k], None, storage) for k in range(depth)]
                         if heads.lm_heads is not None else None)
        self.shared = target_kernels.lm_head
        self.embed = target_kernels.embed  # float32[V, H]: the target's own, for heads that read the root token
        self.depth = depth
        # The compiled call takes each kind of product stacked along a first axis; the PackedLinears keep views.
        self._blocks = _stacked([b for bs in self.blocks for b in bs])
        self._roots = _stacked(self.roots) if self.roots is not None else _no_products(self._blocks)
        self._parents = _stacked(self.parents) if self.parents else _no_products(self._blocks)
        self._lm = _stacked(self.lm_heads) if self.lm_heads is not None else _stacked([self.shared], views=False)
        self._no_rows = np.zeros((0, heads.hidden_size), dtype=np.float32)
        self._vocab = (self.lm_heads[0] if self.lm_heads is not None else self.shared).out_features
        self._run = medusa_heads  # bound once: a drafting step's host work runs on cold caches

    def __call__(self, feats: np.ndarray, depth: int | None = None, root_ids: np.ndarray | None = None, first: int = 0,
                 parent_ids: np.ndarray | None = None) -> np.ndarray:
        """feats float32[R, H] (and, for root-token heads, root_ids int64[R]: the root tokens; for parent-token heads
        from head 1 on, parent_ids int64[R]: each row's parent token; both embedded here with the target's table)
        -> logits float32[R, depth, V'] of heads ``first`` .. ``first + depth - 1`` (default: all built from first)."""
        depth = self.depth - first if depth is None else depth
        h = np.ascontiguousarray(feats, dtype=np.float32)
        r = self.embed[root_ids] if self.roots is not None else self._no_rows  # (a fancy index: a fresh C array)
        p = self.embed[parent_ids] if parent_ids is not None and self.parents else self._no_rows
        out = np.empty((h.shape[0], depth, self._vocab), dtype=np.float32)
        self._run(h, r, p, first, *self._roots, *self._parents, *self._blocks, len(self.blocks[0]), *self._lm,
                  self.lm_heads is None, out)
        return out


def _stacked(products: list, views: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, scales, biases) of same-shaped `PackedLinear`s stacked along a new first axis. views: point each
    product's arrays at its slice (one copy of the weights in memory)."""
    stacked = tuple(np.ascontiguousarray(np.stack([getattr(p, name) for p in products]))
                    for name in ("weight", "scales", "bias"))
    if views:
        for i, p in enumerate(products):
            p.weight, p.scales, p.bias = (a[i] for a in stacked)
    return stacked


def _no_products(like: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty stacks with `like`'s dtypes and dimensions (heads without root products)."""
    return tuple(np.zeros((0,) + (1,) * (a.ndim - 1), dtype=a.dtype) for a in like)
