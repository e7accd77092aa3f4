"""Write a loaded drafter head in another project's layout (`specserve convert`): heads trained here run
in vLLM / SGLang / the EAGLE and Medusa repositories, and public heads convert to specserve's own format.

Layouts (each the inverse of what `eagle_public` / `medusa_public` read, so a converted head loads back
with identical tensors):

- ``specserve``: our own format (`eagle_checkpoint.save_head` / `medusa_heads.save_heads`);
- ``eagle3-safeailab``: SafeAILab EAGLE-3 — flat Llama ``config.json`` (``draft_vocab_size``, the
  target's ``vocab_size``), fp16 ``pytorch_model.bin`` as its trainer saves, layer 0 as ``midlayer.*``,
  ``d2t`` (target id minus draft id) and ``t2d``;
- ``eagle3-speculators``: vLLM's ``speculators`` export — ``speculators_model_type: "eagle3"``, the layer
  config under ``transformer_layer_config``, ``layers.N.*`` names, ``model.safetensors``;
- ``eagle1-safeailab``: SafeAILab EAGLE-1/2 — ``fc`` over [embedding; feature] with bias, ``layers.N.*``;
- ``medusa1``: FasterDecoding Medusa-1 — ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``) and
  ``medusa_lm_head.safetensors`` (``{k}.{l}.linear.*`` blocks, each head's own LM head ``{k}.{L}.weight``);
- ``medusa2``: Medusa's v2 heads — the blocks only, every head ending in the target's LM head.
  Upstream keeps a Medusa tree (``choices``) in code, not with the heads: the public layouts do not carry
  ours (pass it back with ``--drafter-option choices=...``); the specserve layout does.

Feature layers are written as ``eagle_aux_hidden_state_layer_ids`` in vLLM's numbering (transformers'
``hidden_states`` index, ours too), so a reader never falls back to its own default layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EAGLE_LAYOUTS = ("specserve", "eagle3-safeailab", "eagle3-speculators", "eagle1-safeailab")
MEDUSA_LAYOUTS = ("specserve", "medusa1", "medusa2")


def export_drafter(drafter, layout: str, out_dir: str | Path) -> Path:
    """Write ``drafter``'s head (an `EagleDrafter` or `MedusaDrafter`, loaded for its target) as ``layout``."""
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {str(out)!r} is not empty")
    if drafter.name == "eagle":
        if layout not in EAGLE_LAYOUTS:
            raise ValueError(f"an EAGLE head converts to {', '.join(EAGLE_LAYOUTS)}, not {layout!r}")
        return _export_eagle(drafter.head, layout, out)
    if drafter.name == "medusa":
        if layout not in MEDUSA_LAYOUTS:
            raise ValueError(f"Medusa heads convert to {', '.join(MEDUSA_LAYOUTS)}, not {layout!r}")
        return _export_medusa(drafter, layout, out)
    raise ValueError(f"the {drafter.name} drafter has no weights to convert (eagle and medusa heads do)")


# ---- EAGLE ------------------------------------------------------------------------------------------


def _export_eagle(head, layout: str, out: Path) -> Path:
    from specserve.drafters.eagle_checkpoint import save_head

    cfg, mc = head.cfg, head.mc
    if layout == "specserve":
        return save_head(head, out)
    eagle3 = cfg.mode == "eagle3"
    if eagle3 != layout.startswith("eagle3"):
        raise ValueError(f"a {cfg.mode} head cannot be written as {layout}")
    sd = {k: v.detach().cpu().float() for k, v in head.state_dict().items()}
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    first = "midlayer." if layout == "eagle3-safeailab" else "layers.0."
    state = _public_layer(sd, "layer.", first, q, kv)
    for i in range(cfg.num_layers - 1):
        state.update(_public_layer(sd, f"later.{i}.", f"layers.{i + 1}.", q, kv))
        state[f"layers.{i + 1}.input_layernorm.weight"] = sd[f"later.{i}.input_norm"]
    state["fc.weight"] = sd["fc"]
    if "embed_tokens" in sd:
        state["embed_tokens.weight"] = sd["embed_tokens"]
    if eagle3:
        state[first + "input_layernorm.weight"] = sd["input_norm"]
        state[first + "hidden_norm.weight"] = sd["hidden_norm"]
        state["norm.weight"], state["lm_head.weight"] = sd["norm"], sd["lm_head"]
        d2t = head.draft_to_target.detach().cpu().long()
        if cfg.draft_vocab_size != cfg.vocab_size or not torch.equal(d2t, torch.arange(cfg.vocab_size)):
            state["d2t"] = d2t - torch.arange(cfg.draft_vocab_size)  # stored as target id minus draft id
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[d2t] = True
            state["t2d"] = t2d
    else:
        if "fc_bias" in sd:
            state["fc.bias"] = sd["fc_bias"]
        if "layer.input_norm" in sd:
            state[first + "input_layernorm.weight"] = sd["layer.input_norm"]
    layer = _layer_config(cfg, mc)
    common = {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers), "target_hidden_size": mc.hidden_size}
    out.mkdir(parents=True, exist_ok=True)
    if layout == "eagle3-speculators":
        config = {"speculators_model_type": "eagle3", "speculators_version": "0.1.0",
                  "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
                  "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": cfg.norm_before_residual, **common}
        _save_safetensors(state, out / "model.safetensors")
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], **common}
        if eagle3:
            config.update(draft_vocab_size=cfg.draft_vocab_size, norm_before_residual=cfg.norm_before_residual)
        else:
            config.pop("eagle_aux_hidden_state_layer_ids")  # EAGLE-1 reads the final feature: nothing to say
        if cfg.qkv_bias and not cfg.o_bias:
            config["qkv_bias"] = True  # EAGLE's Qwen2 heads
        # SafeAILab's trainer saves fp16 state dicts with torch.save; index and bool tensors keep their type.
        torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def _public_layer(sd: dict, ours: str, prefix: str, q: int, kv: int) -> dict:
    """Our fused decoder-layer tensors → the public per-projection names (the input norm aside)."""
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    q_w, k_w, v_w = sd[ours + "qkv"].split([q, kv, kv])
    gate, up = sd[ours + "gate_up"].chunk(2)
    out = {attn + "q_proj.weight": q_w, attn + "k_proj.weight": k_w, attn + "v_proj.weight": v_w,
           attn + "o_proj.weight": sd[ours + "o_proj"], prefix + "post_attention_layernorm.weight": sd[ours + "post_attn_norm"],
           mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up, mlp + "down_proj.weight": sd[ours + "down"]}
    if ours + "qkv_bias" in sd:
        for name, t in zip("qkv", sd[ours + "qkv_bias"].split([q, kv, kv])):
            out[f"{attn}{name}_proj.bias"] = t
    if ours + "o_bias" in sd:
        out[attn + "o_proj.bias"] = sd[ours + "o_bias"]
    if ours + "q_norm" in sd:
        out[attn + "q_norm.weight"], out[attn + "k_norm.weight"] = sd[ours + "q_norm"], sd[ours + "k_norm"]
    return out


def _layer_config(cfg, mc) -> dict:
    """The head's decoder layer as a transformers config dict of its model type (the target's vocabulary)."""
    model_type = "qwen3" if cfg.qk_norm else ("qwen2" if cfg.qkv_bias and not cfg.o_bias else "llama")
    layer = {k: v for k, v in cfg.layer.items()}
    layer.update(model_type=model_type, num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
                 hidden_act="silu", tie_word_embeddings=False)
    if model_type == "llama":
        layer["attention_bias"] = bool(cfg.o_bias)
    return layer


def _save_safetensors(state: dict, file: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(file), metadata={"format": "pt"})


# ---- Medusa -----------------------------------------------------------------------------------------


def _export_medusa(drafter, layout: str, out: Path) -> Path:
    from specserve.drafters.medusa_heads import save_heads

    heads = drafter.heads
    choices = [list(c) for c in drafter.static.choices] if drafter.static is not None else None
    if layout == "specserve":  # keeps the static tree it was calibrated with
        save_heads(heads, out, drafter._target_dir, extra={"choices": choices} if choices else None)
        return out
    own = heads.lm_heads is not None
    if layout == "medusa2" and own:
        raise ValueError("these Medusa heads have their own LM heads: write them as medusa1")
    # Medusa-1 gives every head its own LM head: heads that share the target's get a copy of it each
    # (Medusa-1 training starts from exactly that copy), the same math.
    lm_heads = heads.lm_heads if own else drafter.lm_weight[None].expand(heads.weight.shape[0], -1, -1)
    num_heads, num_layers = heads.weight.shape[0], heads.weight.shape[1]
    state = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            state[f"{k}.{layer}.linear.weight"] = heads.weight[k, layer].detach().cpu().float()
            state[f"{k}.{layer}.linear.bias"] = heads.bias[k, layer].detach().cpu().float()
        if layout == "medusa1":
            state[f"{k}.{num_layers}.weight"] = lm_heads[k].detach().cpu().float().clone()
    out.mkdir(parents=True, exist_ok=True)
    _save_safetensors(state, out / "medusa_lm_head.safetensors")
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
              "base_model_name_or_path": str(drafter._target_dir)}
    if layout == "medusa2":
        config["version"] = "2"
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out
