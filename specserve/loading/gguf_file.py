"""A Llama-family GGUF file (llama.cpp's format) as a target: config, tokenizer, EOS ids and weights.

Read with the `gguf` package (llama.cpp's own reader). Its reader parses every metadata entry of a file,
the tokenizer's ~100k strings included, which takes seconds on a 2-core machine; so the first open writes
what start-up needs — the scalar metadata and each tensor's type, shape and byte offset — to the user's
cache (`user_cache`, keyed by the file's path, size and modification time), and later opens read only
that index and map the tensors' bytes. The tokenizer is converted once by transformers (its GGUF
conversion) and saved beside the index.

Weights: Q8_0, Q4_0 and Q4_1 products keep their bits (`gguf_blocks.QuantBlocks`, run by the kernels as
they are); F32, F16, BF16 are exact; any other type the `gguf` package dequantizes (K-quants) is widened to
float32 at load, then stored as the user picks (`--dtype`, `--quantization`). llama.cpp's converter stores
q and k projection rows permuted for its interleaved rope: `gguf_blocks.rope_rows` undoes it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.loading.gguf_blocks import (
    FLOAT_TYPES,
    NATIVE_FORMATS,
    QuantBlocks,
    float_weights,
    native_blocks,
    rope_rows,
)
from specserve.loading.user_cache import cache_dir

log = logging.getLogger("specserve")

SUPPORTED_ARCHITECTURES = ("llama",)
_INDEX_VERSION = 1
_MAGIC = b"GGUF"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; the magic is checked when it opens)."""
    return str(path).lower().endswith(".gguf")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: GGML type name, torch-order shape ([out, in] for a matrix), byte offset, size."""

    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


class GGUFFile:
    """An opened GGUF file (see the module docstring). Raises ValueError with one clear line for a file that
    is not GGUF, is truncated or corrupt, or holds another architecture."""

    kind = "gguf"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise FileNotFoundError(f"model file {str(path)!r} does not exist")
        if not self.path.is_file():
            raise FileNotFoundError(f"model path {str(path)!r} is not a file")
        with open(self.path, "rb") as f:
            if f.read(4) != _MAGIC:
                raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with the GGUF magic)")
        stat = self.path.stat()
        key = f"{self.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        self.cache = cache_dir() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:20]
        self.metadata, self.tensors = self._index(stat.st_size)
        arch = self.metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{self.path.name}: architecture {arch!r} is not supported (GGUF files of the "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} architecture are)")
        self.arch = arch

    # ---- the index ------------------------------------------------------------------------------

    def _index(self, file_size: int) -> tuple[dict, dict[str, TensorEntry]]:
        path = self.cache / "index.json"
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") == _INDEX_VERSION:
                return raw["metadata"], {n: TensorEntry(t[0], tuple(t[1]), t[2], t[3]) for n, t in raw["tensors"].items()}
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass
        metadata, tensors = self._read_with_gguf(file_size)
        self.cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": _INDEX_VERSION, "file": str(self.path.resolve()), "metadata": metadata,
                                   "tensors": {n: [t.type_name, list(t.shape), t.offset, t.nbytes]
                                               for n, t in tensors.items()}}))
        tmp.replace(path)
        return metadata, tensors

    def _read_with_gguf(self, file_size: int) -> tuple[dict, dict[str, TensorEntry]]:
        import gguf

        try:
            reader = gguf.GGUFReader(str(self.path))
            metadata = {}
            for key, field in reader.fields.items():
                if key.startswith("GGUF."):
                    continue
                if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
                    # Arrays (the tokenizer's strings) stay in the file; small ones are kept.
                    metadata[key] = field.contents() if len(field.data) <= 64 else {"array_length": len(field.data)}
                else:
                    value = field.contents()
                    metadata[key] = value.item() if isinstance(value, np.generic) else value
            tensors = {}
            for t in reader.tensors:
                shape = tuple(int(n) for n in reversed([int(x) for x in t.shape]))
                tensors[t.name] = TensorEntry(t.tensor_type.name, shape, int(t.data_offset), int(t.n_bytes))
        except (ValueError, IndexError, KeyError, OSError, OverflowError, UnicodeDecodeError, struct.error) as exc:
            raise ValueError(f"{self.path.name} is not a readable GGUF file (truncated or corrupt?): {exc}") from None
        end = max((t.offset + t.nbytes for t in tensors.values()), default=0)
        if end > file_size:
            raise ValueError(f"{self.path.name} is truncated: its tensors end at byte {end:,}, the file has {file_size:,}")
        return metadata, tensors

    # ---- config, tokenizer, EOS -----------------------------------------------------------------

    @functools.cached_property
    def config(self):
        """The `ModelConfig` (checked by `config.config_from_hf`, as a directory's is)."""
        from specserve.config import config_from_hf

        return config_from_hf(self.hf_config)

    @functools.cached_property
    def hf_config(self):
        return self._hf_config()

    def describe(self) -> str:
        """What the load line says about the weights: each type's count, and what was dequantized."""
        counts = self.weight_types()
        kept = [f"{n} {t}" for t, n in sorted(counts.items()) if t in NATIVE_FORMATS or t in FLOAT_TYPES]
        widened = [f"{n} {t}" for t, n in sorted(counts.items()) if t not in NATIVE_FORMATS and t not in FLOAT_TYPES]
        text = "GGUF " + ", ".join(kept) + (" as stored" if kept else "")
        if widened:
            text += f"{'; ' if kept else ''}{', '.join(widened)} dequantized at load"
        return text

    def _meta(self, key: str, default=None):
        return self.metadata.get(f"{self.arch}.{key}", default)

    def _hf_config(self):
        """The config `config.config_from_hf` reads, built from the metadata (`config.llama_config`: a plain record
        unless rope is scaled)."""
        if "rope_freqs.weight" in self.tensors:
            raise ValueError(f"{self.path.name}: per-frequency rope factors (rope_freqs.weight, Llama 3.1-style "
                             "rope scaling) are not supported yet")
        hidden, heads = int(self._meta("embedding_length")), int(self._meta("attention.head_count"))
        head_dim = int(self._meta("attention.key_length", hidden // heads))
        vocab = self._meta("vocab_size") or self.metadata.get("tokenizer.ggml.tokens", {}).get("array_length")
        rope = {"rope_type": "default", "rope_theta": float(self._meta("rope.freq_base", 10000.0))}
        scaling = self._meta("rope.scaling.type", "none")
        if scaling == "linear":
            rope.update(rope_type="linear", factor=float(self._meta("rope.scaling.factor")))
        elif scaling == "yarn":
            rope.update(rope_type="yarn", factor=float(self._meta("rope.scaling.factor")),
                        original_max_position_embeddings=int(self._meta("rope.scaling.original_context_length")))
        elif scaling != "none":
            raise ValueError(f"{self.path.name}: rope scaling {scaling!r} is not supported (none, linear, yarn are)")
        fields = dict(
            vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(self._meta("feed_forward_length")),
            num_hidden_layers=int(self._meta("block_count")), num_attention_heads=heads,
            num_key_value_heads=int(self._meta("attention.head_count_kv", heads)), head_dim=head_dim,
            rms_norm_eps=float(self._meta("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(self._meta("context_length", 2048)), rope_parameters=rope,
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.metadata.get("tokenizer.ggml.eos_token_id"),
            dtype=self._storage_dtype(),
        )
        from specserve.config import llama_config

        fields.update(model_type="llama", hidden_act="silu", attention_bias=False, mlp_bias=False)
        return llama_config(fields)

    def _storage_dtype(self) -> str:
        """What the products are stored as, for `device.checkpoint_dtype`: float16 / bfloat16 when every matrix is."""
        types = {t.type_name for n, t in self.tensors.items() if len(t.shape) == 2}
        return {"F16": "float16", "BF16": "bfloat16"}.get(types.pop(), "float32") if len(types) == 1 else "float32"

    def tokenizer(self):
        """The file's tokenizer with its special tokens and chat template (transformers' GGUF conversion, done
        once and saved in the cache)."""
        from specserve.loading.tokenizer_files import load_tokenizer

        saved = self.cache / "tokenizer"
        if (saved / "tokenizer.json").is_file():
            return load_tokenizer(saved)
        if "tokenizer.ggml.model" not in self.metadata:
            return None
        try:
            tok = load_tokenizer(self.path.parent, gguf_file=self.path.name)
        except Exception as exc:  # transformers raises many types for a tokenizer it cannot convert
            raise ValueError(f"{self.path.name}: cannot convert its tokenizer: {exc}") from exc
        tmp = self.cache / "tokenizer.tmp"
        tok.save_pretrained(str(tmp))
        if saved.exists():  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(saved)
        return load_tokenizer(saved)

    def tokenizer_dir(self) -> Path | None:
        """The converted tokenizer's directory (tokenizer.json), once `tokenizer()` has run."""
        saved = self.cache / "tokenizer"
        return saved if (saved / "tokenizer.json").is_file() else None

    def eos_token_ids(self, tokenizer=None) -> tuple[int, ...]:
        """End-of-generation ids: EOS, end-of-turn and end-of-message tokens, as llama.cpp stops on them."""
        ids = [self.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    # ---- weights --------------------------------------------------------------------------------

    def weight_types(self) -> dict[str, int]:
        """GGML type name -> how many matrices are stored in it (what the load line reports)."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) == 2:
                counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts

    def load(self, dtype: torch.dtype, device: torch.device = torch.device("cpu"), shard=None, stats: dict | None = None,
             blocks_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, QuantBlocks]]:
        """Every weight under its Hugging Face name, as `dtype` on `device` (quantized ones dequantized), and the
        Q8_0 / Q4_0 / Q4_1 ones also as `QuantBlocks` (their bits, for the kernels). Checks names and shapes.

        blocks_only: the kernels will run the blocks as stored, so the layers' block-format products get no
        float copy (an empty placeholder; dequantizing 135M weights took seconds of every start-up); the
        embedding and LM head are always dequantized (looked up, and read by drafters)."""
        from specserve.checkpoint import expected_shapes

        if shard is not None:
            raise ValueError("GGUF files do not load under tensor parallelism yet: use a Hugging Face directory")
        cfg = self.config

        expected = expected_shapes(cfg)
        unknown = sorted(n for n in self.tensors if _hf_name(n) is None)
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise ValueError(f"{self.path.name} has tensor(s) a Llama model does not: {shown}")
        names = {_hf_name(n): n for n in self.tensors}
        missing = sorted(set(expected) - set(names))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"{self.path.name} is missing {len(missing)} tensor(s): {shown}")
        known = set(NATIVE_FORMATS) | set(FLOAT_TYPES) | _dequantizable()
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        mixed = _mixed_groups({hf: self.tensors[n].type_name for hf, n in names.items()}) if blocks_only else set()
        state: dict[str, torch.Tensor] = {}
        blocks: dict[str, QuantBlocks] = {}
        for hf_name, name in names.items():
            entry = self.tensors[name]
            if hf_name not in expected:
                raise ValueError(f"{self.path.name}: tensor {name!r} is not part of a model of this config")
            if entry.shape != expected[hf_name]:
                raise ValueError(f"{self.path.name}: tensor {name!r} has shape {entry.shape}, the metadata implies "
                                 f"{expected[hf_name]}")
            if entry.type_name not in known:
                raise ValueError(f"{self.path.name}: tensor {name!r} has weight type {entry.type_name}, which specserve "
                                 f"does not read (supported: {', '.join(sorted(known))})")
            raw = data[entry.offset: entry.offset + entry.nbytes]
            rows = _rope_permutation(hf_name, cfg)
            if entry.type_name in NATIVE_FORMATS and len(entry.shape) == 2:
                quant = native_blocks(entry.type_name, raw, entry.shape[0])
                if rows is not None:
                    quant = quant.take_rows(rows)
                blocks[hf_name] = quant
                if blocks_only and hf_name.startswith("model.layers.") and hf_name not in mixed:
                    state[hf_name] = torch.empty(0, dtype=dtype)
                    continue
                weight = quant.dequantize()
            else:
                weight = float_weights(entry.type_name, raw, entry.shape)
                if rows is not None:
                    weight = weight[rows]
            # The kernels read norms as float32: an F32 norm keeps its value beside half-size products, as in llama.cpp.
            keep = torch.float32 if blocks_only and len(entry.shape) == 1 else dtype
            state[hf_name] = weight.to(device=device, dtype=keep).contiguous()
        if stats is not None:
            stats["bytes_read"] = sum(t.nbytes for t in self.tensors.values())
        return state, blocks


def _rope_permutation(hf_name: str, cfg) -> torch.Tensor | None:
    """The row order that undoes the converter's q / k permutation (None for every other tensor)."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return rope_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
    if hf_name.endswith("self_attn.k_proj.weight"):
        return rope_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    return None


def _mixed_groups(types: dict[str, str]) -> set[str]:
    """HF names of the products fused with a part of another format (q|k|v, gate|up): the kernels run those
    from float weights, so they need them."""
    out = set()
    for name in types:
        for parts in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            part = next((p for p in parts if f".{p}." in name), None)
            if part is not None:
                group = [name.replace(f".{part}.", f".{p}.") for p in parts]
                if len({types.get(g) for g in group}) > 1:
                    out.add(name)
    return out


def _dequantizable() -> set[str]:
    """GGML types the `gguf` package can dequantize (K-quants, Q5_*, IQ*, ...)."""
    import gguf

    return {t.name for t in gguf.GGMLQuantizationType if t in gguf.quants._type_traits}

