"""Medusa heads: the module, and their checkpoints in our layout and the public ones.

**Ours** (written by ``specserve train medusa``)::

    medusa_config.json          {"format": "specserve-medusa", "version": 1 | 2 | 3, "num_heads", "num_layers",
                                 "hidden_size", "vocab_size", "lm_head": "own" | "shared",
                                 optional "draft_vocab_size", "root_token" (version 2),
                                 "parent_token" (version 3),
                                 "target": {"path", "model_type", "hidden_size", "vocab_size",
                                            "num_layers", "fingerprint" (a directory) or
                                            "file_sha256" + "tokenizer" (a GGUF file)},
                                 optional "choices", "metrics"}
    medusa_heads.safetensors    "weight" [K, L, H, H], "bias" [K, L, H], and with own LM heads
                                "lm_heads" [K, V', H]; with a draft vocabulary "draft_to_target"
                                int64[V'] (ascending target ids), else V' = V; with "root_token"
                                "root_weight" [K, H, H]; with "parent_token" "parent_weight" [K - 1, H, H]

Root-token heads (``root_token``, written as version 2; version 1 files have none) also read the
embedding of the root — the token the target has just chosen after the feature's position, which
plain Medusa heads must guess. Head 0 then predicts the token after a known one, EAGLE's depth-1
question, instead of marginalising over the root as well (on the default model's held-out data:
training/README). The embedding is the target's own table, so the heads store none.

Parent-token heads (``parent_token``, version 3; root-token heads too) also read, from head 1 on, the embedding of
the token their guess follows: head k's node in a tree is the child of a depth-k node, whose token the tree already
holds when it expands that node (Hydra's heads). Each node then gets its own children — plain heads give every node
of a depth the same guesses — at the price of one heads call per tree level (`drafters/medusa.py`).

A draft vocabulary (own LM heads only) keeps each head's LM head to the V' most frequent target tokens,
as EAGLE-3 heads do: on SmolLM2 (V = 49,152) a full own LM head per head would cost a target LM head's
time each step and 57 MB in float16. A token outside it is never drafted; verification is unchanged.

**Public Medusa** (FasterDecoding/Medusa: Medusa-1 heads, v2 heads ending in the target's LM head, and
Medusa-2 targets fine-tuned jointly with their heads), detected from the files: see `medusa_public`.

The target fingerprint (ours only) of a model directory is the sha256 of the target's architecture fields,
its tokenizer fingerprint and its LM head cast to fp16 — equal for an fp32 checkpoint and its fp16 export,
different for another model of the same shape. A GGUF target is identified by the file's own sha256 (its
quantized weights are what the heads were trained on) and its tokenizer's fingerprint, as EAGLE heads are.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from specserve.drafters.checkpoint_io import read_json as _read_json
from specserve.drafters.checkpoint_io import read_safetensors
from specserve.drafters.medusa_public import (
    PUBLIC_CONFIG,
    PUBLIC_WEIGHTS,
    check_shapes,
    inspect_public,
)
from torch import nn

FORMAT = "specserve-medusa"
VERSIONS = (1, 2, 3)  # `save_heads` writes the lowest that holds the heads: 2 reads the root token, 3 the parent's
CONFIG_FILE = "medusa_config.json"
WEIGHTS_FILE = "medusa_heads.safetensors"
LM_HEAD_MODES = ("own", "shared")
_ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "tie_word_embeddings")


class MedusaHeads(nn.Module):
    """K Medusa heads over the target's final normed hidden state h (what its LM head reads).

    Head k: ``x = h`` (root-token heads: ``x = h + R[k] e`` with e the target's embedding of the root,
    the token at t + 1; parent-token heads add ``P[k - 1] e_k`` for k >= 1, e_k the embedding of the token at
    t + 1 + k, the node whose child head k guesses), then ``x <- x + SiLU(W[k, l] x + b[k, l])`` for each of ``num_layers`` blocks,
    then ``logits = U_k x`` with U_k [V', H] its own LM head (``lm_head="own"``) or the target's
    (``"shared"``, passed to `forward`). Blocks and R start at zero, so a fresh head is the target's LM
    head. Head k at the feature of position t predicts the token at t + k + 2.

    draft_vocab_size: own LM heads only, V' < V rows scoring the target ids in the buffer
    ``draft_to_target`` int64[V'] (logits column j is target token draft_to_target[j]); None: V' = V.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, lm_head: str = "own",
                 draft_vocab_size: int | None = None, root_token: bool = False, parent_token: bool = False) -> None:
        super().__init__()
        if lm_head not in LM_HEAD_MODES:
            raise ValueError(f"lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
        for name, value, low in (("hidden_size", hidden_size, 1), ("vocab_size", vocab_size, 1),
                                 ("num_heads", num_heads, 1), ("num_layers", num_layers, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1 << 20:
                raise ValueError(f"medusa {name} must be an integer >= {low}, got {value!r}")
        if draft_vocab_size is not None:
            if lm_head != "own":
                raise ValueError("a Medusa draft vocabulary needs own LM heads (lm_head='own')")
            if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int) \
                    or not 1 <= draft_vocab_size <= vocab_size:
                raise ValueError(f"medusa draft_vocab_size must be an integer in [1, {vocab_size}], got {draft_vocab_size!r}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.lm_head_mode = num_heads, num_layers, lm_head
        self.draft_vocab_size = draft_vocab_size
        if parent_token and not root_token:
            raise ValueError("medusa heads that read their parent's token read the root token too (root_token=True)")
        self.root_token, self.parent_token = bool(root_token), bool(parent_token)
        self.root_weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size)) if root_token else None  # [K, H, H]
        # [K - 1, H, H]: head k >= 1's product of its parent's embedding (head 0's parent is the root)
        self.parent_weight = nn.Parameter(torch.zeros(num_heads - 1, hidden_size, hidden_size)) if parent_token else None
        self.weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size, hidden_size))  # [K, L, H, H]
        self.bias = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size))  # [K, L, H]
        rows = vocab_size if draft_vocab_size is None else draft_vocab_size
        self.lm_heads = nn.Parameter(torch.zeros(num_heads, rows, hidden_size)) if lm_head == "own" else None
        if draft_vocab_size is not None:
            self.register_buffer("draft_to_target", torch.arange(draft_vocab_size, dtype=torch.int64))
        else:
            self.draft_to_target = None

    def init_lm_heads(self, target_lm_head: torch.Tensor) -> None:
        """Start every own LM head from the target's [V, H] (its draft vocabulary's rows, when it has one)."""
        if self.lm_heads is not None:
            rows = target_lm_head if self.draft_to_target is None else target_lm_head[self.draft_to_target.to(target_lm_head.device)]
            with torch.no_grad():
                self.lm_heads.copy_(rows.to(self.lm_heads)[None].expand_as(self.lm_heads))

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Name the target ids the draft vocabulary's columns score: int64[V'], distinct, ascending, < V."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.int64).cpu()
        if self.draft_to_target is None or ids.shape != self.draft_to_target.shape:
            raise ValueError(f"a draft vocabulary of {self.draft_vocab_size} ids is expected, got {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"draft_to_target must hold ascending, distinct token ids in [0, {self.vocab_size})")
        with torch.no_grad():
            self.draft_to_target.copy_(ids.to(self.draft_to_target.device))

    def forward(self, h: torch.Tensor, lm_weight: torch.Tensor | None = None, heads: int | None = None,
                first: int = 0, root_embed: torch.Tensor | None = None,
                parent_embed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, ..., V'] of heads ``first .. first + n - 1`` (n = ``heads``, default all) for h [..., H]
        (V' = V without a draft vocabulary; column j scores target id ``draft_to_target[j]`` with one).

        lm_weight: the target's LM head [V, H], needed when the heads share it. root_embed [..., H]: the
        target's embedding of each feature's root token, needed by root-token heads (ignored by others).
        parent_embed [..., H]: parent-token heads from head 1 on, which run one at a time (``heads=1``): the
        embedding of the token each row's guess follows (ignored by other heads and by head 0).
        """
        n = self.num_heads - first if heads is None else heads
        idx = slice(first, first + n)
        shape = h.shape[:-1]
        x = h.reshape(1, -1, self.hidden_size).expand(n, -1, -1)  # [n, M, H]
        if self.root_weight is not None:
            if root_embed is None:
                raise ValueError("these Medusa heads read the root token: pass root_embed")
            e = root_embed.reshape(1, -1, self.hidden_size).expand(n, -1, -1)
            x = x + torch.bmm(e, self.root_weight[idx].transpose(1, 2))
        if self.parent_weight is not None and first + n > 1:
            if n != 1 or parent_embed is None:
                raise ValueError("these Medusa heads read their parent's token: from head 1 on they run one at a time "
                                 "(heads=1), with parent_embed")
            p = parent_embed.reshape(1, -1, self.hidden_size)
            x = x + torch.bmm(p, self.parent_weight[first - 1 : first].transpose(1, 2))
        for layer in range(self.num_layers):
            x = x + F.silu(torch.baddbmm(self.bias[idx, layer, None, :], x, self.weight[idx, layer].transpose(1, 2)))
        if self.lm_heads is not None:
            logits = torch.bmm(x, self.lm_heads[idx].transpose(1, 2))
        else:
            if lm_weight is None:
                raise ValueError("these Medusa heads share the target's LM head: pass lm_weight")
            logits = F.linear(x.reshape(-1, self.hidden_size), lm_weight).reshape(n, -1, lm_weight.shape[0])
        return logits.reshape(n, *shape, logits.shape[-1])


@dataclass
class LoadedHeads:
    heads: MedusaHeads
    config: dict  # our medusa_config.json, or the public config.json
    layout: str  # "specserve" | "medusa"
    format: str = "specserve Medusa heads"  # what `describe_heads` calls the files


# ---- the target's fingerprint ----------------------------------------------------------------------


def target_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the target's architecture fields, tokenizer fingerprint and fp16 LM head."""
    from safetensors import safe_open
    from specserve.tokenizer_fingerprint import tokenizer_fingerprint

    from specserve.checkpoint import checkpoint_files

    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json", "target config")
    arch = {k: config.get(k) for k in _ARCH_KEYS}
    tok = tokenizer_fingerprint(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    weight = None
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    weight = f.get_tensor(name)
                    break
        if weight is not None:
            break
    if weight is None:
        raise ValueError(f"the target in {str(model_dir)!r} has neither lm_head.weight nor model.embed_tokens.weight")
    digest = hashlib.sha256(json.dumps({"arch": arch, "tokenizer": tok}, sort_keys=True).encode())
    digest.update(weight.to(torch.float16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def target_record(model: str | Path) -> dict:
    """What our config says about the target heads were trained for: a model directory or a GGUF file."""
    model = Path(model).expanduser().resolve()
    if model.is_file():  # a GGUF file: identified as EAGLE heads identify it (file and tokenizer sha256)
        from specserve.drafters.eagle_checkpoint import target_config
        from specserve.drafters.eagle_checkpoint import target_fingerprint as file_identity

        config, identity = target_config(model), file_identity(model)
        return {"path": str(model), "model_type": config.get("model_type"), "hidden_size": config.get("hidden_size"),
                "vocab_size": config.get("vocab_size"), "num_layers": config.get("num_hidden_layers"),
                "file_sha256": identity["file_sha256"], "tokenizer": identity["tokenizer"]}
    config = _read_json(model / "config.json", "target config")
    return {"path": str(model), "model_type": config.get("model_type"), "hidden_size": config.get("hidden_size"),
            "vocab_size": config.get("vocab_size"), "num_layers": config.get("num_hidden_layers"),
            "fingerprint": target_fingerprint(model)}


def _check_target(recorded: dict, target: str | Path, path: Path) -> None:
    """ValueError when heads whose config records ``recorded`` were trained for another target than ``target``
    (a GGUF file is named by its sha256, a model directory by `target_fingerprint`; heads that record neither
    are not checked)."""
    target = Path(target)
    if recorded.get("file_sha256") is None and recorded.get("fingerprint") is None:
        return
    if target.is_file():
        from specserve.drafters.eagle_checkpoint import file_sha256

        key, have = "file_sha256", file_sha256(target)
    else:
        key, have = "fingerprint", target_fingerprint(target)
    if recorded.get(key) != have:
        raise ValueError(f"medusa heads in {str(path)!r} were trained for another target "
                         f"({recorded.get('path')!r}; fingerprint mismatch): train heads for this one with "
                         "`specserve train medusa`")


# ---- saving ----------------------------------------------------------------------------------------


def save_heads(heads: MedusaHeads, out_dir: str | Path, target_dir: str | Path, *, dtype: torch.dtype = torch.float16,
               extra: dict | None = None) -> dict:
    """Write ``medusa_config.json`` + ``medusa_heads.safetensors`` (weights cast to ``dtype``); return the config."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": heads.weight, "bias": heads.bias}
    if heads.lm_heads is not None:
        tensors["lm_heads"] = heads.lm_heads
    if heads.root_weight is not None:
        tensors["root_weight"] = heads.root_weight
    if heads.parent_weight is not None:
        tensors["parent_weight"] = heads.parent_weight
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
    vocab = {}
    if heads.draft_to_target is not None:
        tensors["draft_to_target"] = heads.draft_to_target.detach().to("cpu", torch.int64).contiguous()
        vocab = {"draft_vocab_size": heads.draft_vocab_size}
    root = {"root_token": True} if heads.root_token else {}
    if heads.parent_token:
        root["parent_token"] = True
    version = 3 if heads.parent_token else 2 if heads.root_token else 1
    config = {"format": FORMAT, "version": version, "num_heads": heads.num_heads,
              "num_layers": heads.num_layers, "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size,
              "lm_head": heads.lm_head_mode, **vocab, **root,
              "dtype": str(dtype).removeprefix("torch."), "target": target_record(target_dir), **(extra or {})}
    tmp = out_dir / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / WEIGHTS_FILE)
    tmp = out_dir / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(config, indent=1) + "\n")
    tmp.replace(out_dir / CONFIG_FILE)
    return config


# ---- loading ---------------------------------------------------------------------------------------


def load_heads(path: str | Path, *, hidden_size: int, vocab_size: int, model_type: str | None = None,
               target_dir: str | Path | None = None) -> LoadedHeads:
    """Load Medusa heads from ``path`` (either layout) for a target of this shape; float32 on the CPU.

    ValueError names what does not match: another hidden size or vocabulary, another model type, or
    (our layout, when ``target_dir`` is given) another target fingerprint; FileNotFoundError when
    ``path`` is missing; ValueError for unreadable or inconsistent files.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"medusa heads directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"medusa heads path {str(path)!r} is not a directory")
    if (path / CONFIG_FILE).is_file():
        loaded = _load_ours(path)
    elif has_heads(path):
        loaded = _load_public(path, hidden_size, vocab_size)
    else:
        raise _no_heads(path)
    heads = loaded.heads
    if heads.hidden_size != hidden_size:
        raise ValueError(f"medusa heads in {str(path)!r} have hidden size {heads.hidden_size} but the target has "
                         f"{hidden_size}: they were trained for another model")
    if heads.vocab_size != vocab_size:
        raise ValueError(f"medusa heads in {str(path)!r} have vocab_size {heads.vocab_size} but the target has "
                         f"{vocab_size}: they were trained for another model")
    if loaded.layout == "specserve":
        recorded = loaded.config["target"]
        if model_type is not None and recorded.get("model_type") not in (None, model_type):
            raise ValueError(f"medusa heads in {str(path)!r} were trained for a {recorded.get('model_type')} model, "
                             f"the target is {model_type}")
        if target_dir is not None:
            _check_target(recorded, target_dir, path)
    return loaded


def _load_ours(path: Path) -> LoadedHeads:
    config = _read_json(path / CONFIG_FILE, "medusa config")
    if config.get("format") != FORMAT:
        raise ValueError(f"{str(path / CONFIG_FILE)!r} is not a specserve Medusa config (format {config.get('format')!r})")
    if config.get("version") not in VERSIONS:
        raise ValueError(f"{str(path / CONFIG_FILE)!r} has version {config.get('version')!r}; this specserve reads "
                         f"versions {', '.join(map(str, VERSIONS))}")
    root_token = config.get("root_token", False)
    if root_token not in (False, True) or (root_token and config["version"] < 2):
        raise ValueError(f"{str(path / CONFIG_FILE)!r}: root_token must be true or false, and true only from version 2")
    parent_token = config.get("parent_token", False)
    if parent_token not in (False, True) or (parent_token and (config["version"] < 3 or not root_token)):
        raise ValueError(f"{str(path / CONFIG_FILE)!r}: parent_token must be true or false, and true only in version 3 "
                         "heads that read the root token")
    try:
        heads = MedusaHeads(config["hidden_size"], config["vocab_size"], config["num_heads"], config["num_layers"],
                            config["lm_head"], config.get("draft_vocab_size"), root_token, parent_token)
        if not isinstance(config["target"], dict):
            raise TypeError("target must be an object")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{str(path / CONFIG_FILE)!r} is incomplete or malformed: {exc}") from exc
    state = _read_safetensors(path / WEIGHTS_FILE)
    expected = {name: tuple(p.shape) for name, p in heads.named_parameters()}
    if heads.draft_to_target is not None:
        expected["draft_to_target"] = tuple(heads.draft_to_target.shape)
    check_shapes(path / WEIGHTS_FILE, {k: tuple(v.shape) for k, v in state.items()}, expected)
    draft_ids = state.pop("draft_to_target", None)
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise ValueError(f"medusa weights in {str(path / WEIGHTS_FILE)!r}: {name!r} is not a floating-point tensor")
    heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if draft_ids is not None:
        if draft_ids.is_floating_point() or draft_ids.dtype == torch.bool:
            raise ValueError(f"medusa weights in {str(path / WEIGHTS_FILE)!r}: draft_to_target must hold integer token ids, "
                             f"not {draft_ids.dtype}")
        try:
            heads.set_draft_vocab(draft_ids)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"medusa weights in {str(path / WEIGHTS_FILE)!r}: {exc}") from None
    return LoadedHeads(heads, config, "specserve")


def _load_public(path: Path, hidden_size: int, vocab_size: int) -> LoadedHeads:
    """hidden_size/vocab_size: the target's, for what the files do not fix (a shared LM head)."""
    files = inspect_public(path)
    hidden = files.hidden if files.hidden is not None else hidden_size
    vocab = files.vocab if files.vocab is not None else vocab_size
    num_heads, num_layers = files.num_heads, files.num_layers
    expected = files.expected(hidden, vocab)
    check_shapes(files.where, files.shapes, expected)
    state = files.read(sorted(expected))
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise ValueError(f"medusa weights in {str(files.where)!r}: {name!r} is not a floating-point tensor")
    heads = MedusaHeads(int(hidden), int(vocab), num_heads, num_layers, files.lm_head)
    with torch.no_grad():
        for k in range(num_heads):
            # Upstream builds a head's blocks as ``[ResBlock(H)] * L``: ONE module applied L times, so its
            # files hold L equal copies; applying each stored block in turn is that same function, and
            # also right for trainers whose blocks are distinct.
            for layer in range(num_layers):
                heads.weight[k, layer] = state[f"{k}.{layer}.linear.weight"].float()
                heads.bias[k, layer] = state[f"{k}.{layer}.linear.bias"].float()
            if heads.lm_heads is not None:
                heads.lm_heads[k] = state[f"{k}.{num_layers}.weight"].float()
    return LoadedHeads(heads, files.config, "medusa", files.label)


def has_heads(path: str | Path) -> bool:
    """Whether ``path`` holds Medusa heads in any layout (our config, a public Medusa config.json)."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return True
    try:
        return "medusa_num_heads" in _read_json(path / PUBLIC_CONFIG, "Medusa config")
    except ValueError:
        return False


def _no_heads(path: Path) -> ValueError:
    try:
        config = _read_json(path / PUBLIC_CONFIG)
    except ValueError:
        config = {}
    if config.get("model_type") == "medusa":
        # vLLM's own layout (blocks.{k}.layers.{l}, lm_heads.{k}, optional token_map), converted from
        # FasterDecoding's by a script; its options (bias-free blocks, one shared original_lm_head, a
        # truncated vocabulary) are not read here, so it is refused rather than half-read.
        return ValueError(f"{str(path / PUBLIC_CONFIG)!r} is vLLM's converted Medusa layout (model_type 'medusa'), "
                          "which specserve does not read: use the FasterDecoding heads it was converted from")
    return ValueError(f"{str(path)!r} holds no Medusa heads: expected {CONFIG_FILE} (specserve train medusa) or a "
                      f"{PUBLIC_CONFIG} with medusa_num_heads and {PUBLIC_WEIGHTS[0]} (FasterDecoding/Medusa)")


# ---- describing -----------------------------------------------------------------------------------


def describe_heads(path: str | Path, target: str | Path | None = None) -> dict[str, str]:
    """What a Medusa heads directory holds, for ``specserve info --drafter medusa:PATH``, read from its
    config and tensor names and shapes only: format and version, heads (used / in the file), layers per
    head, LM head (own per head, or the target's), hidden size and vocabulary, and — with ``target`` (a
    model directory, or anything with a ``model_dir``) — whether they fit it. ValueError as `load_heads`."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"medusa heads directory {str(path)!r} does not exist")
    target_dir = getattr(target, "model_dir", target)
    target_cfg = None
    if target_dir is not None:
        from specserve.drafters.eagle_checkpoint import target_config

        target_cfg = target_config(target_dir)  # a model directory's config.json, or a GGUF file's metadata
    if (path / CONFIG_FILE).is_file():
        config = _read_json(path / CONFIG_FILE, "medusa config")
        recorded = config.get("target") if isinstance(config.get("target"), dict) else {}
        mode = config.get("lm_head")
        out = {"format": f"specserve Medusa heads ({CONFIG_FILE})", "version": str(config.get("version")),
               "weights": str(path / WEIGHTS_FILE), "heads": str(config.get("num_heads")), "layers per head": str(config.get("num_layers")),
               "lm head": "own, one per head" if mode == "own" else "shared: the target's",
               "reads": ("the final feature, the root token's and each node's parent's embedding"
                         if config.get("parent_token") else "the final feature and the root token's embedding"
                         if config.get("root_token") else "the final feature"),
               "hidden size": str(config.get("hidden_size")), "vocabulary": str(config.get("vocab_size")),
               "trained for": str(recorded.get("path"))}
        if config.get("draft_vocab_size") is not None:
            out["draft vocabulary"] = f"{config['draft_vocab_size']} most frequent target tokens"
        hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    elif has_heads(path):
        files = inspect_public(path)
        fallback = target_cfg or {}
        check_shapes(files.where, files.shapes, files.expected(files.hidden or fallback.get("hidden_size") or 0,
                                                              files.vocab or fallback.get("vocab_size") or 0))
        heads = str(files.num_heads) + (f" (the file holds {files.file_heads}; the config uses the first "
                                         f"{files.num_heads})" if files.file_heads > files.num_heads else "")
        hidden, vocab = files.hidden, files.vocab
        out = {"format": files.label, "version": files.version or "none (Medusa-1 configs carry none)",
               "weights": str(files.where), "heads": heads, "layers per head": str(files.num_layers),
               "lm head": ("own, one per head, in the heads file" if files.lm_head == "own" and not files.joint
                           else "own, one per head, in the model shards" if files.lm_head == "own"
                           else "shared: the target's own LM head (not stored with the heads)"),
               "hidden size": str(hidden) if hidden is not None else "the target's",
               "vocabulary": str(vocab) if vocab is not None else "the target's",
               "trained for": ("this directory's model (fine-tuned jointly with the heads)" if files.joint
                               else str(files.config.get("base_model_name_or_path") or "not recorded"))}
    else:
        raise _no_heads(path)
    if target_cfg is not None:
        for key, field in (("hidden size", "hidden_size"), ("vocabulary", "vocab_size")):
            if out[key] == "the target's":
                out[key] = f"{target_cfg.get(field)} (the target's)"
        problems = [f"{name} {mine} vs the target's {theirs}"
                    for name, mine, theirs in (("hidden size", hidden, target_cfg.get("hidden_size")),
                                               ("vocabulary", vocab, target_cfg.get("vocab_size")))
                    if mine is not None and mine != theirs]
        out["fits the target"] = "yes" if not problems else "no: " + "; ".join(problems)
    return out


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"medusa weights {str(path)!r} are missing")
    return read_safetensors(path)
