"""`specserve train feature-data` and EAGLE-3 training on captured features, on a GGUF target.

The target is a tiny random Llama written as an F32 GGUF file (as a llama.cpp user's file sits: no config.json
beside it). The references are transformers' forward of that file, loaded by transformers' own GGUF reader
(hidden states and logits), and plain greedy decoding for the served head (speculation is lossless).
"""

from __future__ import annotations

import copy
import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from loading.gguf_writer import write_gguf
from tiny_models import build_model

from specserve.cli import main

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SLICE = ["json", "email", "argparse.py", "textwrap.py", "csv.py", "shlex.py", "copy.py", "string.py", "base64.py"]


def corpus_args() -> list[str]:
    return [arg for name in SLICE for arg in ("--corpus", str(STDLIB / name))]

LAYERS = (1, 2, 4)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, Path]:
    """(HF directory, its F32 GGUF file): 4 layers, so EAGLE-3's low/mid/high layers are distinct."""
    hf = build_model(tmp_path_factory.mktemp("hf"), "llama", hidden_size=64, layers=4, init_std=0.1)
    gguf = write_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")
    return hf, gguf


@pytest.fixture(scope="module")
def feature_dir(target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("features") / "data"
    assert main(["train", "feature-data", "--model", str(target[1]), "--out", str(out), "--num-prompts", "6",
                 "--heldout-prompts", "2", "--new-tokens", "12", "--gen-batch-size", "3", "--topk", "8",
                 "--feature-layers", ",".join(map(str, LAYERS)), "--heldout-fraction", "0.4", "--threads", "1",
                 "--max-prompt-tokens", "480",
                 *corpus_args()]) == 0
    return out


def test_captured_features_and_labels_are_the_targets_own(target, feature_dir):
    """Every stored position's features and top-k log-probabilities equal transformers' forward of the same
    sequence (transformers' own loading of the file), and the manifest names the file by its sha256."""
    from transformers import AutoModelForCausalLM

    from specserve.training.feature_data import load_features

    train, manifest = load_features(feature_dir, "train")
    heldout, _ = load_features(feature_dir, "heldout")
    assert manifest["complete"] and manifest["feature_layers"] == list(LAYERS)
    assert manifest["target"]["file_sha256"] == hashlib.sha256(target[1].read_bytes()).hexdigest()
    # A prompt longer than --max-prompt-tokens is skipped and counted (this tokenizer spends a token per byte).
    assert len(train) + len(heldout) + manifest["stats"]["prompts_too_long"] == 8 and len(train) >= 3 and len(heldout)
    path = target[1]
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    for data in (train, heldout):
        for i in range(len(data)):
            lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
            tokens = data.tokens[lo:hi]
            assert int(data.prompt_lengths[i]) < hi - lo  # an answer follows the chat prompt
            with torch.no_grad():
                out = reference(input_ids=tokens[None], output_hidden_states=True)
            for j, layer in enumerate(LAYERS):
                torch.testing.assert_close(data.features[lo:hi, j].float(), out.hidden_states[layer][0],
                                           atol=2e-3, rtol=2e-3)
            want = torch.log_softmax(out.logits[0].double(), -1)
            got = want.gather(-1, data.topk_ids[lo:hi])  # the stored ids are the reference's top-k, best first
            torch.testing.assert_close(data.topk_logprobs[lo:hi].double(), got, atol=5e-3, rtol=0)
            torch.testing.assert_close(got, want.topk(8, -1).values, atol=1e-4, rtol=0)


def test_the_torch_layers_a_gpu_runs_capture_the_same_data(target, feature_dir, tmp_path, monkeypatch):
    """A GPU answers through the torch layers (`--device cuda`), not the CPU kernels: the same command with an
    attention backend named takes that path here, and its data (`--dtype float32`) equals the kernels' — the same
    answers, features and top-k. A bad --device or --dtype is one line and exit status 2."""
    import specserve
    from specserve.training.feature_data import load_features

    made, real = [], specserve.LLM

    def torch_layers(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **{**kwargs, "attention": "sdpa"})

    monkeypatch.setattr(specserve, "LLM", torch_layers)
    args = ["train", "feature-data", "--model", str(target[1]), "--num-prompts", "6", "--heldout-prompts", "2",
            "--new-tokens", "12", "--gen-batch-size", "3", "--topk", "8", "--feature-layers", ",".join(map(str, LAYERS)),
            "--heldout-fraction", "0.4", "--threads", "1", "--max-prompt-tokens", "480", *corpus_args()]
    assert main([*args, "--out", str(tmp_path / "torch"), "--device", "cpu", "--dtype", "float32"]) == 0
    assert made[0]["device"] == "cpu" and made[0]["dtype"] == "float32"
    for split in ("train", "heldout"):
        (kernels, _), (torch_path, _) = load_features(feature_dir, split), load_features(tmp_path / "torch", split)
        assert torch.equal(kernels.tokens, torch_path.tokens) and torch.equal(kernels.offsets, torch_path.offsets)
        torch.testing.assert_close(torch_path.features.float(), kernels.features.float(), atol=4e-3, rtol=4e-3)
        assert torch.equal(kernels.topk_ids[:, 0], torch_path.topk_ids[:, 0])
    assert main([*args, "--out", str(tmp_path / "bad1"), "--device", "tpu"]) == 2
    assert main([*args, "--out", str(tmp_path / "bad2"), "--dtype", "fp8"]) == 2


def test_chat_prompts_follow_the_corpus_split(feature_dir):
    """Held-out prompts come from held-out modules only; the kinds are those documented."""
    from specserve.training.chat_prompts import KINDS, chat_prompts
    from specserve.training.corpus import build_corpus

    corpus = build_corpus(corpus_args()[1::2], heldout_fraction=0.4)
    train, heldout = chat_prompts(corpus, "train", 10_000), chat_prompts(corpus, "heldout", 10_000)
    assert train and heldout
    assert {p.module for p in heldout} <= corpus.modules("heldout")
    assert not {p.module for p in train} & corpus.modules("heldout")
    assert {p.kind for p in train} <= set(KINDS)
    assert chat_prompts(corpus, "train", 5, seed=3) == chat_prompts(corpus, "train", 5, seed=3)
    # One kind alone: exactly the prompts of that kind among all of them, in the same order.
    edits = chat_prompts(corpus, "train", 10_000, kinds=("edit",))
    assert edits and edits == [p for p in train if p.kind == "edit"]
    assert all("```python" in p.text for p in edits)
    with pytest.raises(ValueError, match="kinds"):
        chat_prompts(corpus, "train", 5, kinds=("poem",))


def test_every_kind_asks_each_definition_every_question_it_allows():
    """--every-kind: each definition gives write and explain, and review and edit too where its source is
    short enough to quote (the quoted source is what those prompts show); the one drawn kind is among them,
    and the split still holds."""
    from specserve.training.chat_prompts import MAX_SOURCE_LINES, chat_prompts
    from specserve.training.corpus import build_corpus

    corpus = build_corpus(corpus_args()[1::2], heldout_fraction=0.4)
    one = chat_prompts(corpus, "train", 10_000)
    every = chat_prompts(corpus, "train", 10_000, every_kind=True)
    kinds: dict[tuple[str, str], list[str]] = {}
    for p in every:
        kinds.setdefault((p.module, p.name), []).append(p.kind)
    assert set(kinds) == {(p.module, p.name) for p in one}
    assert {(p.module, p.name, p.kind) for p in one} <= {(p.module, p.name, p.kind) for p in every}
    for (module, name), asked in kinds.items():
        assert sorted(asked) in (["explain", "write"], ["edit", "explain", "review", "write"]), (module, name, asked)
    quoted = [p for p in every if p.kind in ("review", "edit")]
    assert quoted and all(p.text.split("```python\n")[1].count("\n") <= MAX_SOURCE_LINES for p in quoted)
    assert len(every) > 2 * len(one)
    heldout = chat_prompts(corpus, "heldout", 10_000, every_kind=True)
    assert heldout and {p.module for p in heldout} <= corpus.modules("heldout")


def test_data_made_before_a_setting_existed_resumes_and_other_settings_are_refused(target, feature_dir, tmp_path):
    """--resume reads a setting the manifest does not record (data made before it existed) as its default;
    a setting that differs is still refused with one line."""
    import shutil

    from specserve.training.feature_data import MANIFEST

    old = tmp_path / "old"
    shutil.copytree(feature_dir, old)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["settings"]["every_kind"]
    (old / MANIFEST).write_text(json.dumps(manifest))
    args = ["train", "feature-data", "--model", str(target[1]), "--out", str(old), "--num-prompts", "6",
            "--heldout-prompts", "2", "--new-tokens", "12", "--gen-batch-size", "3", "--topk", "8",
            "--feature-layers", ",".join(map(str, LAYERS)), "--heldout-fraction", "0.4", "--threads", "1",
            "--max-prompt-tokens", "480", "--resume", *corpus_args()]
    assert main(args) == 0
    assert main([*args, "--every-kind"]) == 2


def test_an_eagle3_head_trains_on_captured_features_and_serves_losslessly(target, feature_dir, tmp_path):
    """`train eagle --data FEATURES` trains without transformers' target; the head records the file's sha256,
    serves beside that file with greedy output equal to plain decoding, and is refused beside another file."""
    from specserve import LLM, SamplingParams

    head = tmp_path / "head"
    assert main(["train", "eagle", "--target", str(target[1]), "--data", str(feature_dir), "--out", str(head),
                 "--max-steps", "3", "--batch-size", "2", "--draft-vocab", "64", "--threads", "1"]) == 0
    config = json.loads((head / "eagle_config.json").read_text())
    assert config["feature_layers"] == list(LAYERS) and config["draft_vocab_size"] == 64

    assert config["target"]["file_sha256"] == hashlib.sha256(target[1].read_bytes()).hexdigest()

    prompts = [[5, 17, 33, 2, 9], [40, 41, 42, 43]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target[1]), drafter=None, threads=1).generate(prompts, params)]
    spec = LLM(str(target[1]), drafter=f"eagle:{head}", speculation="static", threads=1)
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain
    # On 8-bit target products the head's own products run 8-bit too (its weights are a draft level's time).
    plain8 = [o.token_ids for o in LLM(str(target[1]), drafter=None, threads=1, quantization="int8").generate(prompts, params)]
    spec8 = LLM(str(target[1]), drafter=f"eagle:{head}", speculation="static", threads=1, quantization="int8")
    assert spec8.engine.drafter.head.kernels.fc.scales.size and spec8.engine.drafter.head.kernels.lm_head.scales.size
    assert not spec.engine.drafter.head.kernels.fc.scales.size
    assert [o.token_ids for o in spec8.generate(prompts, params)] == plain8
    # Beside 4-bit target layers they run 4-bit (Q4_1).
    spec4 = LLM(str(target[1]), drafter=f"eagle:{head}", speculation="static", threads=1, quantization="int4")
    assert spec4.engine.drafter.head.kernels.fc.storage == spec4.engine.drafter.head.kernels.lm_head.storage == "q4_1"
    assert spec8.engine.drafter.head.kernels.fc.storage == "int8"
    # ... unless the drafter's storage option says otherwise; a storage that does not exist is refused in one line.
    asked = LLM(str(target[1]), drafter=f"eagle:{head}", drafter_options={"storage": "int8"}, speculation="static",
                threads=1, quantization="int4")
    assert asked.engine.drafter.head.kernels.fc.storage == asked.engine.drafter.head.kernels.lm_head.storage == "int8"
    assert [o.token_ids for o in asked.generate(prompts, params)] == [
        o.token_ids for o in LLM(str(target[1]), drafter=None, threads=1, quantization="int4").generate(prompts, params)]
    with pytest.raises(ValueError, match="eagle drafter option storage must be one of"):
        LLM(str(target[1]), drafter=f"eagle:{head}", drafter_options={"storage": "int3"}, threads=1)

    other_hf = build_model(tmp_path / "other", "llama", hidden_size=64, layers=4, init_std=0.1, seed=1)
    other = write_gguf(other_hf, tmp_path / "other.gguf", "F32")
    with pytest.raises(ValueError, match="made for another target.*file_sha256"):
        LLM(str(other), drafter=f"eagle:{head}", threads=1)
    # The file names its tokenizer: a head recording the same file loads even where the tokenizer fingerprint it
    # recorded differs (another transformers version converts the file's tokenizer to other JSON).
    config["target"]["tokenizer"] = "0" * 64
    (head / "eagle_config.json").write_text(json.dumps(config))
    assert [o.token_ids for o in LLM(str(target[1]), drafter=f"eagle:{head}", speculation="static",
                                     threads=1).generate(prompts, params)] == plain
    with pytest.raises(ValueError, match="made for another target.*file_sha256"):
        LLM(str(other), drafter=f"eagle:{head}", threads=1)
    # Training on data captured from another file is refused too.
    assert main(["train", "eagle", "--target", str(other), "--data", str(feature_dir), "--out",
                 str(tmp_path / "bad")]) == 2


def test_stored_features_make_the_batch_the_loss_expects(feature_dir):
    """The soft labels are the stored top-k restricted to the draft vocabulary and renormalised (a float64
    reconstruction here), padded rows are masked out, and features come back in layer order."""
    from specserve.training.eagle import _StoredFeatures
    from specserve.training.feature_data import load_features

    data, _ = load_features(feature_dir, "train")
    draft_ids = torch.tensor(sorted(set(data.tokens.tolist()))[:40])
    batch = _StoredFeatures(draft_ids)(data, torch.tensor([0, 2]), torch.device("cpu"))
    lengths = data.lengths[[0, 2]]
    assert batch["mask"].sum(1).tolist() == lengths.tolist()
    assert len(batch["layers"]) == len(LAYERS)
    lo = int(data.offsets[2])
    for t in range(int(lengths[1])):
        probs = np.zeros(len(draft_ids))
        for tok, logp in zip(data.topk_ids[lo + t].tolist(), data.topk_logprobs[lo + t].double().tolist()):
            hits = (draft_ids == tok).nonzero()
            if len(hits):
                probs[int(hits[0])] += np.exp(logp)
        if probs.sum() > 0:
            np.testing.assert_allclose(batch["p"][1, t].numpy(), probs / probs.sum(), atol=1e-6)
        else:
            assert float(batch["p"][1, t].sum()) == 0.0
        assert int(batch["argmax"][1, t]) == int(data.topk_ids[lo + t, 0])
        torch.testing.assert_close(batch["layers"][2][1, t], data.features[lo + t, 2].float())
    assert not batch["mask"][0, int(lengths[0]):].any()


def test_medusa_heads_train_on_captured_features_and_serve_losslessly(target, feature_dir, tmp_path):
    """`train medusa --data FEATURES` reads the captured final normed layer (no transformers target): own LM
    heads over a draft vocabulary, recorded for the file's sha256, serving beside that file with greedy output
    equal to plain decoding, refused beside another file; data without the final layer is refused."""
    from specserve import LLM, SamplingParams

    heads = tmp_path / "heads"
    assert main(["train", "medusa", "--target", str(target[1]), "--data", str(feature_dir), "--out", str(heads),
                 "--heads", "2", "--lm-head", "own", "--draft-vocab", "64", "--max-steps", "4", "--batch-size", "2",
                 "--threads", "1"]) == 0
    config = json.loads((heads / "medusa_config.json").read_text())
    assert config["draft_vocab_size"] == 64 and config["num_heads"] == 2
    assert config["target"]["file_sha256"] == hashlib.sha256(target[1].read_bytes()).hexdigest()
    log = [json.loads(line) for line in (heads / "train_log.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in log if "loss" in r) and "h1_top1" in log[-1]

    prompts = [[5, 17, 33, 2, 9], [40, 41, 42, 43]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target[1]), drafter=None, threads=1).generate(prompts, params)]
    for options in ({}, {"tree": "dynamic", "topk": 2}):
        spec = LLM(str(target[1]), drafter=f"medusa:{heads}", drafter_options=options, speculation="static", threads=1)
        assert [o.token_ids for o in spec.generate(prompts, params)] == plain

    other_hf = build_model(tmp_path / "other", "llama", hidden_size=64, layers=4, init_std=0.1, seed=1)
    other = write_gguf(other_hf, tmp_path / "other.gguf", "F32")
    with pytest.raises(ValueError, match="trained for another target"):
        LLM(str(other), drafter=f"medusa:{heads}", threads=1)

    no_final = tmp_path / "no-final"
    no_final.mkdir()
    for f in feature_dir.iterdir():
        (no_final / f.name).symlink_to(f)
    (no_final / "feature_manifest.json").unlink()
    manifest = json.loads((feature_dir / "feature_manifest.json").read_text())
    (no_final / "feature_manifest.json").write_text(json.dumps({**manifest, "feature_layers": [1, 2, 3]}))
    assert main(["train", "medusa", "--target", str(target[1]), "--data", str(no_final), "--out",
                 str(tmp_path / "bad")]) == 2


def test_medusa_heads_fine_tune_into_parent_token_heads(target, feature_dir, tmp_path):
    """`--init-from` trained root-token heads with `--parent-token`: the new heads keep the first run's draft
    vocabulary, start from its weights (the parent products at zero: step 0's held-out metrics are the first run's
    last), are written as version 3, serve losslessly beside their file; options that do not fit the heads are
    refused with one line."""
    from safetensors.torch import load_file
    from specserve import LLM, SamplingParams

    common = ["--target", str(target[1]), "--data", str(feature_dir), "--heads", "2", "--lm-head", "own",
              "--draft-vocab", "64", "--root-token", "--batch-size", "2", "--threads", "1"]
    first, tuned = tmp_path / "first", tmp_path / "tuned"
    assert main(["train", "medusa", *common, "--out", str(first), "--max-steps", "4"]) == 0
    # A learning rate too small to move them: what is written is where the fine-tuning started.
    assert main(["train", "medusa", *common, "--out", str(tuned), "--max-steps", "2", "--parent-token",
                 "--init-from", str(first), "--lr", "1e-9"]) == 0
    config = json.loads((tuned / "medusa_config.json").read_text())
    assert config["version"] == 3 and config["parent_token"] is True and config["root_token"] is True
    was, now = (load_file(str(d / "medusa_heads.safetensors")) for d in (first, tuned))
    assert sorted(now) == sorted([*was, "parent_weight"]) and torch.equal(was["draft_to_target"], now["draft_to_target"])
    for name in ("weight", "bias", "lm_heads", "root_weight"):
        torch.testing.assert_close(now[name].float(), was[name].float(), atol=1e-3, rtol=0)
    assert now["parent_weight"].shape == (1, 64, 64) and float(now["parent_weight"].float().abs().max()) < 1e-3

    prompts = [[5, 17, 33, 2, 9], [40, 41, 42, 43]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target[1]), drafter=None, threads=1).generate(prompts, params)]
    spec = LLM(str(target[1]), drafter=f"medusa:{tuned}", speculation="static", threads=1)
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain
    assert main(["train", "medusa", *[a for a in common if a != "--root-token"], "--out", str(tmp_path / "bad"),
                 "--parent-token", "--max-steps", "1"]) == 2  # parent-token heads read the root token too
    wrong = [a if a != "2" else "3" for a in common]  # three heads from two
    assert main(["train", "medusa", *wrong, "--out", str(tmp_path / "bad2"), "--parent-token", "--init-from", str(first),
                 "--max-steps", "1"]) == 2


def test_captured_medusa_labels_and_loss_follow_their_definition(feature_dir):
    """A batch's labels are the stored top-k mapped into the draft vocabulary (the rest dropped), and each
    head's KL is sum_i p_i (log p_i - log q_i) over the renormalised labels of row t + k + 1, checked against
    a float64 loop over rows written here."""
    from specserve.drafters.medusa_heads import MedusaHeads
    from specserve.training.feature_data import load_features
    from specserve.training.medusa import _CapturedBatches, _head_terms, _Trainable

    data, manifest = load_features(feature_dir, "train")
    layer = manifest["feature_layers"].index(4)
    draft_ids = torch.tensor(sorted(set(data.tokens.tolist()))[:40])
    batch = _CapturedBatches(layer, draft_ids, 300)(data, torch.tensor([1, 0]), torch.device("cpu"))
    heads = MedusaHeads(64, 300, 2, 1, "own", len(draft_ids))
    heads.set_draft_vocab(draft_ids)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    module = _Trainable(heads, torch.zeros(0, 64), torch.zeros(0, 64))  # neither the LM head nor embeddings used
    reference = copy.deepcopy(heads).double()
    column = {int(t): j for j, t in enumerate(draft_ids)}
    for k in range(2):
        with torch.no_grad():
            _, kl, mask = _head_terms(module, batch, k)
        for row, seq in enumerate((1, 0)):
            lo, n = int(data.offsets[seq]), int(data.lengths[seq])
            for t in range(n - k - 1):
                label = lo + t + k + 1
                probs = {}
                for tok, logp in zip(data.topk_ids[label].tolist(), data.topk_logprobs[label].double().tolist()):
                    if tok in column:
                        probs[column[tok]] = probs.get(column[tok], 0.0) + np.exp(logp)
                assert bool(mask[row, t]) == bool(probs)
                if not probs:
                    assert float(kl[row, t]) == 0.0
                    continue
                total = sum(probs.values())
                with torch.no_grad():
                    logq = torch.log_softmax(reference(data.features[lo + t, layer].double(), heads=1, first=k)[0], -1)
                want = sum(p / total * (np.log(p / total) - float(logq[j])) for j, p in probs.items())
                assert abs(float(kl[row, t]) - want) < 1e-4, (k, row, t)
            assert not mask[row, n - k - 1:].any()


def test_a_draft_cut_from_all_its_targets_layers_is_the_target(target, tmp_path):
    """A draft that keeps every target layer and the whole vocabulary, untrained, written as `train draft --data`
    writes it (no embedding of its own) and loaded by the `draft` drafter beside the GGUF file, gives the target's
    logits: transformers' forward of the file is the reference. Checks the cut (layer copy), the saved files and
    the borrowed-embedding loader together; one layer left out changes them."""
    from transformers import AutoModelForCausalLM

    from specserve.drafters.base import TargetInfo
    from specserve.drafters.draft_model import load_on_target_embedding, read_draft_config
    from specserve.model import LlamaModel
    from specserve.training.draft_features import CutDraft, save_cut_draft
    from specserve.drafters.eagle_checkpoint import target_config

    gguf = target[1]
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    vocab = reference.config.vocab_size
    tokens = torch.tensor([[5, 17, 33, 2, 9, 40, 41]])
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits[0].double()
    engine_target = LlamaModel.from_pretrained(gguf, torch.device("cpu"), torch.float32, cpu_kernels=False)
    info = TargetInfo(vocab, 64, 4, torch.device("cpu"), torch.float32, model_dir=str(gguf), model=engine_target)
    for layers, same in (([0, 1, 2, 3], True), ([0, 1, 3], False)):
        draft = CutDraft.from_target(gguf, layers, torch.arange(vocab))
        with torch.no_grad():
            cut_logits = draft(tokens, torch.ones_like(tokens, dtype=torch.bool))[0].double()
        out = tmp_path / f"cut{len(layers)}"
        out.mkdir()
        save_cut_draft(draft, out, gguf, target_config(gguf), extra={})
        model, ids = load_on_target_embedding(out, info, None, read_draft_config(out))
        assert torch.equal(ids, torch.arange(vocab))
        assert model.embed.data_ptr() == engine_target.embed.data_ptr()  # borrowed, not copied
        served = _full_forward(model, tokens[0])
        for logits, tol in ((cut_logits, 1e-4), (served, 5e-3)):  # served: float16 files
            assert torch.allclose(logits, expected, atol=tol) == same


def _full_forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """The engine model's logits float64[T, V] at every position of one sequence (its own KV cache)."""
    from specserve.kv_cache import BlockAllocator
    from specserve.step_batch import StepBatchBuilder

    allocator = BlockAllocator(64, 16)
    cache = model.new_cache(allocator)
    allocator.allocate("r", len(tokens))
    batch = StepBatchBuilder(allocator)
    batch.add("r", 0, tokens.numpy().astype(np.int64), logits="all")
    with torch.no_grad():
        return model.forward(batch.build(), cache).logits.double()


def test_a_draft_model_trains_on_captured_features_and_serves_losslessly(target, feature_dir, tmp_path):
    """`train draft --data FEATURES` cuts a draft from the GGUF target's layers with a draft vocabulary, records
    the file's sha256, serves beside that file (chain and tree) with greedy output equal to plain decoding, and is
    refused beside another file; bad options are refused in one line."""
    from specserve import LLM, SamplingParams

    draft = tmp_path / "draft"
    assert main(["train", "draft", "--target", str(target[1]), "--data", str(feature_dir), "--out", str(draft),
                 "--init-layers", "0,3", "--draft-vocab", "64", "--max-steps", "4", "--batch-size", "2",
                 "--storage", "int8", "--threads", "1"]) == 0
    config = json.loads((draft / "draft_config.json").read_text())
    assert config["embedding"] == "target" and config["init_layers"] == [0, 3] and config["storage"] == "int8"
    assert config["target"]["file_sha256"] == hashlib.sha256(target[1].read_bytes()).hexdigest()
    from safetensors.torch import load_file

    weights = load_file(str(draft / "model.safetensors"))
    assert "model.embed_tokens.weight" not in weights and weights["lm_head.weight"].shape == (64, 64)
    assert weights["lm_head.weight"].dtype == torch.int8 and weights["model.norm.weight"].dtype == torch.float16
    log = [json.loads(line) for line in (draft / "train_log.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in log if "loss" in r) and "chain2" in log[-1]

    prompts = [[5, 17, 33, 2, 9], [40, 41, 42, 43]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target[1]), drafter=None, threads=1).generate(prompts, params)]
    for options in ({"depth": 3}, {"depth": 3, "topk": 2, "width": 2}):
        spec = LLM(str(target[1]), drafter=f"draft:{draft}", drafter_options=options, speculation="static", threads=1)
        assert [o.token_ids for o in spec.generate(prompts, params)] == plain
    int4 = LLM(str(target[1]), drafter=f"draft:{draft}", drafter_options={"depth": 3, "storage": "q4_1"},
               speculation="static", threads=1)
    assert {p.storage for p in int4.engine.drafter.model.kernels.products()} == {"q4_1"}  # the option, beside F32
    assert [o.token_ids for o in int4.generate(prompts, params)] == plain
    with pytest.raises(ValueError, match="draft drafter option storage must be one of"):
        LLM(str(target[1]), drafter=f"draft:{draft}", drafter_options={"storage": "int3"}, threads=1)
    described = spec.engine.drafter.describe()  # what `specserve info --drafter` prints
    assert (described["layers"], described["draft_vocabulary"]) == (2, 64)
    assert described["embedding"] == "the target's (borrowed)"

    other_hf = build_model(tmp_path / "other", "llama", hidden_size=64, layers=4, init_std=0.1, seed=1)
    other = write_gguf(other_hf, tmp_path / "other.gguf", "F32")
    with pytest.raises(ValueError, match="cut from another target"):
        LLM(str(other), drafter=f"draft:{draft}", threads=1)
    for bad in (["--init-layers", "0,9"], ["--init-layers", "0,x"], ["--preset", "tiny"], ["--draft-vocab", "0"]):
        assert main(["train", "draft", "--target", str(target[1]), "--data", str(feature_dir), "--out",
                     str(tmp_path / "bad"), "--force", *bad]) == 2
