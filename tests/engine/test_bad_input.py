"""Bad input raises a clear ValueError/FileNotFoundError naming the problem, and loses nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from specserve import LLM, SamplingParams
from tiny_models import build_model


@pytest.fixture()
def model_copy(small_vocab_dir, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(small_vocab_dir, dst)
    return dst


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -2, "top_k"),
        ("top_k", 2.5, "top_k"),
        ("min_p", 1.1, "min_p"),
        ("max_tokens", 0, "max_tokens"),
        ("stop", [""], "stop"),
        ("seed", "x", "seed"),
        ("ignore_eos", "yes", "ignore_eos"),
    ],
)
def test_invalid_sampling_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_sampling_params_normalise():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(temperature=0).greedy


def test_missing_and_non_model_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        LLM(tmp_path / "file")


def test_unsupported_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
        LLM(model_copy)


def test_config_not_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        LLM(model_copy)


def test_corrupt_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="not a readable safetensors"):
        LLM(model_copy)


def test_missing_weights_file(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        LLM(model_copy)


def test_config_checkpoint_mismatch(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.* has shape .* config.json implies"):
        LLM(model_copy)


def test_missing_tensor(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing .* tensor.*layers.2"):
        LLM(model_copy)


def test_unexpected_tensor(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not have: model.layers.1"):
        LLM(model_copy)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_per_layer_sliding_windows_are_refused(model_copy, arch):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(model_type=arch, use_sliding_window=True, sliding_window=8)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{arch.capitalize()} configs with use_sliding_window=true"):
        LLM(model_copy)


def test_qwen3_checkpoint_without_its_qk_norms(model_copy):
    # A Llama checkpoint relabelled qwen3: the per-head q/k norm weights are named as missing.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(model_type="qwen3", head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing 4 tensor.*self_attn\.k_norm\.weight.*self_attn\.q_norm\.weight"):
        LLM(model_copy)


def test_missing_shard(tmp_path):
    from transformers import AutoModelForCausalLM

    src = build_model(tmp_path / "one", "llama", tokenizer=False, vocab_size=64)
    AutoModelForCausalLM.from_pretrained(str(src)).save_pretrained(str(tmp_path / "sh"), max_shard_size="40KB")
    next((tmp_path / "sh").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        LLM(tmp_path / "sh")


def test_unsupported_rope_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    # longrope switches every position's frequencies past the original context (cached keys would need
    # re-rotating); dynamic NTK is supported (tests/engine/test_dynamic_rope.py).
    cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                           "original_max_position_embeddings": 64}
    cfg.pop("rope_parameters", None)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="longrope"):
        LLM(model_copy)


def test_bad_prompts_raise_and_leave_the_engine_clean(small_vocab_dir, llama_dir):
    llm = LLM(small_vocab_dir, drafter="ngram", max_model_len=64, speculation="static")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 99]])
    with pytest.raises(ValueError, match="context window is 64"):
        llm.generate([[1] * 64])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text prompt"])
    # A bad prompt in a batch queues nothing: the good ones are not half-run.
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], [-1]])
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))
    assert len(out[0].token_ids) <= 5
    with pytest.raises(ValueError, match="empty"):
        LLM(llama_dir).generate([""])


def test_unknown_drafter_and_options(small_vocab_dir):
    with pytest.raises(ValueError, match="unknown drafter 'nope'.*ngram"):
        LLM(small_vocab_dir, drafter="nope", speculation="static")
    with pytest.raises(ValueError, match="unknown option"):
        LLM(small_vocab_dir, drafter="ngram", drafter_options={"depht": 3}, speculation="static")
    with pytest.raises(ValueError, match="device"):
        LLM(small_vocab_dir, device="tpu")


def test_max_tokens_past_the_context_is_an_error_and_unset_means_the_rest(small_vocab_dir):
    llm = LLM(small_vocab_dir, drafter="ngram", max_model_len=20, speculation="static")
    # As OpenAI does: a prompt plus max_tokens past the window is refused, naming both numbers.
    with pytest.raises(ValueError, match=r"prompt has 6 tokens and max_tokens is 100.*context window is 20"):
        llm.generate([[1, 2, 3, 1, 2, 3]], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    out = llm.generate([[1, 2, 3, 1, 2, 3]], SamplingParams(temperature=0, ignore_eos=True))[0]  # max_tokens unset
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 20 - 6


def test_extreme_but_valid_sampling_values_do_not_break_the_batch(small_vocab_dir):
    """Tiny temperature / top_p and huge top_k are valid: they must sample, not poison the batch."""
    llm = LLM(small_vocab_dir, drafter="ngram", speculation="static")
    greedy = llm.generate([[1, 2, 3, 1, 2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    extreme = [
        SamplingParams(max_tokens=8, temperature=2e-308, ignore_eos=True, seed=1),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=2e-308, ignore_eos=True, seed=2),
        SamplingParams(max_tokens=8, temperature=1.0, top_k=2**70, ignore_eos=True, seed=3),
        SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=4),
    ]
    outs = llm.generate([[1, 2, 3, 1, 2]] * 4, extreme)
    # A vanishing temperature or top_p leaves only the most likely token: greedy output.
    assert outs[0].token_ids == greedy.token_ids
    assert outs[1].token_ids == greedy.token_ids
    assert all(len(o.token_ids) == 8 for o in outs)
