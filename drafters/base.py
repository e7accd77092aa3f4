"""The `Drafter` protocol, what crosses between the engine and a drafter, and the drafter registry.

The engine never asks *which* drafter it runs: it calls `propose` once per step for the whole
running batch, and `on_commit` once the verifier has decided what each request accepted. A new
drafter is one file with a class decorated by ``@register("name")``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from specserve.verify import DraftTree, VerifyResult


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may know about the target it drafts for.

    model: the target `specserve.model.LlamaModel` (drafter heads reuse its embeddings and LM head);
           None for drafters that need no weights (n-gram).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    device: torch.device
    dtype: torch.dtype
    model_dir: str | None = None
    model: Any = None
    tokenizer_dir: str | None = None  # where the target's tokenizer.json is (a GGUF target's converted one, cached)

    @property
    def kernels(self):
        """The target's `specserve.kernels.ModelKernels`, or None (no model, or one off the CPU kernels)."""
        return getattr(self.model, "kernels", None) if self.model is not None else None


@dataclass(frozen=True)
class DraftRequest:
    """Read-only view of one running request, handed to `Drafter.propose`.

    token_ids: int64[L] numpy array, prompt + every emitted token; the last entry is the root (the
               pending token whose KV is not cached yet), the token the tree's depth-1 nodes follow.
    hidden_states: for drafters with `needs_hidden_states`: {layer: float[n, hidden]}, the target's
               features (transformers' `hidden_states` numbering) of every token committed since
               this request was last handed to `propose`, in order: the tokens at positions
               ``len(token_ids) - 1 - n .. len(token_ids) - 2`` (the whole prompt the first time; then
               what was committed since — one step's root and accepted nodes, or many steps' after
               the request decoded plainly for a while: a request is handed to `propose` only in
               steps where its budget is above 0). Never the root's: its feature comes with the next
               verify. Handed over exactly once. None when there is nothing new (or the drafter
               needs no features).
    seed:      the request's sampling seed (None when unseeded): a drafter that samples seeds its own
               generator from it, so a seeded request reproduces across calls.
    mask:      a `specserve.step_hooks.DraftMask` when one of the request's rules restricts what may be
               drafted (a constrained request drafting grammar-aware: its `GrammarState`):
               ``mask.allowed(path)`` is the bool[V] mask of target ids allowed after the root + `path`.
               A drafter that samples must mask its distribution with it (q is then the masked one);
               the rule filters forbidden nodes out of trees without q. Read-only for drafters: they
               must leave it as they found it.
    adjust:    `specserve.step_hooks.DraftLogits` of the request's rules (penalties, logit bias): a drafter
               that drafts from its own logits applies them to each row before drawing (q is then the
               adjusted distribution); others may ignore them — drafts only get likelier to be accepted.
    parts:     the names of a hybrid drafter's parts this request drafts with (None: all; the
               request's choice on the page or in the API). Other drafters ignore it.
    """

    request_id: str
    token_ids: np.ndarray
    temperature: float
    hidden_states: dict[int, torch.Tensor] | None = None
    seed: int | None = None
    mask: Any = None
    parts: tuple[str, ...] | None = None
    adjust: tuple = ()


@dataclass(frozen=True)
class CommitInfo:
    """What one request committed this step: the verifier's result and the request's new length."""

    request_id: str
    result: VerifyResult
    num_tokens: int  # len(token_ids) after the step, the new root included
    # For drafters with `wants_row_argmax` (lookahead): the tree actually verified (the policy may have
    # cut the drafter's) and the target's argmax at each of its verify rows, int64[N+1], root row first.
    tree: Any = None
    row_argmax: np.ndarray | None = None


class Drafter(ABC):
    """Proposes one `DraftTree` per request per step.

    Capability flags (class attributes) tell the engine what to hand over:
      needs_hidden_states: the verify forward must return target hidden states of `hidden_layers`.
      gives_probs:         trees carry `probs`, so stochastic verification uses them as q.
      catches_up:          before drafting, the drafter feeds every token committed since it last
                           drafted through its own model (draft model, EAGLE): drafting after a pause
                           costs in proportion to the pause. The adaptive policy prices that backlog
                           only for such drafters.
      wants_row_argmax:    `on_commit` also gets the verified tree and the target's argmax at each of its
                           rows (lookahead: the rows of its Jacobi window are the next guesses).
      drafts_by_level:     each tree level costs the drafter work of its own (a forward of a draft model
                           or EAGLE head, one Medusa head's products), so the adaptive policy chooses a
                           depth; others draft their whole tree for about the cost of one level (n-gram,
                           suffix) and are always asked for all of it.
    `max_budget` is the most nodes one tree may have; the engine's budgets never exceed it; `depth` the
    most levels its trees have; `part_names` the parts a request may choose among (a hybrid's).
    """

    name: ClassVar[str] = ""
    needs_hidden_states: ClassVar[bool] = False
    hidden_layers: tuple[int, ...] = ()
    gives_probs: ClassVar[bool] = False
    catches_up: ClassVar[bool] = False
    drafts_by_level: ClassVar[bool] = False
    wants_row_argmax: ClassVar[bool] = False
    # Learns from earlier requests (the suffix drafter's index of finished outputs): a request's trees then
    # depend on what else the server ran, so a seeded sampled request no longer reproduces its output.
    # An instance may say False where its options turn the learning off (`learns_across_requests_with`).
    learns_across_requests: bool = False
    max_budget: int = 0
    depth: int = 1
    part_names: tuple[str, ...] = ()
    # Cache slots past a request's root that the drafter's own model writes while drafting (its tree
    # levels); the engine reserves them at admission.
    kv_slots_past_root: int = 0
    # Prefix caching (specserve/prefix_cache.py): tokens past a slot that the drafter's own KV entry at that
    # slot depends on (EAGLE: 1, its pair at slot i is (feature i, token i+1)); 0 for the draft model.
    kv_lookahead: int = 0

    @classmethod
    def learns_across_requests_with(cls, options: dict[str, Any]) -> bool:
        """Whether a drafter of this class built with ``options`` learns across requests (known before building
        one: `specserve train default-drafter` rules such drafters out of the default)."""
        return cls.learns_across_requests

    def kv_bytes_per_slot(self) -> int:
        """Bytes of the drafter's own KV cache per cache slot (0: it keeps none), to size the pool."""
        return 0

    def attach_kv(self, allocator) -> None:
        """Make the drafter's own KV cache on the engine's `BlockAllocator`: a request's block table then
        addresses its drafter entries too, so admission counts them and nothing grows later."""

    def cached_prefix_len(self, request_id: str) -> int:
        """Leading cache slots of the request whose drafter KV entries are valid and final (0: it keeps
        none): the prefix cache offers blocks with them to later requests that draft."""
        return 0

    def catch_up(self, requests: list[DraftRequest]) -> None:
        """Write the drafter's own KV entries for what each request committed since it last drafted, without
        drafting (the engine keeps them within a block of the request's tokens while the budget policy keeps it
        from drafting, so its blocks stay worth offering to the prefix cache). ``requests`` carry the target
        features queued for them, as in `propose`. Default: nothing (drafters that keep no KV)."""

    def start_from_prefix(self, request_id: str, num_tokens: int) -> None:
        """A new request's first `num_tokens` slots came from the prefix cache, drafter entries included
        (for drafters that keep KV): start its state there, catch up over the rest only. Default: nothing."""

    def use_cuda_graphs(self, max_num_seqs: int, max_positions: int) -> None:
        """Capture the drafter's own model forwards in CUDA graphs (after `attach_kv`); default: none to capture."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest], budgets: list[int], depth: int | None = None) -> list[DraftTree]:
        """One tree per request with at most ``budgets[i]`` nodes (an empty tree is always valid).

        depth: the budget policy's cap on tree depth this step (None: the drafter's own). Drafters whose
        cost grows with depth (one forward per level) must honour it; others may draft deeper, the
        policy's cut drops what is past it."""

    def on_commit(self, commits: list[CommitInfo]) -> None:
        """Update per-request drafter state with what was accepted. Default: stateless."""

    def release(self, request_id: str) -> None:
        """The request finished or was cancelled: drop its state. Default: stateless."""

    def forget_shared(self) -> None:
        """Drop what was learned from earlier requests (state no single request owns: the suffix drafter's
        index of finished outputs). Benchmarks call it before each timed run, so a prompt measured again is
        not drafted from its own earlier answer. Default: nothing is shared."""

    def describe(self) -> dict[str, Any]:
        """What `specserve info --drafter` prints: what was loaded and how it drafts. Drafters that read
        checkpoints add what they detected (format, version, vocabulary mapping, ...). JSON-able values."""
        out: dict[str, Any] = {"drafter": self.name}
        if getattr(self, "path", None) is not None:
            out["path"] = str(self.path)
        for option in ("depth", "topk", "width", "max_budget"):
            if isinstance(getattr(self, option, None), int):
                out[option] = getattr(self, option)
        out["needs_target_features"] = list(self.hidden_layers) if self.needs_hidden_states else False
        out["gives_probs"] = self.gives_probs
        return out


def check_int_option(drafter: str, name: str, value: object, low: int, high: int | None = None) -> int:
    """A drafter option that must be an integer in [low, high] (no upper bound when high is None)."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if ok and value >= low and (high is None or value <= high):
        return int(value)
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{drafter} drafter option {name} must be an integer {allowed}, got {value!r}")


def check_storage_option(drafter: str, storage: object, target: TargetInfo) -> str | None:
    """A drafter's `storage` option: None (the default: `kernels.drafter_storage` beside a quantized target, else the
    drafter's own) or one of `kernels.linear.STORAGES`, which only the CPU kernels run (refused where the target
    does not run on them)."""
    if storage is None:
        return None
    from specserve.kernels.linear import STORAGES

    if storage not in STORAGES:
        raise ValueError(f"{drafter} drafter option storage must be one of {list(STORAGES)}, got {storage!r}")
    if target.kernels is None:
        raise ValueError(f"{drafter} drafter option storage applies to the CPU kernels, which this target does not run on")
    return storage


_REGISTRY: dict[str, type[Drafter]] = {}


def register(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: make a drafter available as ``name`` / ``name:path`` in drafter specs."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"drafter name {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered_drafters() -> list[str]:
    return sorted(_REGISTRY)


def drafter_class(name: str) -> type[Drafter]:
    """The class registered as ``name`` (KeyError when none is)."""
    return _REGISTRY[name]


def parse_drafter_spec(spec: str) -> tuple[str, str | None]:
    """``"name"`` → (name, None); ``"name:path"`` → (name, path)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"drafter spec must be a non-empty string like 'ngram' or 'draft:PATH', got {spec!r}")
    name, sep, path = spec.strip().partition(":")
    if sep and not path:
        raise ValueError(f"drafter spec {spec!r} has an empty path after ':'")
    return name, (path or None)


def create_drafter(spec: str, target: TargetInfo, options: dict[str, Any] | None = None) -> Drafter:
    """Build the drafter a spec names. Each drafter class takes ``(target, path=None, **options)``.

    A name without a path (``"draft"``, later ``"medusa"``/``"eagle"``) gets the embedded bundle's
    drafter of that name when the target is the bundled default model.
    """
    name, path = parse_drafter_spec(spec)
    if path is None:
        from specserve.bundle_paths import resolve_drafter_path

        path = resolve_drafter_path(name, target.model_dir)
    if name not in _REGISTRY:
        known = ", ".join(registered_drafters()) or "none"
        raise ValueError(f"unknown drafter {name!r}; registered drafters: {known}")
    cls = _REGISTRY[name]
    options = dict(options or {})
    allowed = option_names(cls)
    unknown = sorted(k for k in options if k not in allowed)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for drafter {name!r}; allowed: {allowed}")
    return cls(target, path=path, **options)


def option_names(cls: type) -> list[str]:
    """The options a drafter class takes (its constructor's keywords but the target and path), sorted."""
    return sorted(k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "target", "path"))
