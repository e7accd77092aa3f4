"""``specserve train lm`` end to end on a stdlib slice: files, logs, loss, loading, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from specserve.training.corpus import corpus_from_manifest
from specserve.training.trainer import LOG_FILE
from specserve.training.trainer import read_log as _read_log
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve import LLM, SamplingParams
from specserve.cli import main


def read_log(run_dir):
    return _read_log(run_dir / LOG_FILE)


def test_outputs_and_logs(trained_lm):
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "corpus_manifest.json", "train_log.jsonl", "loss_curve.png", "train_summary.json", "checkpoint/state.pt"):
        assert (trained_lm / name).is_file(), name
    assert (trained_lm / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = read_log(trained_lm)
    assert [r["step"] for r in records] == [10, 20, 24]
    for r in records:
        assert {"step", "loss", "lr", "tokens", "tokens_per_s"} <= set(r)
    assert "eval_loss" in records[-1]
    assert records[-1]["tokens"] == 24 * 8 * 64
    summary = json.loads((trained_lm / "train_summary.json").read_text())
    assert summary["stopped"] == "complete" and summary["step"] == 24
    assert 1e6 <= summary["num_params"] <= 2e6


def test_loss_falls(trained_lm):
    records = read_log(trained_lm)
    vocab = json.loads((trained_lm / "config.json").read_text())["vocab_size"]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert records[-1]["eval_loss"] < torch.log(torch.tensor(float(vocab))).item() - 0.5  # well below uniform


def test_checkpoint_loads_in_transformers_and_specserve_with_equal_greedy_tokens(trained_lm):
    tok = AutoTokenizer.from_pretrained(str(trained_lm))
    assert tok.eos_token == "<|endoftext|>"
    hf = AutoModelForCausalLM.from_pretrained(str(trained_lm), dtype=torch.float32).eval()
    llm = LLM(trained_lm, device="cpu")
    prompts = ["import json\n\ndef load(path):\n", "class Parser:\n    def "]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([tok.encode(prompt)])
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, pad_token_id=tok.eos_token_id)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()
        assert isinstance(out.text, str)


def test_heldout_never_overlaps_train(trained_lm):
    manifest = json.loads((trained_lm / "corpus_manifest.json").read_text())
    corpus = corpus_from_manifest(manifest)
    assert corpus.modules("heldout") and not corpus.modules("train") & corpus.modules("heldout")
    assert {f["sha256"] for f in manifest["files"] if f["split"] == "train"}.isdisjoint(
        f["sha256"] for f in manifest["files"] if f["split"] == "heldout")


def test_resume_continues_from_the_checkpoint(trained_lm, lm_argv, tmp_path):
    """Stopped at step 12 and resumed, the run ends exactly where the uninterrupted one did."""
    out = tmp_path / "resumed"
    assert main(["train", "lm", *lm_argv, "--out", str(out), "--stop-at-step", "12"]) == 0
    first = read_log(out)
    assert [r["step"] for r in first] == [10, 12]
    assert json.loads((out / "train_summary.json").read_text())["stopped"] == "stop_at_step"
    assert main(["train", "lm", "--preset", "tiny", "--out", str(out), "--resume"]) == 0
    resumed, straight = read_log(out), read_log(trained_lm)
    assert [r["step"] for r in resumed] == [10, 12, 20, 24]
    for r in resumed:  # loss continuity: records over the same steps match the uninterrupted run's
        if r["step"] in (10, 24):
            (ref,) = [s for s in straight if s["step"] == r["step"]]
            assert r["loss"] == pytest.approx(ref["loss"], abs=1e-4)
            assert r["tokens"] == ref["tokens"]
    a, b = load_file(str(out / "model.safetensors")), load_file(str(trained_lm / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    assert json.loads((out / "train_summary.json").read_text())["step"] == 24


def test_budget_stops_cleanly_and_saves(lm_argv, tmp_path):
    out = tmp_path / "budget"
    assert main(["train", "lm", *lm_argv, "--out", str(out), "--max-minutes", "0.0001"]) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["stopped"] == "budget" and summary["step"] < 24
    assert (out / "model.safetensors").is_file() and (out / "checkpoint" / "state.pt").is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--corpus", "/no/such/dir"], "does not exist"),
        (["--max-steps", "0"], "max_steps"),
        (["--lr", "-1"], "lr must be"),
        (["--batch-size", "0"], "batch_size"),
        (["--heldout-fraction", "1.5"], "heldout_fraction"),
        (["--resume"], "does not exist"),
        (["--resume", "--force"], "contradict"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    assert main(["train", "lm", "--preset", "tiny", "--out", str(tmp_path / "new"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("specserve: error:")


def test_non_empty_out_dir_is_refused_unless_force(lm_argv, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    assert main(["train", "lm", *lm_argv, "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["train", "lm", *lm_argv, "--max-steps", "2", "--out", str(out), "--force"]) == 0
    assert (out / "keep.txt").read_text() == "user file" and (out / "model.safetensors").is_file()


def test_empty_corpus_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["train", "lm", "--preset", "tiny", "--out", str(tmp_path / "o"), "--corpus", str(tmp_path / "empty")]) == 2
    assert "the corpus is empty" in capsys.readouterr().err
