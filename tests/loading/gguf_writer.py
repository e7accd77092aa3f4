"""Tiny Llama GGUF files for the loading tests, written with the `gguf` package's own GGUFWriter from a tiny Hugging
Face directory (`tiny_models.build_model`), as llama.cpp's convert_hf_to_gguf.py writes a Llama:

- metadata: general.architecture, llama.block_count / context_length / embedding_length / feed_forward_length /
  attention.head_count / head_count_kv / rope.freq_base / rope.dimension_count / attention.layer_norm_rms_epsilon /
  vocab_size, file_type; the tokenizer as a GPT-2 byte-level BPE (tokenizer.ggml.model "gpt2", pre "gpt-2", tokens,
  token_type, merges, bos / eos ids) and tokenizer.chat_template;
- tensors under llama.cpp's names (token_embd, blk.N.attn_q, ..., output_norm, output), 1-D norms as F32, every
  2-D matrix in the chosen weight type: F32, F16, BF16, or Q8_0 / Q4_0 / Q4_1 through `gguf.quants.quantize`; or
  Q6_K, which the package cannot quantize: random but valid raw blocks (finite float16 d, int8 scales);
- the q and k projections' rows PERMUTED as the converter does for its interleaved rope (`permute_rows`, written
  here from the converter's definition, not taken from specserve).

The norms are perturbed (the HF model initialises them to ones, which would hide a norm that is not loaded).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")
K_QUANT = "Q6_K"
Q6_K_BLOCK_BYTES = 210  # ql[128], qh[64], scales int8[16], d float16 per 256 inputs

# Hugging Face name (after "model.layers.N.") -> llama.cpp's (after "blk.N.").
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows reordered so rotate-half pairs become adjacent."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def random_q6_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q6_K bytes uint8[rows, cols / 256 * 210]: random 6-bit q, int8 sub-block scales in [-16, 16], a finite
    positive float16 d per block (weights of magnitude ~0.1)."""
    assert cols % 256 == 0, cols
    n = rows * cols // 256
    ql = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    qh = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    scales = rng.integers(-16, 17, (n, 16)).astype(np.int8).view(np.uint8)
    d = (np.abs(rng.standard_normal((n, 1))) * 5e-4 + 2e-4).astype(np.float16).view(np.uint8)
    blocks = np.concatenate([ql, qh, scales, d], axis=1)
    assert blocks.shape[1] == Q6_K_BLOCK_BYTES
    return blocks.reshape(rows, -1)


def _matrix(w: np.ndarray, weight_type: str, rng: np.random.Generator):
    """(data, raw_dtype) for GGUFWriter.add_tensor of a float32 [out, in] matrix stored as `weight_type`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[weight_type]
    if weight_type == "F32":
        return w.astype(np.float32), None
    if weight_type == "F16":
        return w.astype(np.float16), None
    if weight_type == K_QUANT:
        return random_q6_k(*w.shape, rng), qtype
    if weight_type in ("BF16", *BLOCK_TYPES):
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    if weight_type == "F64":  # a type GGUF knows and specserve does not read (for the refusal test)
        return w.astype(np.float64), None
    raise ValueError(f"the test writer does not write {weight_type}")


def write_gguf(hf_dir: Path, out: Path, weight_type: str = "F32", *, tied: bool = False, architecture: str = "llama",
               chat_template: str | None = CHAT_TEMPLATE, eot_token: str | None = None,
               overrides: dict[str, str] | None = None, seed: int = 0) -> Path:
    """Write `hf_dir`'s model (and tokenizer) as a GGUF file at `out`; returns `out`.

    weight_type: every 2-D matrix's type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q6_K; F64 for refusals); overrides: GGUF
    tensor name -> another type for that one. tied: no output.weight (the embedding is the LM head). architecture:
    what general.architecture says (the keys stay under that prefix, as the converter writes them). eot_token: also
    write tokenizer.ggml.eot_token_id for this token."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rng = np.random.default_rng(seed)
    overrides = dict(overrides or {})

    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name("tiny-test-llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
             "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
             "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K}.get(weight_type, gguf.LlamaFileType.ALL_F32)
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # The tokenizer as llama.cpp's converter writes a GPT-2 style byte-level BPE: tokens by id, merges best-first.
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    backend = json.loads(tok.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    tokens = [None] * cfg["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"]: t["id"] for t in backend["added_tokens"]}
    for token, index in special.items():
        tokens[index] = token
    assert all(t is not None for t in tokens), "the vocabulary has holes"
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([int(gguf.TokenType.CONTROL) if i in special.values() else int(gguf.TokenType.NORMAL)
                            for i in range(len(tokens))])
    writer.add_token_merges(merges)
    eos = special["<|endoftext|>"]
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    if eot_token is not None:
        writer.add_eot_token_id(vocab.get(eot_token, special.get(eot_token)))
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    names = ["model.embed_tokens.weight"]
    for i in range(cfg["num_hidden_layers"]):
        names += [f"model.layers.{i}.{n}" for n in LAYER_NAMES]
    names.append("model.norm.weight")
    if not tied:
        names.append("lm_head.weight")
    for hf_name in names:
        w = state[hf_name]
        name = gguf_name(hf_name)
        if w.ndim == 1:  # norms: F32, perturbed around 1
            writer.add_tensor(name, (w + 0.2 * rng.standard_normal(w.shape)).astype(np.float32))
            continue
        if hf_name.endswith("self_attn.q_proj.weight"):
            w = permute_rows(w, heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            w = permute_rows(w, kv_heads)
        data, raw_dtype = _matrix(np.ascontiguousarray(w), overrides.pop(name, weight_type), rng)
        if raw_dtype is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
    assert not overrides, f"no such tensors: {sorted(overrides)}"

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
