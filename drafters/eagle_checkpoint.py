"""EAGLE head checkpoints: our format, loading any head for a target, describing it, target fingerprints.

Our format is ``eagle_config.json`` (mode, feature layers, draft vocabulary size, the head layers'
Llama-style config and switches — layers, biases, norm order, own embeddings — and the target it was
trained for: hidden size, vocabulary, layers, model type, config and tokenizer fingerprints) +
``eagle_head.safetensors`` (the `EagleHead` state dict). The public layouts (SafeAILab EAGLE-1/2/3,
SpecForge, speculators) are read by `eagle_public`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from specserve.drafters.checkpoint_io import read_json as _read_json
from specserve.drafters.checkpoint_io import read_safetensors as _read_safetensors
from specserve.drafters.eagle_head import (CONFIG_FILE, FORMAT_VERSION, MODES, WEIGHTS_FILE, EagleHead, EagleHeadConfig,
                                           default_feature_layers)
from specserve.drafters.eagle_public import read_public

# Fields an fp16 re-export or another transformers version changes without changing the model.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "torch_dtype", "dtype", "_name_or_path")


def new_head_config(target: str | Path, mode: str, draft_vocab_size: int | None = None,
                    feature_layers: tuple[int, ...] | None = None) -> EagleHeadConfig:
    """The config of a fresh head for ``target`` (a model directory or a GGUF file): the target's layer
    shape and RoPE, its identity (sizes, model type, fingerprints), EAGLE's feature layers unless given."""
    raw = target_config(target)
    try:
        num_layers, vocab, hidden = int(raw["num_hidden_layers"]), int(raw["vocab_size"]), int(raw["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{str(target)!r} has no Llama-family config: {exc}") from exc
    layer = {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
                                 "rope_parameters") if raw.get(k) is not None}
    target_record = {"hidden_size": hidden, "vocab_size": vocab, "num_layers": num_layers,
                     "model_type": raw.get("model_type"), **target_fingerprint(target)}
    if mode not in MODES:
        raise ValueError(f"EAGLE head mode must be one of {MODES}, got {mode!r}")
    if mode == "eagle1":
        draft_vocab_size = vocab
    return EagleHeadConfig(mode=mode, layer=layer, vocab_size=vocab, draft_vocab_size=draft_vocab_size or vocab,
                           feature_layers=tuple(feature_layers or default_feature_layers(mode, num_layers)),
                           fc_bias=mode == "eagle1", input_norm=False, target=target_record)


def target_config(target: str | Path) -> dict:
    """A target's Hugging Face config as a dict: a directory's config.json, or a GGUF file's metadata."""
    path = Path(target)
    if path.is_file():
        from specserve.loading.gguf_file import GGUFFile

        hf = GGUFFile(path).hf_config
        return hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    return _read_json(path / "config.json")

# ---- fingerprints ---------------------------------------------------------------------------------


def target_fingerprint(model_dir: str | Path | None) -> dict:
    """What identifies a target, None where absent: for a directory ``config_sha256`` (of config.json's content,
    without export-only fields such as dtype) and ``tokenizer`` (training/tokenizer.py's fingerprint); for a GGUF
    file ``file_sha256``, the file's own (its weights are what a head was trained on), and its tokenizer's."""
    out: dict[str, Any] = {"config_sha256": None, "tokenizer": None}
    if model_dir is None:
        return out
    model_dir = Path(model_dir)
    if model_dir.is_file():
        from specserve.loading.gguf_file import GGUFFile

        out["file_sha256"] = file_sha256(model_dir)
        gguf = GGUFFile(model_dir)
        tokenizer_dir = gguf.tokenizer_dir() or (gguf.tokenizer() is not None and gguf.tokenizer_dir())
        if tokenizer_dir:
            out["tokenizer"] = target_fingerprint(tokenizer_dir)["tokenizer"]
        return out
    config = model_dir / "config.json"
    if config.is_file():
        try:
            raw = json.loads(config.read_text())
        except (OSError, ValueError):
            raw = None
        if isinstance(raw, dict):
            canon = {k: v for k, v in raw.items() if k not in _VOLATILE_CONFIG_KEYS}
            out["config_sha256"] = hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()
    if (model_dir / "tokenizer.json").is_file():
        from specserve.tokenizer_fingerprint import tokenizer_fingerprint

        try:
            out["tokenizer"] = tokenizer_fingerprint(model_dir)
        except (OSError, ValueError):
            pass
    return out


def fingerprint_mismatch(recorded: dict, target: str | Path | None,
                         keys: tuple[str, ...] = ("file_sha256", "config_sha256", "tokenizer")) -> str | None:
    """The first of ``keys`` that ``recorded`` (a `target_fingerprint` saved with data or a drafter) names and
    ``target``'s own fingerprint does not match; None when every recorded one matches."""
    have = target_fingerprint(target)
    return next((k for k in keys if recorded.get(k) is not None and recorded.get(k) != have.get(k)), None)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, hashed once per process for a given (path, size, mtime): every head load checks it."""
    path = Path(path).resolve()
    stat = path.stat()
    return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    from specserve.loading.default_model import sha256_of

    return sha256_of(Path(path))


# ---- our format -------------------------------------------------------------------------------------


def save_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``eagle_config.json`` + ``eagle_head.safetensors`` (in ``dtype``, default the head's)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in head.state_dict().items():
        t = t.detach().cpu().contiguous()
        state[name] = t.to(dtype) if (dtype is not None and t.is_floating_point()) else t
    tmp = out_dir / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / WEIGHTS_FILE)
    config = {"format": FORMAT_VERSION, "kind": "eagle_head", **head.cfg.to_dict()}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


def read_head(path: str | Path, target_num_layers: int) -> tuple[EagleHeadConfig, dict[str, torch.Tensor]]:
    """The config and tensors (our names) of the head in ``path``, our format or a public layout;
    ``target_num_layers`` places default feature layers. Nothing is compared with a target here."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"EAGLE head directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"EAGLE head path {str(path)!r} is not a directory")
    if (path / CONFIG_FILE).is_file():
        return _read_ours(path)
    if (path / "config.json").is_file():
        return read_public(path, target_num_layers)
    raise FileNotFoundError(f"{str(path)!r} holds no EAGLE head: expected {CONFIG_FILE} + {WEIGHTS_FILE} "
                            "(specserve train eagle) or a public EAGLE layout (config.json + weights)")


def load_head(path: str | Path, target, device: torch.device | None = None, dtype: torch.dtype | None = None,
              storage: str | None = None) -> EagleHead:
    """Load a head (our format or a public EAGLE-1/2/3 layout) for ``target`` (a `TargetInfo` whose
    ``model`` is the target `LlamaModel`). ValueError when it was made for another target. What was
    detected is on ``head.cfg.source``."""
    path = Path(path).expanduser()
    cfg, state = read_head(path, target.num_layers)
    _check_target(cfg, target, path)
    model = target.model
    if model is None:
        raise ValueError("an EAGLE head needs the target model (TargetInfo.model) for its embeddings")
    cfg, state = _shared_or_own(cfg, state, model.embed, model.lm_head, path)
    device = device or target.device
    dtype = dtype or target.dtype
    head = EagleHead(cfg, model.embed, model.lm_head if cfg.mode == "eagle1" else None, device, dtype,
                     attention=model.backend.name)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"EAGLE head in {str(path)!r} does not match its config: missing {missing}, unexpected {unexpected}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"EAGLE head in {str(path)!r}: tensor {name!r} has shape {tuple(state[name].shape)}, "
                             f"its config implies {shape}")
    d2t = state["draft_to_target"]
    if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= cfg.vocab_size or d2t.unique().numel() != d2t.numel()):
        raise ValueError(f"EAGLE head in {str(path)!r}: its draft→target vocabulary map is not a set of distinct target ids")
    with torch.no_grad():
        for name, tensor in head.state_dict().items():
            tensor.copy_(state[name].to(tensor.dtype))
    head.requires_grad_(False)
    if model.kernels is not None:
        head.use_cpu_kernels(model.kernels, storage)
    return head


def _same_table(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two [V, H] tables are one table up to export rounding (an fp16 or bf16 copy)."""
    if a.shape != b.shape:
        return False
    scale = float(b.detach().abs().max().float().clamp(min=1e-30))
    for start in range(0, a.shape[0], 8192):  # in row blocks: no fp32 copy of a whole large table
        x = a[start : start + 8192].detach().float().cpu()
        y = b[start : start + 8192].detach().float().cpu()
        if not torch.allclose(x, y, rtol=1e-2, atol=1e-2 * scale):
            return False
    return True


def _shared_or_own(cfg: EagleHeadConfig, state: dict, target_embed: torch.Tensor | None,
                   target_lm_head: torch.Tensor | None, path: Path) -> tuple[EagleHeadConfig, dict]:
    """Decide the head's embeddings: its own ``embed_tokens`` when the files carry a table that differs
    from the target's (a copy of the target's is dropped: sharing saves V x H); record the choice."""
    state = dict(state)
    source = dict(cfg.source)
    own = state.get("embed_tokens") if cfg.own_embed else state.pop("embed_tokens", None)
    hidden = cfg.model_config.hidden_size
    if own is not None and tuple(own.shape) != (cfg.vocab_size, hidden):
        raise ValueError(f"EAGLE head in {str(path)!r}: embed_tokens.weight has shape {tuple(own.shape)}, expected "
                         f"[{cfg.vocab_size}, {hidden}]")
    if cfg.own_embed:
        source["embedding"] = "the head's own (saved with it)"
    elif own is None:
        source["embedding"] = "the target's (the head has none)"
    elif target_embed is None:
        source["embedding"] = "the head's own embed_tokens.weight (not compared: no target weights)"
    elif _same_table(own, target_embed):
        source["embedding"] = "the target's (the head's embed_tokens.weight is a copy of it)"
    else:
        cfg = replace(cfg, own_embed=True)
        state["embed_tokens"] = own
        source["embedding"] = "the head's own embed_tokens.weight (differs from the target's)"
    lm_head = state.pop("target_lm_head", None)  # an EAGLE-1 file's lm_head.weight: must be the target's
    if lm_head is not None and target_lm_head is not None and not _same_table(lm_head, target_lm_head):
        raise ValueError(f"EAGLE-1 head in {str(path)!r}: lm_head.weight differs from the target's LM head; EAGLE-1/2 "
                         "heads draft through the target's own LM head (supported: no lm_head.weight, or the target's)")
    return replace(cfg, source={**source, **summary(cfg)}), state


def summary(cfg: EagleHeadConfig) -> dict[str, str]:
    """What a head is, in words (for `describe_head` and ``EagleHeadConfig.source``)."""
    mc = cfg.model_config
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    biases = [name for name, on in (("q/k/v", cfg.qkv_bias), ("o_proj", cfg.o_bias),
                                    ("fc", cfg.fc_bias and cfg.mode == "eagle1")) if on]
    out = {"mode": "EAGLE-3 (fused target features, own LM head)" if cfg.mode == "eagle3"
           else "EAGLE-1/2 (the target's last feature, the target's LM head)",
           "layers": str(cfg.num_layers), "hidden size": str(mc.hidden_size),
           "vocabulary": f"reduced: {vd} of {v} target tokens (d2t map)" if vd < v else f"full ({v} tokens)",
           "feature layers": ", ".join(str(x) for x in cfg.feature_layers) + " (transformers hidden_states index)",
           "biases": ", ".join(biases) if biases else "none",
           "q/k norms": "yes (Qwen3)" if cfg.qk_norm else "no"}
    if cfg.mode == "eagle3":
        out["norm order"] = ("norm before residual: the residual is hidden_norm(feature)" if cfg.norm_before_residual
                             else "the residual is the raw feature (EAGLE-3's own)")
    return out


def _read_ours(path: Path) -> tuple[EagleHeadConfig, dict]:
    raw = _read_json(path / CONFIG_FILE)
    if raw.get("kind") != "eagle_head":
        raise ValueError(f"{str(path / CONFIG_FILE)!r} is not an EAGLE head config (kind={raw.get('kind')!r})")
    if raw.get("format") not in (1, FORMAT_VERSION):
        raise ValueError(f"{str(path / CONFIG_FILE)!r} has format {raw.get('format')!r}; this specserve reads 1 and "
                         f"{FORMAT_VERSION}")
    try:
        # Fields added after format 2 appeared default to what heads before them were.
        cfg = EagleHeadConfig(mode=raw["mode"], layer=dict(raw["layer"]), vocab_size=int(raw["vocab_size"]),
                              draft_vocab_size=int(raw["draft_vocab_size"]),
                              feature_layers=tuple(int(x) for x in raw["feature_layers"]),
                              fc_bias=bool(raw.get("fc_bias", True)), input_norm=bool(raw.get("input_norm", False)),
                              target=dict(raw.get("target", {})), num_layers=int(raw.get("num_layers", 1)),
                              norm_before_residual=bool(raw.get("norm_before_residual", False)),
                              qkv_bias=bool(raw.get("qkv_bias", False)), o_bias=bool(raw.get("o_bias", False)),
                              qk_norm=bool(raw.get("qk_norm", False)), own_embed=bool(raw.get("own_embed", False)),
                              source={"format": f"specserve EAGLE head ({CONFIG_FILE})", "version": str(raw["format"]),
                                      "weights": WEIGHTS_FILE})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{str(path / CONFIG_FILE)!r} is missing or mistypes a field: {exc}") from exc
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{str(weights)!r} not found: the head's weights are missing")
    state = _read_safetensors(weights)
    if raw["format"] == 1:  # format 1 kept the layer's tensors at the top level, under older names
        renamed = dict(_FORMAT1_LAYER, **({"input_norm": "layer.input_norm"} if cfg.mode == "eagle1" else {}))
        state = {renamed.get(k, k): v for k, v in state.items()}
    return cfg, state


_FORMAT1_LAYER = {"qkv": "layer.qkv", "o_proj": "layer.o_proj", "post_norm": "layer.post_attn_norm",
                  "gate_up": "layer.gate_up", "down": "layer.down"}


def _check_target(cfg: EagleHeadConfig, target, path: Path) -> None:
    """A head for another target is a ValueError naming what differs."""
    want = cfg.target
    have = {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "num_layers": target.num_layers}
    model = getattr(target, "model", None)
    if model is not None:
        have["model_type"] = model.config.model_type
    have.update(target_fingerprint(target.model_dir))
    tokenizer_dir = getattr(target, "tokenizer_dir", None)
    if have.get("tokenizer") is None and tokenizer_dir:  # a GGUF target: its converted tokenizer
        have["tokenizer"] = target_fingerprint(tokenizer_dir)["tokenizer"]
    have_hidden = cfg.model_config.hidden_size
    problems = []
    if have_hidden != target.hidden_size:
        problems.append(f"hidden size {have_hidden} vs the target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} vs the target's {target.vocab_size}")
    # The same GGUF file holds the same tokenizer, so its tokenizer fingerprint is not compared: the fingerprint
    # hashes the converted tokenizer.json, which differs between transformers versions (a head trained beside
    # 5.17 read another fingerprint under 5.25).
    same_file = want.get("file_sha256") is not None and want.get("file_sha256") == have.get("file_sha256")
    for key in ("num_layers", "model_type", "config_sha256", "file_sha256") + (() if same_file else ("tokenizer",)):
        if want.get(key) is not None and have.get(key) is not None and want[key] != have[key]:
            problems.append(f"{key} {want[key]!r} vs the target's {have[key]!r}")
    bad_layers = [layer for layer in cfg.feature_layers if not 0 <= layer <= target.num_layers]
    if bad_layers:
        problems.append(f"feature layers {bad_layers} outside the target's 0..{target.num_layers}")
    if problems:
        raise ValueError(f"EAGLE head {str(path)!r} was made for another target: " + "; ".join(problems))


# ---- describing a head ------------------------------------------------------------------------------


def describe_head(path: str | Path, target) -> dict[str, str]:
    """What an EAGLE head directory holds and how it would run, for ``specserve info --drafter
    eagle:PATH``: format and version, layers, vocabulary mapping, feature layers, embeddings used,
    norm order, biases, and whether it fits ``target`` — a `TargetInfo` with its model (the head is
    loaded as serving would) or a target model directory (read from its files only). ValueError and
    FileNotFoundError as `load_head`."""
    if getattr(target, "model", None) is not None:
        head = load_head(path, target)
        return {**{k: str(v) for k, v in head.cfg.source.items()}, "fits the target": "yes"}
    target_dir = Path(getattr(target, "model_dir", target)).expanduser()
    raw = _read_json(target_dir / "config.json", "target config")
    try:
        info = SimpleNamespace(hidden_size=int(raw["hidden_size"]), vocab_size=int(raw["vocab_size"]),
                               num_layers=int(raw["num_hidden_layers"]), model_dir=str(target_dir), model=None)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{str(target_dir / 'config.json')!r} is not a Llama-family config: {exc}") from exc
    path = Path(path).expanduser()
    cfg, state = read_head(path, info.num_layers)
    embed = _target_tensor(target_dir, "model.embed_tokens.weight")
    lm_head = embed if raw.get("tie_word_embeddings") else _target_tensor(target_dir, "lm_head.weight")
    cfg, _ = _shared_or_own(cfg, state, embed, lm_head, path)
    try:
        _check_target(cfg, info, path)
        fits = "yes"
    except ValueError as exc:
        fits = f"no: {exc}"
    return {**{k: str(v) for k, v in cfg.source.items()}, "fits the target": fits}


def _target_tensor(model_dir: Path, name: str) -> torch.Tensor | None:
    """One tensor of a target's safetensors files, read alone (None when it is not found there)."""
    from safetensors import safe_open

    files = [model_dir / "model.safetensors"]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shard = _read_json(index).get("weight_map", {}).get(name)
        files = [model_dir / shard] if isinstance(shard, str) else []
    for file in files:
        if file.is_file():
            with safe_open(str(file), "pt") as f:
                if name in f.keys():  # noqa: SIM118  (a safe_open handle is not a dict)
                    return f.get_tensor(name)
    return None
