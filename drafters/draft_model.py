"""The ``draft`` drafter: a small LM that shares the target's tokenizer proposes chains or top-k trees.

``draft:DIR`` loads DIR (Hugging Face layout, e.g. from ``specserve train draft``) into our own
`LlamaModel`, whose KV cache lives on the engine's block allocator (a request's block table addresses
its draft entries too); a bare ``draft`` means the bundled draft model when the target is the bundled
default model.

Each step (the shared loop of `level_drafter`, trees grown by `tree_builder`):

1. **catch up** — one batched forward over every request's tokens the draft has not cached yet
   (the tokens accepted last step and the new root; the whole prompt the first time). The logits at
   the root give the depth-1 nodes. Whatever the draft wrote past the root last step (its own tree)
   is simply overwritten.
2. **levels** — every expanded node gets ``topk`` children (greedy: its top-k tokens; sampled:
   ``topk`` tokens drawn without replacement from its compact q); the ``width`` best nodes of a level
   are expanded next and fed in one batched forward at slots past the root, each seeing only its
   ancestors among the earlier levels' slots (a tail mask). With ``topk == width == 1`` the tree is
   a chain and each level feeds one token on top of its cached ancestors.
3. **cut** — each request keeps its best ``budget`` nodes by cumulative score (greedy: draft
   log-probability; sampled: a value-independent rank score), so the kept tree is ancestor-closed and
   its shape never depends on sampled values — verification stays lossless.

A draft vocabulary (``draft_vocab.safetensors`` beside the weights, drafters/draft_vocab.py; the
bundled draft model has one of 2,048 tokens) keeps only those rows of the LM head: each level's logits
are [rows, Vd], mapped to target ids through `LevelDrafter.id_map`.

A draft cut from its target's own layers (`specserve train draft --data FEATURES`, training/draft_features.py;
``draft_config.json`` says ``"embedding": "target"``) stores no embedding: it reads through the target's
own table (the same tensor, no copy), keeps an LM head over its draft vocabulary only, and is refused beside
any target but the one it was cut from. Beside a GGUF file whose blocks run as stored, a draft model runs
8-bit products (the target's own layers there are 4- or 8-bit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.drafters.base import DraftRequest, TargetInfo, check_int_option, check_storage_option, register
from specserve.drafters.draft_vocab import FILE_NAME as DRAFT_VOCAB_FILE
from specserve.drafters.draft_vocab import load_draft_vocab
from specserve.drafters.level_drafter import LevelDrafter, LevelWork
from specserve.drafters.tree_builder import Frontier, TreeBuilder
from specserve.kv_cache import PagedKVCache
from specserve.model import LlamaModel
from specserve.step_batch import StepBatchBuilder


DRAFT_CONFIG = "draft_config.json"  # beside the weights: what made the draft (training/draft.py, draft_features.py)


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    return check_int_option("draft", name, value, low, high)


@dataclass
class _RequestState:
    num_cached: int = 0  # tokens of the request whose draft KV is valid (slots 0..num_cached-1)
    generator: torch.Generator | None = None


@register("draft")
class DraftModelDrafter(LevelDrafter):
    """Draft-model drafter (chains or top-k trees with draft probabilities).

    Options:
      depth:      tree depth (draft tokens along one path), in [1, 64].
      topk:       children of each expanded node (1 = chain), in [1, 64].
      width:      nodes expanded per level (the best by cumulative score), in [1, 64].
      max_budget: most nodes per tree, >= 1; at most the full tree, ``topk * (1 + (depth - 1) * width)``.
      seed:       seeds the per-request draft samplers (temperature > 0), with the request's seed or id.
      storage:    how the CPU kernels store the draft's weights (`specserve.kernels.STORAGES`); default the
                  target's quantization, or beside a GGUF file's blocks `kernels.drafter_storage`'s (Q4_1 beside
                  4-bit layers, else int8), else the draft's own dtype.
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
        storage: str | None = None,
    ) -> None:
        self.depth = _check("depth", depth, 1, 64)
        self.topk = _check("topk", topk, 1, 64)
        self.width = _check("width", width, 1, 64)
        full = self.topk * (1 + (self.depth - 1) * self.width)
        self.max_budget = full if max_budget is None else min(_check("max_budget", max_budget, 1, 1 << 20), full)
        self.seed = _check("seed", seed, 0, 2**63 - 1)
        storage = check_storage_option("draft", storage, target)
        self.path = _resolve_path(target, path)
        target_model = target.model
        # The target's attention backend (triton on CUDA): one kernel, and CUDA graphs, for both models.
        attention = target_model.backend.name if target_model is not None else None
        recorded = read_draft_config(self.path)
        self.borrows_embedding = recorded.get("embedding") == "target"
        if self.borrows_embedding:  # draft_vocab: int64[Vd] target ids, or None: all of them
            self.model, draft_vocab = load_on_target_embedding(self.path, target, attention, recorded)
        else:
            self.model, draft_vocab = _load_own(self.path, target, attention)
        cfg = self.model.config
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {str(self.path)!r} has vocab_size {cfg.vocab_size} but the target has {target.vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        _check_same_tokenizer(self.path, getattr(target, "tokenizer_dir", None) or target.model_dir)
        if draft_vocab is not None:
            self.id_map = draft_vocab.numpy()
        if target_model is None or target_model.kernels is not None:
            # A quantized target's draft model is quantized too: its forwards are most of a draft step, and a user
            # who chose int8/int4 chose that speed. A GGUF file's blocks run as stored (no quantization was asked
            # for), so its draft gets `drafter_storage`'s: 4-bit beside 4-bit layers, else 8-bit. Output stays the
            # target's (it verifies).
            from specserve.kernels import drafter_storage

            kernels = target.kernels
            self.model.use_cpu_kernels(None if kernels is None
                                       else storage or kernels.quantization or drafter_storage(kernels))
        self.vocab = cfg.vocab_size if draft_vocab is None else len(draft_vocab)
        self.device = target.device
        self.cache = None  # made by `attach_kv` on the engine's allocator
        self._state: dict[str, _RequestState] = {}
        # Slots a tree needs past the root: the frontiers of levels 1..depth-1, fed one level at a time.
        self.kv_slots_past_root = (self.depth - 1) * self.width

    # ---- the protocol ---------------------------------------------------------------------------

    def kv_bytes_per_slot(self) -> int:
        cfg = self.model.config
        dtype = torch.float32 if self.model.kernels is not None else self.model.dtype
        return PagedKVCache.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)

    def attach_kv(self, allocator) -> None:
        self.cache = self.model.new_cache(allocator)

    def use_cuda_graphs(self, max_num_seqs: int, max_positions: int) -> None:
        """Graphs for the catch-up (a request's few uncached tokens) and chain levels (one row each); levels of
        a top-k tree mask earlier levels' cached rows, wider than any bucket, and stay eager."""
        if self.model.backend.name == "triton":
            self.model.use_cuda_graphs(self.cache, max_num_seqs, min(64, self.depth + 2), max_positions,
                                       capture=self.model.device.type == "cuda")

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    # ---- the level loop's hooks -----------------------------------------------------------------

    def _new_state(self, num_cached: int) -> _RequestState:
        return _RequestState(num_cached)

    def _prepare(self, req: DraftRequest) -> _RequestState:
        return self._state.setdefault(req.request_id, _RequestState())

    def _catch_up(self, work: list[LevelWork]) -> torch.Tensor:
        """Feed each request's uncached tokens (through its root); return the root rows' logits [A, V]."""
        builder = StepBatchBuilder(self.cache.allocator)
        for w in work:
            length = len(w.req.token_ids)
            start = min(w.state.num_cached, length - 1)  # the root is always (re)fed: we need its logits
            builder.add(w.req.request_id, start, np.ascontiguousarray(w.req.token_ids[start:length], dtype=np.int64),
                        logits="last")
            w.state.num_cached = length
        return self.model.forward(builder.build(), self.cache).logits  # [A, V] float32

    def _feed_level(self, work: list[LevelWork], builder: TreeBuilder, front: Frontier, active: np.ndarray,
                    level: int) -> torch.Tensor:
        """Feed the frontier of level ``level - 1``: its nodes sit at depth level-1, slots past the root."""
        w = self.width
        rows = np.searchsorted(front.requests, active)
        batch = StepBatchBuilder(self.cache.allocator)
        for a, tokens in zip(active.tolist(), self._target_ids(front.tokens[rows])):
            length = len(work[a].req.token_ids)
            mask = None if w == 1 else builder.feed_mask(level - 1, a)
            batch.add(work[a].req.request_id, length + (level - 2) * w, tokens,
                      np.full(w, length - 2 + level, dtype=np.int64), mask, logits="all")
        return self.model.forward(batch.build(), self.cache).logits.view(len(active), w, -1)

    def describe(self) -> dict:
        """Drafter options plus what was loaded: layers, draft vocabulary, where the embedding comes from, and the
        products' storage on the CPU kernels."""
        cfg = self.model.config
        out = {**super().describe(), "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
               "draft_vocabulary": self.vocab if self.vocab != cfg.vocab_size else "the target's whole vocabulary",
               "embedding": "the target's (borrowed)" if self.borrows_embedding else "its own"}
        if self.model.kernels is not None:
            out["products"] = self.model.kernels.storage
        return out

    def __repr__(self) -> str:
        return (f"DraftModelDrafter(path={str(self.path)!r}, depth={self.depth}, topk={self.topk}, width={self.width}, "
                f"max_budget={self.max_budget})")


def read_draft_config(path: Path) -> dict:
    """``draft_config.json`` beside a draft model's weights (what made it; `train draft` writes it), {} without one."""
    config = path / DRAFT_CONFIG
    if not config.is_file():
        return {}
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config}: not valid JSON ({exc})") from None


def _load_own(path: Path, target: TargetInfo, attention: str | None) -> tuple[LlamaModel, torch.Tensor | None]:
    """(model, draft vocabulary int64[Vd] or None: all tokens) of a draft model with its own weights throughout (a
    Hugging Face directory), its LM head cut to its draft vocabulary when it has one."""
    model = LlamaModel.from_pretrained(path, target.device, target.dtype, attention=attention, cpu_kernels=False)
    draft_vocab = load_draft_vocab(path, model.config.vocab_size)
    if draft_vocab is not None:
        model.restrict_lm_head(draft_vocab)
    return model, draft_vocab


def load_on_target_embedding(path: Path, target: TargetInfo, attention: str | None,
                             recorded: dict) -> tuple[LlamaModel, torch.Tensor]:
    """(model, draft vocabulary int64[Vd]) of a draft that borrows its target's embedding: its own layers, norm
    and LM head over its draft vocabulary (``lm_head.weight`` [Vd, H]) from ``model.safetensors``, the embedding
    the target's own tensor (shared, not copied). ``recorded``: its ``draft_config.json``. Refused with one line for
    another target than the one recorded there (file sha256 for a GGUF file, config and tokenizer fingerprints for
    a directory)."""
    from safetensors.torch import load_file

    from specserve.checkpoint import expected_shapes
    from specserve.config import load_config
    from specserve.drafters.eagle_checkpoint import fingerprint_mismatch
    from specserve.drafters.int8_rows import dequantize_rows

    if target.model is None:
        raise ValueError(f"draft model {str(path)!r} reads through its target's embedding: it needs the target's weights")
    differs = fingerprint_mismatch(recorded.get("target", {}), target.model_dir)
    if differs is not None:
        raise ValueError(f"draft model {str(path)!r} was cut from another target ({recorded['target'].get('path')!r}; "
                         f"{differs} differs): train one for this target with `specserve train draft --data`")
    cfg = load_config(path)
    if cfg.vocab_size != target.vocab_size or cfg.hidden_size != target.hidden_size:
        raise ValueError(f"draft model {str(path)!r} (vocabulary {cfg.vocab_size}, hidden {cfg.hidden_size}) does not fit "
                         f"the target (vocabulary {target.vocab_size}, hidden {target.hidden_size})")
    draft_vocab = load_draft_vocab(path, cfg.vocab_size)
    if draft_vocab is None:
        raise ValueError(f"draft model {str(path)!r} reads through its target's embedding but has no {DRAFT_VOCAB_FILE}")
    try:
        state = load_file(str(path / "model.safetensors"))
    except Exception as exc:  # safetensors raises its own error types for missing, truncated or corrupt files
        raise ValueError(f"{path / 'model.safetensors'}: not a readable safetensors file ({exc})") from None
    state = dequantize_rows(state, str(path / "model.safetensors"))  # drafts stored 8-bit (`train draft --storage`)
    expected = expected_shapes(cfg)
    expected.pop("model.embed_tokens.weight")
    expected["lm_head.weight"] = (len(draft_vocab), cfg.hidden_size)
    wrong = sorted(set(expected) ^ set(state)) + sorted(k for k in expected if k in state
                                                         and tuple(state[k].shape) != expected[k])
    if wrong:
        raise ValueError(f"{path / 'model.safetensors'}: tensors missing, unexpected or mis-shaped: {', '.join(wrong[:5])}")
    state = {k: v.to(target.device, target.dtype) for k, v in state.items()}
    head = state.pop("lm_head.weight")
    embed = target.model.embed.data  # float[V, H]: only indexed, shared with the target
    state["model.embed_tokens.weight"] = state["lm_head.weight"] = embed  # the head's rows are replaced below
    model = LlamaModel(cfg, target.device, target.dtype, attention)
    model.load_hf_state(state)
    model.restrict_lm_head(draft_vocab, weight=head)
    return model, draft_vocab


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
