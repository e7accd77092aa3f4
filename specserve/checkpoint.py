"""Load Hugging Face safetensors checkpoints (single file or sharded index) with exact checks.

The loader knows which tensors a Llama-family model of a given config must have and what shape each
must be, and says exactly what is missing, unexpected or mis-shaped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.config import ModelConfig

# Buffers some exporters save that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A Medusa-2 target (fine-tuned jointly with its heads) keeps the heads in its own shards under this
# name; the target is the model without them (the `medusa` drafter reads them from the same directory).
_IGNORED_PREFIXES = ("medusa_head.",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name → shape for every weight a model of this config has."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        if cfg.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (cfg.intermediate_size,)
            shapes[p + "mlp.up_proj.bias"] = (cfg.intermediate_size,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    return shapes


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, from the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{str(index)!r} is not a valid shard index (needs a 'weight_map'): {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shard(s) named in {index.name} are missing: {', '.join(missing)}")
        return files
    if single.is_file():
        return [single]
    others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = f" (found {', '.join(others)}: convert to safetensors)" if others else ""
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r}{hint}")


def load_state_dict(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                    shard=None, stats: dict | None = None) -> dict[str, torch.Tensor]:
    """Read every expected tensor, converted to `dtype` on `device`; raise on any mismatch.

    shard: a `specserve.tensor_parallel.Shard`: read only this rank's slice of each split tensor (safetensors
    slices read just those bytes). stats: gets "bytes_read", the checkpoint bytes read.
    """
    from specserve.sharding import slice_of

    model_dir = Path(model_dir)
    bytes_read = 0
    expected = expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or name.startswith(_IGNORED_PREFIXES):
                        continue
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    stored = f.get_slice(name)
                    if tuple(stored.get_shape()) != expected[name]:
                        raise ValueError(
                            f"{path.name}: tensor {name!r} has shape {tuple(stored.get_shape())}, but config.json "
                            f"implies {expected[name]} (checkpoint and config do not match)"
                        )
                    part = slice_of(name, cfg, shard) if shard is not None else None
                    if part is None:
                        tensor = f.get_tensor(name)
                    else:
                        dim, lo, hi = part
                        tensor = stored[lo:hi] if dim == 0 else stored[:, lo:hi]
                    bytes_read += tensor.numel() * tensor.element_size()
                    state[name] = tensor.to(device=device, dtype=dtype)
        except ValueError:
            raise
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"{str(path)!r} is not a readable safetensors file (corrupt or truncated?): {exc}") from exc
    if stats is not None:
        stats["bytes_read"] = bytes_read
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {str(model_dir)!r} is missing {len(missing)} tensor(s): {shown}")
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise ValueError(
            f"checkpoint in {str(model_dir)!r} has {len(unexpected)} tensor(s) a {cfg.model_type} model of this "
            f"config does not have: {shown}"
        )
    return state
