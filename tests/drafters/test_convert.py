"""`specserve convert`: the embedded model's trained EAGLE-3 head and Medusa heads written in every public
layout load back (detected from the files), hold the same tensors, and draft what the originals draft."""

from __future__ import annotations

import json

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.drafters.export import export_drafter
from specserve.bundle_paths import default_drafters, default_model_dir

PROMPT = "def add(a, b):\n    return a + b\n\n" * 6
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def bundle():
    if default_model_dir() is None or not {"eagle", "medusa"} <= set(default_drafters()):
        pytest.skip("the embedded bundle is not installed")
    return LLM("tiny", drafter=None).generate([PROMPT], GREEDY)[0].token_ids


@pytest.mark.parametrize("layout, tensor_file, format_word", [
    ("specserve", "eagle_head.safetensors", "specserve"),
    ("eagle3-safeailab", "pytorch_model.bin", "midlayer"),
    ("eagle3-speculators", "model.safetensors", "speculators"),
])
def test_eagle3_head_round_trips_through_every_layout(bundle, tmp_path, layout, tensor_file, format_word):
    original = LLM("tiny", drafter="eagle", speculation="static")
    out = export_drafter(original.engine.drafter, layout, tmp_path / layout)
    assert (out / tensor_file).is_file()
    converted = LLM("tiny", drafter=f"eagle:{out}", speculation="static")
    head, back = original.engine.drafter.head, converted.engine.drafter.head
    assert format_word in back.cfg.source["format"] and back.cfg.feature_layers == head.cfg.feature_layers
    tol = 1e-3 if layout == "eagle3-safeailab" else 0.0  # SafeAILab's trainer saves fp16
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name].float(), tensor.float(), atol=tol, rtol=tol)
    a, b = original.generate([PROMPT], GREEDY)[0], converted.generate([PROMPT], GREEDY)[0]
    assert a.token_ids == b.token_ids == bundle
    if layout != "eagle3-safeailab":
        assert b.spec.mean_accepted_length == a.spec.mean_accepted_length


@pytest.mark.parametrize("layout", ["specserve", "medusa1", "medusa2"])
def test_medusa_heads_round_trip_through_every_layout(bundle, tmp_path, layout):
    original = LLM("tiny", drafter="medusa", speculation="static")
    drafter = original.engine.drafter
    out = export_drafter(drafter, layout, tmp_path / layout)
    choices = json.dumps([list(c) for c in drafter.static.choices])  # public layouts keep no tree
    options = {} if layout == "specserve" else {"choices": choices}
    converted = LLM("tiny", drafter=f"medusa:{out}", drafter_options=options, speculation="static")
    back = converted.engine.drafter
    torch.testing.assert_close(back.heads.weight.float(), drafter.heads.weight.float(), atol=1e-3, rtol=1e-3)
    a, b = original.generate([PROMPT], GREEDY)[0], converted.generate([PROMPT], GREEDY)[0]
    assert a.token_ids == b.token_ids == bundle
    assert b.spec.mean_accepted_length == pytest.approx(a.spec.mean_accepted_length, abs=0.05)


def test_bad_conversions_are_clear_errors(bundle, tmp_path):
    eagle = LLM("tiny", drafter="eagle").engine.drafter
    with pytest.raises(ValueError, match="eagle3 head cannot be written as eagle1-safeailab"):
        export_drafter(eagle, "eagle1-safeailab", tmp_path / "a")
    with pytest.raises(ValueError, match="converts to"):
        export_drafter(eagle, "medusa1", tmp_path / "b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export_drafter(eagle, "specserve", tmp_path / "full")
    with pytest.raises(ValueError, match="no weights to convert"):
        export_drafter(LLM("tiny", drafter="ngram").engine.drafter, "specserve", tmp_path / "c")
