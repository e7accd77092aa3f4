"""``specserve train medusa`` end to end on a tiny random target and its distillation data."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from specserve.drafters import medusa as _medusa  # noqa: F401  (registers "medusa")
from specserve.drafters.medusa_heads import load_heads, target_fingerprint
from specserve.training.distill import DistillSettings, make_distill_data
from specserve.training.trainer import LOG_FILE, read_log
from tiny_models import build_model

from specserve import LLM, SamplingParams
from specserve.cli import main

RUN = ["--max-steps", "30", "--batch-size", "4", "--heads", "3"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A random tiny Llama whose train/held-out token streams are textwrap.py and shlex.py."""
    from transformers import AutoTokenizer

    out = build_model(tmp_path_factory.mktemp("medusa_target") / "t", "llama", init_std=0.2, max_positions=128)
    tok = AutoTokenizer.from_pretrained(str(out))
    (out / "data").mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for split, name in (("train", "textwrap.py"), ("heldout", "shlex.py")):
        ids = tok((stdlib / name).read_text())["input_ids"]
        np.save(out / "data" / f"{split}.npy", np.asarray(ids, dtype=np.int32))
    return out


@pytest.fixture(scope="module")
def data(target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("medusa_distill") / "d"
    make_distill_data(target, out, DistillSettings(num_prompts=24, heldout_prompts=8, prompt_tokens=16, new_tokens=24,
                                                   batch_size=12, topk=8), device="cpu")
    return out


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory) -> Path:
    """A run stopped at step 20 and resumed to 30 (shared LM head, the default)."""
    out = tmp_path_factory.mktemp("medusa_run") / "m"
    args = ["train", "medusa", "--target", str(target), "--data", str(data), "--out", str(out), *RUN]
    assert main([*args, "--stop-at-step", "20"]) == 0
    assert read_log(out / LOG_FILE)[-1]["step"] == 20
    assert main(["train", "medusa", "--target", str(target), "--out", str(out), "--resume"]) == 0
    return out


def test_training_writes_heads_that_serve_losslessly(target, trained):
    for name in ("medusa_config.json", "medusa_heads.safetensors", "train_log.jsonl", "loss_curve.png",
                 "train_summary.json", "run_config.json"):
        assert (trained / name).is_file(), name
    records = read_log(trained / LOG_FILE)
    losses = [r for r in records if "loss" in r]
    assert [r["step"] for r in losses] == [10, 20, 30]
    assert losses[-1]["loss"] < losses[0]["loss"]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [20, 30]  # the stop at step 20 evaluated too
    assert {f"h{k}_{m}" for k in range(3) for m in ("kl", "top1", "top5", "top1_chain")} <= set(evals[-1])
    config = json.loads((trained / "medusa_config.json").read_text())
    assert config["num_heads"] == 3 and config["lm_head"] == "shared" and config["step"] == 30
    assert config["target"]["fingerprint"] == target_fingerprint(target)
    assert len(config["choices"]) == 20 and len(config["rank_accuracy"]) == 3
    summary = json.loads((trained / "train_summary.json").read_text())
    assert summary["stopped"] == "complete" and summary["checkpoint_bytes"] > 0
    assert sorted(load_file(str(trained / "medusa_heads.safetensors"))) == ["bias", "weight"]

    prompts = ["def wrap(text, width=70):", "import re\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(target, device="cpu").generate(prompts, params)
    for options in ({}, {"tree": "dynamic", "topk": 3}):
        spec = LLM(target, drafter=f"medusa:{trained}", drafter_options=options, device="cpu", speculation="static").generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize("root_token", [False, True])
def test_resumed_run_matches_an_uninterrupted_one(target, data, tmp_path, root_token):
    base = ["train", "medusa", "--target", str(target), "--data", str(data), *RUN, "--lm-head", "own",
            *(["--root-token"] if root_token else [])]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--out", str(tmp_path / "b"), "--stop-at-step", "15"]) == 0
    assert main(["train", "medusa", "--target", str(target), "--out", str(tmp_path / "b"), "--resume"]) == 0
    a = load_file(str(tmp_path / "a" / "medusa_heads.safetensors"))
    b = load_file(str(tmp_path / "b" / "medusa_heads.safetensors"))
    assert sorted(a) == sorted(["bias", "lm_heads", "weight"] + (["root_weight"] if root_token else []))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    heads = load_heads(tmp_path / "a", hidden_size=64, vocab_size=300, target_dir=target).heads
    assert heads.lm_heads is not None and heads.num_heads == 3 and heads.root_token == root_token
    if root_token:
        assert heads.root_weight.abs().max() > 0  # the root's embedding was trained in
        prompts = ["def wrap(text, width=70):", "import re\n"]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        plain = LLM(target, device="cpu").generate(prompts, params)
        spec = LLM(target, drafter=f"medusa:{tmp_path / 'a'}", device="cpu", speculation="static").generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_each_head_reads_the_root_that_follows_its_feature(target, data):
    """The loss's alignment, against the definition: head k at the feature of t reads the embedding of the
    token at t + 1 and is scored on the label row t + k + 1 (the distribution of the token at t + k + 2)."""
    from specserve.drafters.medusa_heads import MedusaHeads
    from specserve.training.distill import load_distill
    from specserve.training.medusa import _batch, _Features, _head_terms, _Trainable
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    train_set = load_distill(data, "train")[0]
    heads = MedusaHeads(64, 300, 2, 1, "own", root_token=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in heads.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    module = _Trainable(heads, hf.lm_head.weight[:0], hf.model.embed_tokens.weight.detach())
    batch = _batch(train_set, _Features(hf.model, train_set, torch.device("cpu")), torch.tensor([0, 1]), torch.device("cpu"))
    tokens, feats = batch["tokens"], batch["features"]
    for k in range(2):
        logq, _, mask = _head_terms(module, batch, k)
        for b, t in ((0, 0), (1, 3), (0, int(mask[0].nonzero().max()))):
            e = hf.model.embed_tokens.weight[tokens[b, t + 1]]
            x = feats[b, t] + heads.root_weight[k] @ e
            x = x + torch.nn.functional.silu(heads.weight[k, 0] @ x + heads.bias[k, 0])
            assert torch.allclose(logq[b, t], torch.log_softmax(heads.lm_heads[k] @ x, -1), atol=1e-5)


def test_bad_input_is_one_line_and_exit_2(target, data, trained, tmp_path, capsys):
    assert main(["train", "medusa", "--target", str(target), "--out", str(trained), "--resume", "--heads", "2"]) == 2
    assert "other num_heads" in capsys.readouterr().err
    assert main(["train", "medusa", "--target", str(target), "--data", str(data), "--out", str(trained)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["train", "medusa", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "x"),
                 "--decay", "0"]) == 2
    assert "decay" in capsys.readouterr().err
    other = build_model(tmp_path / "other", "llama", init_std=0.2)
    tok = (other / "tokenizer.json").read_text().replace('"def"', '"dEf"')
    (other / "tokenizer.json").write_text(tok)
    assert main(["train", "medusa", "--target", str(other), "--data", str(data), "--out", str(tmp_path / "y")]) == 2
    assert "another tokenizer" in capsys.readouterr().err
