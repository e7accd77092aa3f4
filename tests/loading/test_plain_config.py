"""A plain-rope Llama config.json read without transformers' config classes (`config.plain_llama_record`) means
exactly what transformers reads from it: every architecture field, the rope parameters, the stored dtype and
the EOS/BOS ids, against `AutoConfig.from_pretrained` on the same file."""

from __future__ import annotations

import dataclasses
import json

import pytest

from specserve.config import (
    _rope_parameters,
    config_from_hf,
    load_config,
    plain_llama_record,
)
from specserve.device import checkpoint_dtype

BASE = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "hidden_act": "silu", "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "dtype": "float16"}


def without(*keys: str) -> dict:
    return {k: v for k, v in BASE.items() if k not in keys}


READ_PLAINLY = {
    "every field spelled out": BASE,
    "transformers 4 spelling (rope_theta at the top, torch_dtype)":
        {**without("rope_parameters", "dtype"), "rope_theta": 500000.0, "torch_dtype": "bfloat16"},
    "optional fields left to their defaults": without("num_key_value_heads", "hidden_act", "tie_word_embeddings",
                                                      "eos_token_id", "bos_token_id", "rope_parameters", "dtype"),
    "explicit head_dim, biases, several EOS ids": {**BASE, "head_dim": 32, "attention_bias": True, "mlp_bias": True,
                                                   "eos_token_id": [2, 7], "tie_word_embeddings": False},
    "float32 storage, an integer theta": {**BASE, "dtype": "float32",
                                                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000}},
}


@pytest.mark.parametrize("raw", READ_PLAINLY.values(), ids=READ_PLAINLY.keys())
def test_a_plain_llama_config_means_what_transformers_reads(tmp_path, raw):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(raw))
    record = plain_llama_record(raw)
    assert record is not None
    reference = AutoConfig.from_pretrained(str(tmp_path))
    ours, theirs = config_from_hf(record), config_from_hf(reference)
    assert dataclasses.replace(ours, hf_config=None) == dataclasses.replace(theirs, hf_config=None)
    assert _rope_parameters(record) == _rope_parameters(reference)
    assert checkpoint_dtype(record) == checkpoint_dtype(reference)
    for ids in ("eos_token_id", "bos_token_id"):
        assert getattr(record, ids) == getattr(reference, ids)
    assert load_config(tmp_path).hf_config.__class__ is record.__class__  # what the loader actually takes


LEFT_TO_TRANSFORMERS = {
    "another architecture": {**BASE, "model_type": "mistral"},
    "scaled rope": {**BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    "transformers 4 rope scaling": {**without("rope_parameters"), "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "a required field left out": without("rms_norm_eps"),
    "a field of the wrong type": {**BASE, "rms_norm_eps": "1e-5"},
    "an integer epsilon (transformers refuses it)": {**BASE, "rms_norm_eps": 0},
    "a float where a size goes": {**BASE, "max_position_embeddings": 256.0},
    "an EOS id spelled as text": {**BASE, "eos_token_id": "2"},
    "a boolean where a size goes": {**BASE, "num_key_value_heads": True},
}


@pytest.mark.parametrize("raw", LEFT_TO_TRANSFORMERS.values(), ids=LEFT_TO_TRANSFORMERS.keys())
def test_anything_else_is_left_to_transformers(raw):
    assert plain_llama_record(raw) is None


def test_the_bundled_eagle_heads_layer_reads_plainly_and_as_transformers_reads_it():
    """The EAGLE head's decoder-layer config takes the same reader: a plain record, equal to transformers' reading
    of the same fields."""
    from specserve.drafters.eagle_checkpoint import read_head
    from transformers import LlamaConfig

    from specserve.bundle_paths import bundle_dir

    head, _ = read_head(bundle_dir() / "eagle", target_num_layers=6)
    record = head.model_config.hf_config
    assert record.__class__ is not LlamaConfig
    reference = config_from_hf(LlamaConfig(**vars(record)))
    assert dataclasses.replace(config_from_hf(record), hf_config=None) == dataclasses.replace(reference, hf_config=None)
