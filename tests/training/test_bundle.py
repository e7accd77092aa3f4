"""The embedded bundle: paths API (absent and present), orchestration with finished stages, export."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from specserve import bundle_paths
from specserve.training.bundle import build_bundle
from specserve.training.distill import DistillSettings
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.cli import main

# The fixture's distillation settings (tests/training/conftest.py), so the stage counts as done.
FIXTURE_DISTILL = DistillSettings(num_prompts=24, heldout_prompts=8, prompt_tokens=16, new_tokens=32, batch_size=12, topk=8)


def test_paths_without_a_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv(bundle_paths.ENV_VAR, str(tmp_path / "nothing-here"))
    assert bundle_paths.default_model_dir() is None
    assert bundle_paths.default_drafters() == {}
    assert bundle_paths.bundle_manifest() is None
    assert not bundle_paths.is_default_model(tmp_path)
    assert bundle_paths.resolve_drafter_path("draft", tmp_path) is None


def test_package_bundle_location(monkeypatch):
    monkeypatch.delenv(bundle_paths.ENV_VAR, raising=False)
    import specserve

    assert bundle_paths.bundle_dir() == __import__("pathlib").Path(specserve.__file__).parent / "bundle"


@pytest.fixture(scope="module")
def bundle(trained_lm, distill_dir, trained_draft, tmp_path_factory):
    """build_bundle over a work directory whose three training stages are already finished."""
    work = tmp_path_factory.mktemp("work")
    shutil.copytree(trained_lm, work / "target")
    shutil.copytree(distill_dir, work / "distill")
    shutil.copytree(trained_draft, work / "draft")
    out = work.parent / (work.name + "-bundle")
    manifest = build_bundle(work=work, bundle_dir=out, lm_preset="tiny", draft_preset="tiny", distill=FIXTURE_DISTILL,
                            device="cpu", resume=True, seed=0, head_max_steps=4,
                            argv=["train", "bundle", "--lm-preset", "tiny"])
    return out, manifest, work


def test_bundle_layout_and_manifest(bundle):
    out, manifest, _ = bundle
    on_disk = json.loads((out / "MANIFEST.json").read_text())
    assert on_disk["command"] == "specserve train bundle --lm-preset tiny" and on_disk["seed"] == 0
    assert on_disk["default_model"] == "target"
    assert on_disk["default_drafters"] == {"draft": "draft", "medusa": "medusa", "eagle": "eagle"}
    assert on_disk["default_drafter"] == "eagle"
    assert len(on_disk["corpus"]["sha256"]) == 64
    assert on_disk["size_mb"] <= 48 and on_disk["size_mb"] == manifest["size_mb"]
    metrics = on_disk["metrics"]
    assert "eval_loss" in metrics["target"]["eval"] and "accept_t1" in metrics["draft"]["eval"]
    for name in ("draft", "medusa", "eagle"):
        assert metrics["acceptance"][name]["tau_greedy"] >= 1.0 and metrics["acceptance"][name]["tau_t1"] >= 1.0
        assert name == "draft" or metrics[name]["step"] == 4
    for model in ("target", "draft"):
        with safe_open(str(out / model / "model.safetensors"), "pt") as f:
            assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
        assert (out / model / "tokenizer.json").is_file()
    assert json.loads((out / "draft" / "draft_config.json").read_text())["target"] == "../target"
    assert not (out / "target" / "checkpoint").exists()  # weights only, no optimiser state


def test_bundle_is_the_default_model_and_draft(bundle, monkeypatch):
    out, _, work = bundle
    monkeypatch.setenv(bundle_paths.ENV_VAR, str(out))
    assert bundle_paths.default_model_dir() == out / "target"
    assert bundle_paths.default_drafters() == {name: str(out / name) for name in ("draft", "eagle", "medusa")}
    assert bundle_paths.default_drafter(out / "target") == "eagle" and bundle_paths.default_drafter(work / "target") is None
    assert bundle_paths.is_default_model(out / "target") and not bundle_paths.is_default_model(work / "target")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(out / "target", device="cpu").generate(["import json\n"], params)[0]
    for name in ("draft", "medusa", "eagle"):  # bare names resolve to the bundle's drafters
        spec = LLM(out / "target", drafter=name, device="cpu", speculation="static").generate(["import json\n"], params)[0]
        assert plain.token_ids == spec.token_ids
    auto = LLM(out / "target", device="cpu")
    assert auto.drafter_spec == "eagle" and auto.generate(["import json\n"], params)[0].token_ids == plain.token_ids
    assert LLM(out / "target", drafter="none", device="cpu").drafter_spec is None
    # fp16 on disk changes the weights a little; transformers still loads the bundle.
    hf = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
    assert hf.config.vocab_size == json.loads((work / "target" / "config.json").read_text())["vocab_size"]


def test_existing_bundles_and_foreign_directories_are_protected(bundle, tmp_path, capsys):
    out, _, work = bundle
    with pytest.raises(ValueError, match="already exists"):
        build_bundle(work=work, bundle_dir=out)  # --resume (rebuild from the work directory) may replace it
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="refusing to replace"):
        build_bundle(work=work, bundle_dir=tmp_path / "mine", force=True)
    assert main(["train", "bundle", "--work", str(work), "--bundle-dir", str(tmp_path / "b"), "--size-limit-mb", "0"]) == 2
    assert "size_limit_mb" in capsys.readouterr().err
    assert main(["train", "bundle", "--work", str(work), "--bundle-dir", str(tmp_path / "b")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_default_drafter_is_chosen_by_measurement(tmp_path, monkeypatch):
    """`specserve train default-drafter`: the candidates run the held-out eval at batch 1 greedy; the
    fastest becomes the bundle's default (`drafter="auto"`), with the table recorded beside it."""
    from specserve.evals.default_drafter import pick_default_drafter, table_markdown

    if bundle_paths.default_model_dir() is None:
        pytest.skip("the embedded bundle is not installed")
    copy = tmp_path / "bundle"
    shutil.copytree(bundle_paths.bundle_dir(), copy)
    monkeypatch.setenv(bundle_paths.ENV_VAR, str(copy))
    # Two eligible candidates (ngram, lookahead), so the choice between them is the measurement's.
    record = pick_default_drafter(["ngram", "lookahead", "hybrid:suffix+medusa", "eagle:/elsewhere"], str(tmp_path / "run"),
                                  model="tiny", max_prompts=1, max_tokens=8, repeats=1)
    assert set(record["candidates"]) == {"ngram", "lookahead", "hybrid:suffix+medusa"}
    assert record["not_run"] == ["eagle:/elsewhere"]
    table = record["candidates"]
    assert record["not_eligible"] == ["hybrid:suffix+medusa"]  # it learns across requests: seeds would not reproduce
    assert record["default_drafter"] in _documented_choice(table, eligible=["ngram", "lookahead"])
    best = record["default_drafter"]
    manifest = json.loads((copy / "MANIFEST.json").read_text())
    assert manifest["default_drafter"] == best and manifest["default_drafter_eval"]["dataset"] == "builtin:heldout-code"
    assert bundle_paths.default_drafter(copy / "target") == best
    from specserve import LLM

    assert LLM(drafter="auto").drafter_spec == best
    assert f"`{best}` **(default)**" in table_markdown(record)


def _documented_choice(table: dict, eligible: list[str]) -> set[str]:
    """The default the documented rule (module docstring of default_drafter.py, README) picks from a
    recorded table, computed here independently: of the eligible candidates, those measured at temperature 1
    with at least 0.97x plain there (all eligible when none is), and among them those whose speedup is within
    2 % (0.02) of the fastest's are a tie, which goes to the highest τ. A set: the rule does not say which of two
    tied candidates with the same τ wins."""
    eligible = [n for n in eligible if table[n].get("sampled_speedup", 0.0) >= 0.97] or eligible
    fastest = max(table[n]["speedup"] for n in eligible)
    tied = [n for n in eligible if table[n]["speedup"] >= fastest - 0.02]
    top_tau = max(table[n]["tau"] for n in tied)
    return {n for n in tied if table[n]["tau"] == top_tau}


@pytest.mark.parametrize("figures,expected", [
    # speedup, τ per candidate; hybrid:suffix+medusa is the fastest but learns across requests.
    ({"ngram": (1.00, 1.2), "lookahead": (0.99, 1.8), "draft": (0.90, 3.0)}, "lookahead"),  # a tie: higher τ
    ({"ngram": (1.00, 1.2), "lookahead": (0.97, 1.8), "draft": (0.90, 3.0)}, "ngram"),      # 3 % slower: no tie
    ({"ngram": (0.95, 1.2), "lookahead": (0.93, 1.8), "draft": (0.96, 1.0)}, "ngram"),      # the tie's τ, not the fastest
])
def test_default_drafter_rule_on_recorded_figures(tmp_path, monkeypatch, figures, expected):
    """The choice on fixed figures (the eval replaced by a table), where the TIE rule decides."""
    import specserve.evals.suite as suite
    from specserve.evals.default_drafter import pick_default_drafter

    if bundle_paths.default_model_dir() is None:
        pytest.skip("the embedded bundle is not installed")
    copy = tmp_path / "bundle"
    shutil.copytree(bundle_paths.bundle_dir(), copy)
    monkeypatch.setenv(bundle_paths.ENV_VAR, str(copy))
    figures = figures | {"hybrid:suffix+medusa": (1.30, 4.0)}

    def fake_eval(cfg):  # the greedy run of every candidate, then the eligible leaders at temperature 1
        assert sorted(cfg.drafters) == sorted(figures) if not cfg.temperature else set(cfg.drafters) <= set(figures)
        return {"drafters": {n: {"speedup": s, "tau": t, "tokens_per_s": 100 * s, "identical_fraction": 1.0}
                             for n, (s, t) in figures.items()},
                "settings": {"num_prompts": 1}, "plain": {"tokens_per_s": 100.0}, "machine": {}}

    monkeypatch.setattr(suite, "run_eval", fake_eval)
    record = pick_default_drafter(list(figures), str(tmp_path / "run"), model="tiny")
    assert record["default_drafter"] == expected
    assert _documented_choice(record["candidates"], ["ngram", "lookahead", "draft"]) == {expected}  # the cases are right
    assert json.loads((copy / "MANIFEST.json").read_text())["default_drafter"] == expected
