"""The target model's architecture, read from a Hugging Face `config.json` through transformers.

We own the forward pass (tree attention, paged KV), but not config parsing: transformers knows every
field spelling of Llama, Mistral, Qwen2 and Qwen3 configs, including RoPE scaling variants. The one
exception is the commonest and simplest case, a fully spelled-out Llama config with plain rope, read as
a plain record to spare start-up transformers' config classes (`plain_llama_record`).
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


# "longrope" switches every position's frequencies once a sequence passes the original context, so a
# cached key would need re-rotating: not supported. "dynamic" is per position (see specserve/rope.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 fields)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama's `attention_bias`)
    o_proj_bias: bool  # Llama's `attention_bias` also covers o_proj; Qwen2 has none there
    mlp_bias: bool
    sliding_window: int | None  # Mistral: a query sees keys at most `sliding_window - 1` positions back
    hidden_act: str
    qk_norm: bool  # Qwen3: per-head RMSNorm (weights [head_dim]) on q and k after projection, before rotary
    hf_config: Any  # the transformers config object (RoPE parameter functions), or a plain record of its fields

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h


_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings")


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate ``model_dir/config.json``; raise with what is wrong and what is supported."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.exists():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model path {str(model_dir)!r} is not a directory")
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: a model directory needs a Hugging Face config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):  # valid JSON but not an object ("[1, 2]") crashed on .get with a traceback
        raise ValueError(f"{str(path)!r} is not a config: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture: model_type={model_type!r} in {str(path)!r}; "
            f"specserve supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )

    # Sizes are checked here, before transformers sees them: a negative or zero size crashed later with a
    # traceback (torch: "negative dimension") or a division by zero, and transformers warns about it on stderr.
    for key in _POSITIVE_SIZES:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key}={value!r} in {str(path)!r} must be a positive integer")

    hf = plain_llama_record(raw)
    if hf is None:  # anything but a fully spelled-out plain-rope Llama config: transformers reads it
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(str(model_dir))
        except Exception as exc:  # transformers raises many types for a bad config; name the file
            raise ValueError(f"cannot parse {str(path)!r} as a {model_type} config: {exc}") from exc
    return config_from_hf(hf)


# What transformers' LlamaConfig fills in for a field config.json leaves out (the fields `config_from_hf`,
# `device.checkpoint_dtype` and the EOS lookup read); fields without a default here must be spelled out.
_LLAMA_DEFAULTS = {"num_key_value_heads": None, "head_dim": None, "hidden_act": "silu", "tie_word_embeddings": False,
                   "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2}
_LLAMA_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "rms_norm_eps", "max_position_embeddings")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_ids(value) -> bool:
    """None, an id or a list of ids (what transformers accepts for `eos_token_id`)."""
    return value is None or all(_is_int(v) for v in (value if isinstance(value, list) else [value]))


# Each field of the record and the values LlamaConfig accepts for it (it refuses the rest, so those configs are
# left to it: its error names the field).
_LLAMA_FIELD_TYPES = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"), _is_int),
    **dict.fromkeys(("num_key_value_heads", "head_dim"), lambda v: v is None or _is_int(v)),
    "rms_norm_eps": lambda v: isinstance(v, float),
    "hidden_act": lambda v: isinstance(v, str),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), lambda v: isinstance(v, bool)),
    **dict.fromkeys(("bos_token_id", "eos_token_id"), _is_token_ids),
}


def plain_llama_record(raw: dict) -> types.SimpleNamespace | None:
    """A Llama config.json with plain rope as the record `config_from_hf` reads, or None when transformers must
    read it (another architecture, scaled rope, a field missing or of an unexpected type).

    Why: importing transformers' config classes costs ~2 s of every process start on 2 cores (they pull in
    torch.distributed), and plain rope needs none of transformers' rope functions. GGUF files build the same
    record from their metadata. tests/loading/test_plain_config.py checks it against transformers' own reading."""
    if raw.get("model_type") != "llama" or any(key not in raw for key in _LLAMA_REQUIRED):
        return None
    rope = raw.get("rope_parameters")
    rope = {} if rope is None else rope
    if (raw.get("rope_scaling") is not None or not isinstance(rope, dict) or set(rope) - {"rope_type", "rope_theta"}
            or rope.get("rope_type", "default") != "default"):
        return None
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    fields = {**_LLAMA_DEFAULTS, **{k: raw[k] for k in _LLAMA_FIELD_TYPES if k in raw}}
    if not (isinstance(theta, (int, float)) and not isinstance(theta, bool)) or not all(
            accepts(fields[name]) for name, accepts in _LLAMA_FIELD_TYPES.items()):
        return None
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return types.SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": theta},
                                 dtype=dtype if isinstance(dtype, str) else None, **fields)


def llama_config(fields: dict) -> Any:
    """Llama config fields (config.json's spelling) as the record `config_from_hf` reads: the plain record where
    it applies, else transformers' LlamaConfig (whose errors, TypeError or ValueError, pass through)."""
    record = plain_llama_record(fields)
    if record is not None:
        return record
    from transformers import LlamaConfig

    return LlamaConfig(**fields)


def config_from_hf(hf: Any) -> ModelConfig:
    model_type = hf.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    num_heads = hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    if hf.hidden_act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; Llama-family models use 'silu'")

    sliding_window = None
    if model_type == "mistral":
        sliding_window = getattr(hf, "sliding_window", None)
    elif model_type in ("qwen2", "qwen3") and getattr(hf, "use_sliding_window", False):
        raise ValueError(f"{model_type.capitalize()} configs with use_sliding_window=true (per-layer windows) are not supported")

    if model_type == "qwen2":
        attention_bias, o_proj_bias = True, False
    else:  # Llama, Mistral and Qwen3: `attention_bias` covers q/k/v and o_proj alike
        attention_bias = o_proj_bias = bool(getattr(hf, "attention_bias", False))

    rope = _rope_parameters(hf)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope['rope_type']!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )

    return ModelConfig(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        sliding_window=sliding_window,
        hidden_act=hf.hidden_act,
        qk_norm=model_type == "qwen3",
        hf_config=hf,
    )


def context_limit(cfg: ModelConfig) -> int | None:
    """The longest context a model may run: its ``max_position_embeddings``, except under dynamic NTK
    rope, which exists to run past it (None: no limit but memory). Default context: `default_context`."""
    return None if _rope_parameters(cfg.hf_config).get("rope_type") == "dynamic" else cfg.max_position_embeddings


def default_context(cfg: ModelConfig) -> int:
    """The context an engine gets when none is asked for: the trained length, times the scaling factor
    under dynamic NTK (the length its factor was chosen for)."""
    params = _rope_parameters(cfg.hf_config)
    if params.get("rope_type") == "dynamic":
        return int(cfg.max_position_embeddings * float(params.get("factor", 1.0)))
    return cfg.max_position_embeddings


def _rope_parameters(hf: Any) -> dict:
    """RoPE settings under either spelling (transformers 5 `rope_parameters`, 4.x `rope_scaling`)."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(hf, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    scaling.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return scaling
