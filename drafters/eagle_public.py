"""Public EAGLE head layouts read into our names: SafeAILab EAGLE-1/2 and EAGLE-3, SGLang SpecForge and
vLLM ``speculators`` exports, each detected from its files (never from a user flag).

Config (``config.json``), one of:

- flat, Llama/Qwen2-style (SafeAILab, SpecForge): ``hidden_size``, ``vocab_size`` (the target's),
  ``num_hidden_layers``, ``draft_vocab_size``, ``target_hidden_size``, ``qkv_bias`` (EAGLE's Qwen2
  heads) / ``attention_bias``, ``norm_before_residual``, SpecForge's ``eagle_config`` holding
  ``eagle_aux_hidden_state_layer_ids``;
- speculators: ``speculators_model_type`` ("eagle3" / "eagle"), the layer's config under
  ``transformer_layer_config`` (a transformers diff dict: omitted fields take its model type's
  defaults), ``draft_vocab_size`` (null: the full vocabulary), ``norm_before_residual``,
  ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``, ``speculators_version``.

Weights: ``model.safetensors``, ``pytorch_model.bin`` (SafeAILab's fp16 training saves) or a shard
index (``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``: weight_map → shard).

Tensors. EAGLE-3: ``fc.weight`` [H, kH] (k target layers, 3 in EAGLE-3); layer 0 under ``midlayer.*``
(SafeAILab, SpecForge) or ``layers.0.*`` (speculators and SpecForge exports) with
``input_layernorm`` (the embedding's norm) and ``hidden_norm``; ``layers.1..`` ordinary layers;
``norm.weight``, ``lm_head.weight`` [Vd, H], ``d2t`` (target id minus draft id), ``t2d`` (bool [V]);
optionally ``embed_tokens.weight``. EAGLE-1/2: ``fc.weight`` [H, 2H] (+ ``fc.bias``), ``layers.N.*``
(layer 0 without ``input_layernorm``), optionally ``embed_tokens.weight``; speculators' "eagle"
names them ``fusion_fc.*`` and ``transformer.*``.

Feature layers: ours are transformers' ``hidden_states`` indices. vLLM / speculators' top-level
``eagle_aux_hidden_state_layer_ids`` number the same way (id j = the input of target layer j);
SGLang / SpecForge's ``eagle_config`` ids name layer *outputs* (id j = index j + 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.drafters.checkpoint_io import read_json as _read_json
from specserve.drafters.checkpoint_io import read_safetensors as _read_safetensors
from specserve.drafters.eagle_head import EagleHeadConfig, default_feature_layers

_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters")
_LAYER_TYPES = ("llama", "qwen2", "qwen3")  # Mistral's sliding window is not run by the head: not listed
# speculators options whose math this head does not implement: refused rather than run wrong.
_UNSUPPORTED_TRUE = {"norm_before_fc": "a norm over the concatenated features before fc",
                     "fc_norm": "per-layer norms of the features before fc",
                     "norm_output": "normed outputs fed back across steps (Eagle 3.1)",
                     "layernorms": "HASS-style extra layer norms", "mlp_bias": "MLP biases"}


# ---- weight files ---------------------------------------------------------------------------------


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a truncated pickle
        raise ValueError(f"{str(file)!r} is not a readable torch checkpoint: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"{str(file)!r} does not hold a state dict")  # noqa: TRY004  (a bad file, not a bad argument)
    return state


def weight_files(path: Path) -> tuple[str, list[Path]]:
    """(how the weights are stored, the files holding them). FileNotFoundError when there are none."""
    for name in ("model.safetensors", "pytorch_model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return name, [path / name]
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / name
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{str(index)!r}: 'weight_map' must map tensor names to shard files")
            shards = [path / s for s in sorted(set(weight_map.values()))]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise FileNotFoundError(f"{str(index)!r}: weight_map names shard(s) {missing} that are missing")
            return f"{name} ({len(shards)} shards)", shards
    raise FileNotFoundError(f"{str(path)!r} has a config.json but no EAGLE weights (model.safetensors, "
                            "pytorch_model.bin or a *.index.json of shards)")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's weight file(s), shards merged (a name in two shards is an error)."""
    _, files = weight_files(path)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        part = _read_safetensors(file) if file.suffix == ".safetensors" else _load_bin(file)
        twice = sorted(set(part) & set(state))
        if twice:
            raise ValueError(f"{str(file)!r}: tensor(s) {twice[:3]} also appear in another shard")
        state.update(part)
    return state


# ---- config ---------------------------------------------------------------------------------------


def _full_layer_config(layer_raw: dict, where: str, field: str) -> tuple[str, dict]:
    """(model type, the layer's config with its model type's defaults filled in: speculators writes a
    transformers diff dict, so a field equal to the default is simply absent)."""
    from transformers import AutoConfig

    model_type = layer_raw.get("model_type") or "llama"
    if model_type not in _LAYER_TYPES:
        raise ValueError(f"{where}: {field}model_type {model_type!r} is not supported; supported: {_LAYER_TYPES}")
    kwargs = {k: v for k, v in layer_raw.items() if k not in ("model_type", "architectures", "auto_map")}
    try:
        full = AutoConfig.for_model(model_type, **kwargs).to_dict()
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{where}: {field or 'the config'} is not a valid {model_type} config: {exc}") from exc
    return model_type, full


def _aux_layer_ids(raw: dict, layer_raw: dict, where: str) -> tuple[tuple[int, ...] | None, str]:
    """(feature layers in our numbering or None, where they came from)."""
    top = raw.get("eagle_aux_hidden_state_layer_ids", layer_raw.get("eagle_aux_hidden_state_layer_ids"))
    nested = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    try:
        if top:
            return tuple(int(x) for x in top), "eagle_aux_hidden_state_layer_ids (vLLM numbering)"
        if nested.get("eagle_aux_hidden_state_layer_ids"):
            ids = nested["eagle_aux_hidden_state_layer_ids"]
            return tuple(int(x) + 1 for x in ids), "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang numbering, +1)"
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer ids: {exc}") from exc
    return None, "default"


# ---- tensors --------------------------------------------------------------------------------------


class _Taker:
    """Takes tensors by public name, remembering which were used (the rest are reported)."""

    def __init__(self, state: dict[str, torch.Tensor], path: Path) -> None:
        self.state, self.path, self.used = state, path, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"EAGLE head in {str(self.path)!r} is missing tensor {name!r}")
        self.used.add(name)
        return self.state[name]

    def maybe(self, name: str) -> torch.Tensor | None:
        return self(name) if name in self.state else None


def _layer(take: _Taker, prefix: str, ours: str, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> dict:
    """One decoder layer's public tensors (``prefix``) → our fused names (``ours``), input norm aside."""
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    out = {ours + "qkv": torch.cat([take(f"{attn}{n}_proj.weight") for n in "qkv"]),
           ours + "o_proj": take(attn + "o_proj.weight"),
           ours + "post_attn_norm": take(prefix + "post_attention_layernorm.weight"),
           ours + "gate_up": torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
           ours + "down": take(mlp + "down_proj.weight")}
    if qkv_bias:
        out[ours + "qkv_bias"] = torch.cat([take(f"{attn}{n}_proj.bias") for n in "qkv"])
    if o_bias:
        out[ours + "o_bias"] = take(attn + "o_proj.bias")
    if qk_norm:
        out[ours + "q_norm"], out[ours + "k_norm"] = take(attn + "q_norm.weight"), take(attn + "k_norm.weight")
    return out


def _count_layers(state: dict, prefix: str) -> int:
    ids = {int(k[len(prefix):].split(".", 1)[0]) for k in state
           if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0].isdigit()}
    return max(ids) + 1 if ids else 0


def read_public(path: Path, target_num_layers: int) -> tuple[EagleHeadConfig, dict[str, torch.Tensor]]:
    """A public head → (its config, its tensors under our names). The head's own embeddings, when the
    files have them, come back as ``embed_tokens`` (the loader decides whether to keep them)."""
    where = repr(str(path / "config.json"))
    raw = _read_json(path / "config.json")
    storage, _ = weight_files(path)
    state = read_weights(path)
    kind = raw.get("speculators_model_type")
    speculators = kind is not None
    if speculators and kind not in ("eagle3", "eagle"):
        raise ValueError(f"{where}: speculators_model_type {kind!r} is not an EAGLE head; supported: 'eagle3', 'eagle'")
    if speculators:
        layer_raw = raw.get("transformer_layer_config")
        if not isinstance(layer_raw, dict):
            raise ValueError(f"{where}: transformer_layer_config must be the layer's config (an object)")
        field = "transformer_layer_config."
    else:
        layer_raw, field = raw, ""
    for name, what in _UNSUPPORTED_TRUE.items():
        if raw.get(name) or layer_raw.get(name):
            raise ValueError(f"{where}: {name}=true ({what}) is not supported; supported: {name} false or absent")
    model_type, full = _full_layer_config(layer_raw, where, field)
    if full.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: {field}hidden_act={full['hidden_act']!r} is not supported; supported: 'silu'")
    try:
        hidden, vocab = int(full["hidden_size"]), int(full["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where} lacks {field}hidden_size/vocab_size: {exc}") from exc
    target_hidden = raw.get("target_hidden_size", layer_raw.get("target_hidden_size"))
    if target_hidden not in (None, hidden):
        raise ValueError(f"{where}: target_hidden_size={target_hidden} differs from {field}hidden_size={hidden}; "
                         "only heads as wide as their target are supported")

    # Which EAGLE: speculators says so; otherwise EAGLE-3's tell-tales (midlayer, hidden_norm, fc over
    # three target layers) — SpecForge and speculators exports name layer 0 ``layers.0`` like EAGLE-1.
    fc_name = "fusion_fc." if "fusion_fc.weight" in state else "fc."
    fc = state.get(fc_name + "weight")
    if fc is None:
        raise ValueError(f"{str(path)!r}: config.json + weights without 'fc.weight': not an EAGLE head")
    midlayer = any(k.startswith("midlayer.") for k in state)
    eagle3 = (kind == "eagle3" if speculators else
              midlayer or "layers.0.hidden_norm.weight" in state or fc.shape[-1] == 3 * hidden)
    if kind == "eagle" or fc_name == "fusion_fc.":
        first, later_prefix = "transformer.", None
    elif midlayer:
        first, later_prefix = "midlayer.", "layers."
    else:
        first, later_prefix = "layers.0.", "layers."
    if not any(k.startswith(first) for k in state):
        raise ValueError(f"{str(path)!r}: no {first}* tensors (the head's decoder layer): not an EAGLE head")
    in_files = 1 + (max(_count_layers(state, later_prefix) - 1, 0) if later_prefix else 0)
    num_layers = int(full.get("num_hidden_layers") or 1)
    if num_layers != in_files:
        raise ValueError(f"{where}: {field}num_hidden_layers={num_layers} but the weights hold {in_files} decoder "
                         "layer(s)")

    # Layer flavour: Qwen2 (q/k/v biases), Llama's attention_bias (q/k/v and o), Qwen3 (q/k norms).
    qkv_bias = bool(full.get("qkv_bias") or full.get("attention_bias") or model_type == "qwen2")
    o_bias = bool(full.get("attention_bias")) and model_type != "qwen2"
    qk_norm = model_type == "qwen3"
    take = _Taker(state, path)
    ours = _layer(take, first, "layer.", qkv_bias, o_bias, qk_norm)
    for i in range(1, num_layers):
        p = f"{later_prefix}{i}."
        ours.update(_layer(take, p, f"later.{i - 1}.", qkv_bias, o_bias, qk_norm))
        ours[f"later.{i - 1}.input_norm"] = take(p + "input_layernorm.weight")
    ours["fc"] = take(fc_name + "weight")
    embed = take.maybe("embed_tokens.weight")
    if embed is not None:
        ours["embed_tokens"] = embed
    aux, aux_from = _aux_layer_ids(raw, layer_raw, where)
    norm_before_residual = bool(raw.get("norm_before_residual", layer_raw.get("norm_before_residual", False)))
    if eagle3:
        ours["input_norm"] = take(first + "input_layernorm.weight")
        ours["hidden_norm"] = take(first + "hidden_norm.weight")
        ours["norm"] = take("norm.weight")
        ours["lm_head"] = take("lm_head.weight")
        draft_vocab, d2t = _vocab_map(raw, take, vocab, int(ours["lm_head"].shape[0]), where, path)
        ours["draft_to_target"] = d2t
        feature_layers = aux or default_feature_layers("eagle3", target_num_layers)
        if fc.shape[-1] != len(feature_layers) * hidden:
            raise ValueError(f"{where}: fc.weight reads {fc.shape[-1]} features = {fc.shape[-1] / hidden:g} x hidden "
                             f"but eagle_aux_hidden_state_layer_ids names {len(feature_layers)} layers")
        fc_bias, input_norm = False, True
        if (fc_name + "bias") in state:
            raise ValueError(f"EAGLE-3 head in {str(path)!r} has fc.bias: EAGLE-3's fc has none")
    else:
        if norm_before_residual:
            raise ValueError(f"{where}: norm_before_residual=true is an EAGLE-3 option; this is an EAGLE-1/2 head")
        draft_vocab = vocab
        fc_bias = (fc_name + "bias") in state
        if fc_bias:
            ours["fc_bias"] = take(fc_name + "bias")
        norm = take.maybe(first + "input_layernorm.weight")
        input_norm = norm is not None
        if input_norm:
            ours["layer.input_norm"] = norm
        ours["draft_to_target"] = torch.arange(vocab)
        feature_layers = (target_num_layers,)
        lm_head = take.maybe("lm_head.weight")  # EAGLE-1 drafts through the target's LM head
        if lm_head is not None:
            ours["target_lm_head"] = lm_head
    unexpected = sorted(k for k in state if k not in take.used and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"EAGLE head in {str(path)!r} has tensors this layout does not have: {unexpected[:5]}")
    version = "none (this layout carries no version)"
    if speculators:
        label = f"speculators {kind}"
        version = f"speculators_version {raw.get('speculators_version', 'not recorded')}"
    elif eagle3:
        label = ("EAGLE-3, midlayer.* layout (SafeAILab / SpecForge)" if midlayer
                 else "EAGLE-3, layers.N layout (SpecForge / speculators export)")
    else:
        label = "EAGLE-1/2 (SafeAILab)"
    source = {"format": label, "version": version, "config": "config.json", "weights": storage,
              "feature layers from": aux_from, "layer type": model_type}
    cfg = EagleHeadConfig(mode="eagle3" if eagle3 else "eagle1",
                          layer={k: full[k] for k in _LAYER_KEYS if full.get(k) is not None},
                          vocab_size=vocab, draft_vocab_size=draft_vocab, feature_layers=tuple(feature_layers),
                          fc_bias=fc_bias, input_norm=input_norm, target={"hidden_size": hidden, "vocab_size": vocab},
                          num_layers=num_layers, norm_before_residual=norm_before_residual and eagle3,
                          qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, source=source)
    return cfg, ours


def _vocab_map(raw: dict, take: _Taker, vocab: int, lm_rows: int, where: str, path: Path) -> tuple[int, torch.Tensor]:
    """(draft vocabulary size, draft id → target id [Vd]) from ``draft_vocab_size``, ``d2t`` and ``t2d``."""
    declared = raw.get("draft_vocab_size")
    # Absent (older EAGLE-3 configs) or null (speculators: the full vocabulary): the LM head's rows say it.
    draft_vocab = int(declared) if declared is not None else lm_rows
    if draft_vocab != lm_rows:
        raise ValueError(f"{where}: draft_vocab_size={declared} but lm_head.weight has {lm_rows} rows")
    d2t = take.maybe("d2t")
    t2d = take.maybe("t2d")
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(f"EAGLE-3 head in {str(path)!r} has a reduced draft vocabulary but no d2t map")
        return draft_vocab, torch.arange(vocab)
    d2t = d2t.long()
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"EAGLE-3 head in {str(path)!r}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
    ids = torch.arange(draft_vocab) + d2t  # d2t stores target id minus draft id
    if t2d is not None:
        t2d = t2d.bool()
        if t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab or not bool(t2d[ids.clamp(0, vocab - 1)].all()):
            raise ValueError(f"EAGLE-3 head in {str(path)!r}: t2d does not agree with d2t")
    return draft_vocab, ids
