"""``specserve train eagle`` end to end on a tiny target: both head kinds train (loss falls, agreement is
logged), the head serves losslessly as ``eagle:OUT``, a resumed run equals an uninterrupted one,
and bad arguments are one-line errors."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import build_model

import specserve.drafters.eagle  # noqa: F401  (registers "eagle")
from specserve import LLM, SamplingParams
from specserve.cli import main
from specserve.drafters.eagle_checkpoint import target_fingerprint
from specserve.training.distill import DistillSettings, make_distill_data
from specserve.training.trainer import LOG_FILE, read_log

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 4-layer random target with a tokenizer, and 16 distillation sequences of its own samples."""
    tmp = tmp_path_factory.mktemp("eagle_train")
    target = build_model(tmp / "target", "llama", hidden_size=64, layers=4, init_std=0.2)
    corpus = tmp / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "shlex.py", "copy.py", "csv.py"):
        shutil.copy(STDLIB / name, corpus / name)
    settings = DistillSettings(num_prompts=16, heldout_prompts=0, prompt_tokens=16, new_tokens=32, batch_size=16, topk=4)
    make_distill_data(target, tmp / "data", settings, corpus=[str(corpus)], device="cpu")
    return target, tmp / "data"


def _train(target, data, out, *extra) -> int:
    return main(["train", "eagle", "--target", str(target), "--data", str(data), "--out", str(out), "--batch-size", "4",
                 "--save-dtype", "float32", "--threads", "1", *extra])


@pytest.mark.parametrize("mode, extra", [("eagle3", ["--draft-vocab", "120", "--ttt-steps", "2"]), ("eagle1", [])])
def test_train_eagle_end_to_end(setup, tmp_path, mode, extra):
    target, data = setup
    out = tmp_path / mode
    assert _train(target, data, out, "--mode", mode, "--max-steps", "40", *extra) == 0
    for name in ("eagle_config.json", "eagle_head.safetensors", "train_log.jsonl", "loss_curve.png", "agreement.png",
                 "train_summary.json", "run_config.json"):
        assert (out / name).is_file(), name
    records = read_log(out / LOG_FILE)
    assert records[-1]["loss"] < 0.9 * records[0]["loss"]
    assert {"eval_loss", "agree_d1", "agree_d2", "agree_d3", "agree_d4", "tau_chain"} <= set(records[-1])
    config = json.loads((out / "eagle_config.json").read_text())
    assert config["mode"] == mode and config["draft_vocab_size"] == (120 if mode == "eagle3" else config["vocab_size"])
    assert config["feature_layers"] == ([1, 2, 3] if mode == "eagle3" else [4])
    fingerprint = target_fingerprint(target)
    assert config["target"]["config_sha256"] == fingerprint["config_sha256"] and fingerprint["tokenizer"]
    assert config["target"]["tokenizer"] == fingerprint["tokenizer"]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["head_bytes"] > 0 and summary["stopped"] == "complete"
    # The trained head serves losslessly.
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["def f(x):\n    return", "import os\n"]
    plain = LLM(target, device="cpu").generate(prompts, params)
    spec = LLM(target, drafter=f"eagle:{out}", drafter_options={"depth": 3, "topk": 2}, device="cpu", speculation="static").generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_resume_matches_an_uninterrupted_run(setup, tmp_path):
    target, data = setup
    assert _train(target, data, tmp_path / "straight", "--max-steps", "20") == 0
    assert _train(target, data, tmp_path / "split", "--max-steps", "20", "--stop-at-step", "10") == 0
    assert read_log(tmp_path / "split" / LOG_FILE)[-1]["step"] == 10
    assert _train(target, data, tmp_path / "split", "--resume") == 0
    a = load_file(str(tmp_path / "straight" / "eagle_head.safetensors"))
    b = load_file(str(tmp_path / "split" / "eagle_head.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    straight, split = read_log(tmp_path / "straight" / LOG_FILE), read_log(tmp_path / "split" / LOG_FILE)
    assert [r["step"] for r in split] == [r["step"] for r in straight]
    assert split[-1]["loss"] == pytest.approx(straight[-1]["loss"], rel=1e-3)


def test_bad_arguments_are_one_line_errors(setup, tmp_path, capsys):
    target, data = setup
    assert _train(target, data, tmp_path / "r", "--resume") == 2  # nothing to resume
    assert _train(target, data, tmp_path / "a", "--mode", "eagle1", "--draft-vocab", "50") == 2
    assert _train(target, data, tmp_path / "b", "--ttt-steps", "0") == 2
    assert _train(target, data, tmp_path / "c", "--feature-layers", "1,9,2", "--max-steps", "2") == 2
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert _train(target, data, tmp_path / "busy") == 2
    assert _train(target, data, tmp_path / "d", "--max-steps", "2", "--stop-at-step", "1") == 0
    assert _train(target, data, tmp_path / "d", "--resume", "--mode", "eagle1") == 2  # another run's settings
    err = capsys.readouterr().err
    assert "does not exist" in err and "eagle1 head uses the target's LM head" in err and "ttt_steps" in err
    assert "feature layers" in err and "not empty" in err and "uses mode 'eagle3'" in err
