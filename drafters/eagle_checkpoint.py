"""EAGLE head checkpoints: our format, the public EAGLE-1/2 and EAGLE-3 layouts, target fingerprints.

Files: our format is ``eagle_config.json`` (mode, feature layers, draft vocabulary size, the head
layer's Llama-style config, and the target it was trained for: hidden size, vocabulary, layers,
model type, config and tokenizer fingerprints) + ``eagle_head.safetensors`` (this module's
state dict). The public layouts load too: EAGLE-1/2 (``config.json`` + ``pytorch_model.bin`` or
``model.safetensors`` with ``fc.weight``, ``fc.bias``, ``layers.0.self_attn.q_proj.weight``, ...)
and EAGLE-3 (``midlayer.*``, ``fc.weight`` [H, 3H], ``norm.weight``, ``lm_head.weight`` [Vd, H],
``d2t`` — target id minus draft id — and ``t2d``; ``draft_vocab_size`` in config.json).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from specserve.drafters.checkpoint_io import read_json as _read_json
from specserve.drafters.checkpoint_io import read_safetensors as _read_safetensors
from specserve.drafters.eagle_head import (CONFIG_FILE, FORMAT_VERSION, MODES, WEIGHTS_FILE, EagleHead, EagleHeadConfig,
                                           default_feature_layers)

# Fields an fp16 re-export or another transformers version changes without changing the model.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "torch_dtype", "dtype", "_name_or_path")


def new_head_config(target_dir: str | Path, mode: str, draft_vocab_size: int | None = None,
                    feature_layers: tuple[int, ...] | None = None) -> EagleHeadConfig:
    """The config of a fresh head for the target in ``target_dir``: the target's layer shape and RoPE,
    its identity (sizes, model type, fingerprints), EAGLE's feature layers unless given."""
    target_dir = Path(target_dir)
    raw = _read_json(target_dir / "config.json")
    try:
        num_layers, vocab, hidden = int(raw["num_hidden_layers"]), int(raw["vocab_size"]), int(raw["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{str(target_dir / 'config.json')!r} is not a Llama-family config: {exc}") from exc
    layer = {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
                                 "rope_parameters") if raw.get(k) is not None}
    target = {"hidden_size": hidden, "vocab_size": vocab, "num_layers": num_layers, "model_type": raw.get("model_type"),
              **target_fingerprint(target_dir)}
    if mode not in MODES:
        raise ValueError(f"EAGLE head mode must be one of {MODES}, got {mode!r}")
    if mode == "eagle1":
        draft_vocab_size = vocab
    return EagleHeadConfig(mode=mode, layer=layer, vocab_size=vocab, draft_vocab_size=draft_vocab_size or vocab,
                           feature_layers=tuple(feature_layers or default_feature_layers(mode, num_layers)),
                           fc_bias=mode == "eagle1", input_norm=False, target=target)

# ---- fingerprints ---------------------------------------------------------------------------------


def target_fingerprint(model_dir: str | Path | None) -> dict:
    """``config_sha256`` (of config.json's content, without export-only fields such as dtype) and
    ``tokenizer`` (training/tokenizer.py's fingerprint) of a target directory; None where absent."""
    out: dict[str, Any] = {"config_sha256": None, "tokenizer": None}
    if model_dir is None:
        return out
    model_dir = Path(model_dir)
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
        from specserve.training.tokenizer import tokenizer_fingerprint

        try:
            out["tokenizer"] = tokenizer_fingerprint(model_dir)
        except (OSError, ValueError):
            pass
    return out


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


def load_head(path: str | Path, target, device: torch.device | None = None, dtype: torch.dtype | None = None) -> EagleHead:
    """Load a head (our format or a public EAGLE-1/2/3 layout) for ``target`` (a `TargetInfo` whose
    ``model`` is the target `LlamaModel`). ValueError when it was made for another target."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"EAGLE head directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"EAGLE head path {str(path)!r} is not a directory")
    if (path / CONFIG_FILE).is_file():
        cfg, state = _read_ours(path)
    elif (path / "config.json").is_file():
        cfg, state = _read_public(path, target)
    else:
        raise FileNotFoundError(f"{str(path)!r} holds no EAGLE head: expected {CONFIG_FILE} + {WEIGHTS_FILE} "
                                "(specserve train eagle) or a public EAGLE layout (config.json + weights)")
    _check_target(cfg, target, path)
    model = target.model
    if model is None:
        raise ValueError("an EAGLE head needs the target model (TargetInfo.model) for its embeddings")
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
        head.use_cpu_kernels(model.kernels)
    return head


def _read_ours(path: Path) -> tuple[EagleHeadConfig, dict]:
    raw = _read_json(path / CONFIG_FILE)
    if raw.get("kind") != "eagle_head":
        raise ValueError(f"{str(path / CONFIG_FILE)!r} is not an EAGLE head config (kind={raw.get('kind')!r})")
    if raw.get("format") not in (1, FORMAT_VERSION):
        raise ValueError(f"{str(path / CONFIG_FILE)!r} has format {raw.get('format')!r}; this specserve reads 1 and "
                         f"{FORMAT_VERSION}")
    try:
        cfg = EagleHeadConfig(mode=raw["mode"], layer=dict(raw["layer"]), vocab_size=int(raw["vocab_size"]),
                              draft_vocab_size=int(raw["draft_vocab_size"]),
                              feature_layers=tuple(int(x) for x in raw["feature_layers"]),
                              fc_bias=bool(raw.get("fc_bias", True)), input_norm=bool(raw.get("input_norm", False)),
                              target=dict(raw.get("target", {})))
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


# ---- public layouts ---------------------------------------------------------------------------------

_PUBLIC_LAYER = {  # our name: (public names concatenated in order)
    "layer.qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "layer.o_proj": ("self_attn.o_proj.weight",),
    "layer.post_attn_norm": ("post_attention_layernorm.weight",),
    "layer.gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "layer.down": ("mlp.down_proj.weight",),
}


def _read_public_weights(path: Path) -> dict[str, torch.Tensor]:
    for name in ("model.safetensors", "pytorch_model.safetensors"):
        if (path / name).is_file():
            return _read_safetensors(path / name)
    if (path / "pytorch_model.bin").is_file():
        try:
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a truncated pickle
            raise ValueError(f"{str(path / 'pytorch_model.bin')!r} is not a readable torch checkpoint: {exc}") from exc
        if not isinstance(state, dict):
            raise ValueError(f"{str(path / 'pytorch_model.bin')!r} does not hold a state dict")
        return state
    raise FileNotFoundError(f"{str(path)!r} has a config.json but no EAGLE weights "
                            "(model.safetensors or pytorch_model.bin)")


def _read_public(path: Path, target) -> tuple[EagleHeadConfig, dict]:
    raw = _read_json(path / "config.json")
    state = _read_public_weights(path)
    eagle3 = any(k.startswith("midlayer.") for k in state)
    if not eagle3 and not any(k.startswith("layers.0.") for k in state):
        raise ValueError(f"{str(path)!r}: config.json + weights without 'midlayer.*' (EAGLE-3) or 'layers.0.*' "
                         "(EAGLE-1/2) tensors: not an EAGLE head")
    try:
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{str(path / 'config.json')!r} lacks hidden_size/vocab_size: {exc}") from exc
    if int(raw.get("num_hidden_layers", 1)) != 1 or any(k.startswith("layers.1.") for k in state):
        raise ValueError(f"{str(path)!r}: only one-layer EAGLE heads are supported (num_hidden_layers="
                         f"{raw.get('num_hidden_layers')})")
    if raw.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"{str(path)!r}: heads whose width differs from the target's (target_hidden_size="
                         f"{raw['target_hidden_size']}, hidden_size={hidden}) are not supported")
    ours: dict[str, torch.Tensor] = {}
    prefix = "midlayer." if eagle3 else "layers.0."
    used = {"embed_tokens.weight"}  # the target's own embeddings: ignored

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"EAGLE head in {str(path)!r} is missing tensor {name!r}")
        used.add(name)
        return state[name]

    for our, names in _PUBLIC_LAYER.items():
        ours[our] = torch.cat([take(prefix + n) for n in names])
    ours["fc"] = take("fc.weight")
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    if eagle3:
        ours["input_norm"] = take(prefix + "input_layernorm.weight")
        ours["hidden_norm"] = take(prefix + "hidden_norm.weight")
        ours["norm"] = take("norm.weight")
        ours["lm_head"] = take("lm_head.weight")
        draft_vocab = int(raw.get("draft_vocab_size") or ours["lm_head"].shape[0])
        if "d2t" in state:
            d2t = take("d2t").long()
            if d2t.shape != (draft_vocab,):
                raise ValueError(f"EAGLE-3 head in {str(path)!r}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
            ours["draft_to_target"] = torch.arange(draft_vocab) + d2t
            if "t2d" in state:
                t2d = take("t2d").bool()
                if t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab or not bool(t2d[ours["draft_to_target"].clamp(0, vocab - 1)].all()):
                    raise ValueError(f"EAGLE-3 head in {str(path)!r}: t2d does not agree with d2t")
        elif draft_vocab == vocab:
            ours["draft_to_target"] = torch.arange(vocab)
        else:
            raise ValueError(f"EAGLE-3 head in {str(path)!r} has a reduced draft vocabulary but no d2t map")
        num_layers = target.num_layers
        feature_layers = tuple(int(x) for x in layers) if layers else default_feature_layers("eagle3", num_layers)
        fc_bias, input_norm = False, True
        if "fc.bias" in state:
            raise ValueError(f"EAGLE-3 head in {str(path)!r} has fc.bias: EAGLE-3's fc has none")
    else:
        draft_vocab = vocab
        fc_bias = "fc.bias" in state
        if fc_bias:
            ours["fc_bias"] = take("fc.bias")
        input_norm = prefix + "input_layernorm.weight" in state
        if input_norm:
            ours["layer.input_norm"] = take(prefix + "input_layernorm.weight")
        ours["draft_to_target"] = torch.arange(vocab)
        feature_layers = (target.num_layers,)
    unexpected = sorted(k for k in state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"EAGLE head in {str(path)!r} has tensors this layout does not have: {unexpected[:5]}")
    layer = {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
                                 "rope_parameters") if raw.get(k) is not None}
    cfg = EagleHeadConfig(mode="eagle3" if eagle3 else "eagle1", layer=layer, vocab_size=vocab,
                          draft_vocab_size=draft_vocab, feature_layers=feature_layers, fc_bias=fc_bias,
                          input_norm=input_norm, target={"hidden_size": hidden, "vocab_size": vocab})
    return cfg, ours


def _check_target(cfg: EagleHeadConfig, target, path: Path) -> None:
    """A head for another target is a ValueError naming what differs."""
    want = cfg.target
    have = {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "num_layers": target.num_layers}
    model = getattr(target, "model", None)
    if model is not None:
        have["model_type"] = model.config.model_type
    have.update(target_fingerprint(target.model_dir))
    have_hidden = cfg.model_config.hidden_size
    problems = []
    if have_hidden != target.hidden_size:
        problems.append(f"hidden size {have_hidden} vs the target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} vs the target's {target.vocab_size}")
    for key in ("num_layers", "model_type", "config_sha256", "tokenizer"):
        if want.get(key) is not None and have.get(key) is not None and want[key] != have[key]:
            problems.append(f"{key} {want[key]!r} vs the target's {have[key]!r}")
    bad_layers = [layer for layer in cfg.feature_layers if not 0 <= layer <= target.num_layers]
    if bad_layers:
        problems.append(f"feature layers {bad_layers} outside the target's 0..{target.num_layers}")
    if problems:
        raise ValueError(f"EAGLE head {str(path)!r} was made for another target: " + "; ".join(problems))
