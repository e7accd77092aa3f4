"""Self-distillation data and the distilled draft model, end to end on the tiny fixture target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from specserve.training.distill import DistillSettings, load_distill, make_distill_data
from specserve.training.tokenizer import tokenizer_fingerprint
from specserve.training.trainer import LOG_FILE, read_log
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.cli import main


def _contains(stream: np.ndarray, window: list[int]) -> bool:
    view = np.lib.stride_tricks.sliding_window_view(stream, len(window))
    return bool((view == np.asarray(window)).all(axis=1).any())


def test_distill_data_holds_target_continuations_and_soft_labels(trained_lm, distill_dir):
    manifest = json.loads((distill_dir / "distill_manifest.json").read_text())
    assert manifest["complete"] and manifest["counts"]["train"]["sequences"] == 24
    assert manifest["counts"]["heldout"]["sequences"] == 8
    assert manifest["target_tokenizer"] == tokenizer_fingerprint(trained_lm)
    data, _ = load_distill(distill_dir, "train")
    n, t, k = data.topk_ids.shape
    assert (n, t, k) == (24, 16 + 32, 8)
    assert bool((data.lengths > 16).all()) and bool((data.lengths <= t).all())
    lp = data.topk_logprobs.float()
    assert bool((lp <= 0).all()) and bool((lp[..., :-1] >= lp[..., 1:]).all())  # best first
    # The soft labels are the target's own next-token distribution at every position.
    hf = AutoModelForCausalLM.from_pretrained(str(trained_lm), dtype=torch.float32).eval()
    length = int(data.lengths[0])
    with torch.no_grad():
        ref = torch.log_softmax(hf(data.tokens[:1, :length]).logits[0], -1)
    top = ref.topk(k, dim=-1)
    assert (data.topk_ids[0, :length, 0] == top.indices[:, 0]).float().mean() > 0.95
    torch.testing.assert_close(data.topk_logprobs[0, :length].float(), top.values, atol=0.02, rtol=0.01)


def test_prompts_come_from_their_own_split(trained_lm, distill_dir):
    train_stream = np.load(trained_lm / "data" / "train.npy").astype(np.int64)
    heldout_stream = np.load(trained_lm / "data" / "heldout.npy").astype(np.int64)
    for split, stream in (("train", train_stream), ("heldout", heldout_stream)):
        data, _ = load_distill(distill_dir, split)
        for row in data.tokens:
            assert _contains(stream, row[:16].tolist()), split


def test_distill_resume_matches_an_uninterrupted_run(trained_lm, tmp_path):
    settings = DistillSettings(num_prompts=6, heldout_prompts=2, prompt_tokens=8, new_tokens=8, batch_size=2,
                               shard_size=2, topk=4)
    straight = make_distill_data(trained_lm, tmp_path / "a", settings, device="cpu")
    partial = make_distill_data(trained_lm, tmp_path / "b", settings, device="cpu", max_minutes=1e-6)
    assert straight["complete"] and not partial["complete"]
    resumed = make_distill_data(trained_lm, tmp_path / "b", settings, device="cpu", resume=True)
    assert resumed["complete"] and resumed["counts"] == straight["counts"]
    for name in straight["shards"]["train"] + straight["shards"]["heldout"]:
        a, b = load_file(str(tmp_path / "a" / name)), load_file(str(tmp_path / "b" / name))
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


def test_draft_model_files_and_training(trained_lm, trained_draft):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "draft_config.json", "train_log.jsonl",
                 "loss_curve.png", "train_summary.json"):
        assert (trained_draft / name).is_file(), name
    config = json.loads((trained_draft / "draft_config.json").read_text())
    assert config["target"] == str(trained_lm.resolve())
    assert config["target_tokenizer"] == tokenizer_fingerprint(trained_draft) == tokenizer_fingerprint(trained_lm)
    records = read_log(trained_draft / LOG_FILE)
    assert records[-1]["loss"] < records[0]["loss"]
    assert {"eval_loss", "top1_agree", "accept_t1"} <= set(records[-1])
    assert json.loads((trained_draft / "config.json").read_text())["vocab_size"] == \
        json.loads((trained_lm / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("options", [{"depth": 4}, {"depth": 3, "topk": 2, "width": 2}])
def test_trained_draft_is_lossless_greedy(trained_lm, trained_draft, options):
    prompts = ["import json\n", "def parse(args):\n    ", "class Dialect:\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(trained_lm, device="cpu").generate(prompts, params)
    spec = LLM(trained_lm, drafter=f"draft:{trained_draft}", drafter_options=options, device="cpu", speculation="static")
    for batch in (prompts[:1], prompts):
        outs = spec.generate(batch, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain[: len(batch)]]


def test_trained_draft_samples_reproducibly(trained_lm, trained_draft):
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True)
    a = LLM(trained_lm, drafter=f"draft:{trained_draft}", device="cpu", speculation="static").generate(["import os\n"], params)[0]
    b = LLM(trained_lm, drafter=f"draft:{trained_draft}", device="cpu", speculation="static").generate(["import os\n"], params)[0]
    assert a.token_ids == b.token_ids and a.spec.num_steps >= 1


def test_draft_without_data_generates_its_own(trained_lm, tmp_path):
    out = tmp_path / "auto"
    assert main(["train", "draft", "--preset", "tiny", "--target", str(trained_lm), "--out", str(out), "--max-steps", "3",
                 "--batch-size", "2", "--num-prompts", "4", "--heldout-prompts", "2", "--prompt-tokens", "8",
                 "--new-tokens", "8", "--device", "cpu"]) == 0
    assert (out / "distill" / "distill_manifest.json").is_file() and (out / "model.safetensors").is_file()


def test_draft_and_distill_bad_input(trained_lm, distill_dir, llama_dir, tmp_path, capsys):
    cases = [
        (["train", "draft", "--target", str(tmp_path), "--out", str(tmp_path / "o1")], "has no tokenizer"),
        (["train", "draft", "--target", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")], "does not exist"),
        (["train", "draft", "--target", str(trained_lm), "--data", str(tmp_path), "--out", str(tmp_path / "o3")],
         "is not distillation data"),
        (["train", "draft", "--target", str(llama_dir), "--data", str(distill_dir), "--out", str(tmp_path / "o4")],
         "another tokenizer"),
        (["train", "draft", "--target", str(trained_lm), "--data", str(distill_dir), "--out", str(tmp_path / "o5"),
          "--max-steps", "-3"], "max_steps"),
        (["train", "distill-data", "--target", str(trained_lm), "--out", str(tmp_path / "o6"), "--prompt-tokens", "60",
          "--new-tokens", "60"], "new_tokens"),
        (["train", "distill-data", "--target", str(trained_lm), "--out", str(tmp_path / "o7"), "--temperature", "0",
          "--prompt-tokens", "8", "--new-tokens", "8"], "temperature"),
        (["train", "distill-data", "--target", str(trained_lm), "--out", str(distill_dir), "--prompt-tokens", "8",
          "--new-tokens", "8"], "not empty"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)


def test_draft_resume_takes_the_runs_own_recipe_and_data(trained_lm, distill_dir, tmp_path):
    out = tmp_path / "resumable"
    base = ["train", "draft", "--target", str(trained_lm), "--out", str(out)]
    assert main([*base, "--preset", "tiny", "--data", str(distill_dir), "--max-steps", "8", "--batch-size", "4",
                 "--stop-at-step", "5"]) == 0
    assert json.loads((out / "train_summary.json").read_text())["step"] == 5
    assert main([*base, "--resume"]) == 0  # no --preset, --data or overrides: all from run_config.json
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["step"] == 8 and summary["stopped"] == "complete" and not (out / "distill").exists()
