"""Tiny Llama-family checkpoints built on the fly: random weights, a real BPE tokenizer, HF layout.

Saved by transformers' own `save_pretrained`, so the files are exactly what a user's checkpoint looks
like, and transformers' model with the same weights is the reference in parity tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_TOKENIZER_TEXT = [
    "def f(x):\n    return x + 1\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語\n",
] * 20


def build_tokenizer(out_dir: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on a few lines of code, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(out_dir))
    return fast


def build_model(
    out_dir: Path,
    arch: str = "llama",
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    tokenizer: bool = True,
    seed: int = 0,
    init_std: float = 0.02,
    **extra,
) -> Path:
    """Write a random-weight model of `arch` (llama | mistral | qwen2 | qwen3) to `out_dir`; return the path."""
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
        Qwen3Config, Qwen3ForCausalLM,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir) if tokenizer else None
    if vocab_size is None:
        vocab_size = len(tok) if tok is not None else 128
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[arch]
    if arch == "qwen3":  # Qwen3Config's head_dim defaults to 128 whatever the width: keep tiny heads tiny
        extra.setdefault("head_dim", hidden_size // heads)
    eos = tok.eos_token_id if tok is not None else vocab_size - 1
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch == "qwen3":
        # Per-head q/k norms start as ones, which would hide a norm that is skipped or swapped: randomise.
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.copy_(1.0 + 0.5 * torch.randn_like(norm.weight))
    model.save_pretrained(str(out_dir))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out_dir


def cli_env(**extra: str) -> dict:
    """A bare environment for `specserve` subprocesses (no user settings leak in), keeping what the test session
    set up (conftest.py): its own empty cache, no pip index, the tiny model as the default."""
    import os

    keep = ("SPECSERVE_CACHE_DIR", "SPECSERVE_MODEL", "PIP_NO_INDEX", "TRITON_INTERPRET")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **{k: os.environ[k] for k in keep if k in os.environ}}
    env.update(extra)
    return env
