"""The byte-level BPE tokenizer (special tokens, chat template, exact round trips) and the presets."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from specserve.training.presets import (
    DRAFT_PRESETS,
    LM_PRESETS,
    ModelShape,
    TrainSettings,
    get_preset,
)
from specserve.training.tokenizer import (
    EOS_TOKEN,
    ROLE_TOKENS,
    tokenizer_fingerprint,
    train_tokenizer,
)
from transformers import AutoTokenizer

TEXTS = ["def f(x):\n    return x * 2\n", "class A:\n    pass\n", "for i in range(3):\n    print(i)\n"] * 30


def test_tokenizer_round_trips_and_loads_in_transformers(tmp_path):
    train_tokenizer(TEXTS, 320, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 0
    for text in ["def g(y):\n\treturn y\n", "unseen ünïcödé ✓ 日本語 \x00", "    " * 5]:
        assert tok.decode(tok.encode(text)) == text  # byte level: nothing is unknown
    for role in ROLE_TOKENS:
        assert len(tok.encode(role)) == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"


def test_tokenizer_is_deterministic(tmp_path):
    train_tokenizer(TEXTS, 300, tmp_path / "a")
    train_tokenizer(TEXTS, 300, tmp_path / "b")
    assert tokenizer_fingerprint(tmp_path / "a") == tokenizer_fingerprint(tmp_path / "b")


def test_tokenizer_bad_input():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(TEXTS, 100)
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer([], 300)


def test_preset_sizes():
    tiny = replace(LM_PRESETS["tiny"].shape, vocab_size=LM_PRESETS["tiny"].vocab_size)
    small = replace(LM_PRESETS["small"].shape, vocab_size=LM_PRESETS["small"].vocab_size)
    draft = replace(DRAFT_PRESETS["draft"].shape, vocab_size=LM_PRESETS["small"].vocab_size)
    assert 1e6 <= tiny.num_params() <= 2e6
    assert 8e6 <= small.num_params() <= 20e6
    assert draft.num_params() < small.num_params() / 3
    for name in LM_PRESETS:
        get_preset(name, "lm")
    for name in DRAFT_PRESETS:
        get_preset(name, "draft")


def test_lr_schedule_warms_up_and_decays():
    s = TrainSettings(seq_len=64, batch_size=4, lr=1e-3, max_steps=100, warmup_steps=10)
    lrs = [s.lr_at(i) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)
    assert math.isclose(TrainSettings(seq_len=64, batch_size=4, lr=1e-3, max_steps=4, warmup_steps=10).lr_at(1), 1e-3)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"max_steps": 0}, "max_steps"),
        ({"batch_size": -1}, "batch_size"),
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"seq_len": 4}, "seq_len"),
        ({"max_minutes": 0}, "max_minutes"),
        ({"seed": -1}, "seed"),
        ({"bogus": 1}, "unknown training setting"),
    ],
)
def test_out_of_range_settings(override, message):
    with pytest.raises(ValueError, match=message):
        get_preset("tiny").with_overrides(**override)


def test_bad_shapes_and_presets():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        ModelShape(hidden_size=100, num_layers=1, num_heads=3, num_kv_heads=1, intermediate_size=8).validate()
    with pytest.raises(ValueError, match="divisible by num_kv_heads"):
        ModelShape(hidden_size=96, num_layers=1, num_heads=4, num_kv_heads=3, intermediate_size=8).validate()
    with pytest.raises(ValueError, match="unknown lm preset"):
        get_preset("huge")
