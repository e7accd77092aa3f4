"""`specserve train ship` and how the default model finds its shipped drafters (no model is loaded here:
the runs are stand-ins with the files a finished `train eagle` run leaves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve import default_model_drafters
from specserve.bundle_paths import default_drafter, resolve_drafter_path
from specserve.cli import main
from specserve.loading.default_model import SHA256, default_model_file


def _run(tmp_path: Path, sha256: str, size: int = 1000) -> Path:
    run = tmp_path / f"run-{sha256[:6]}"
    run.mkdir()
    (run / "eagle_config.json").write_text(json.dumps({"target": {"file_sha256": sha256}}))
    (run / "eagle_head.safetensors").write_bytes(b"\0" * size)
    (run / "run_config.json").write_text(json.dumps({"argv": ["train", "eagle"], "data": None}))
    (run / "train_summary.json").write_text(json.dumps({"step": 7, "last_eval": {"tau_chain": 2.5}}))
    return run


@pytest.fixture
def shipped(tmp_path, monkeypatch) -> Path:
    out = tmp_path / "shipped"
    monkeypatch.setattr(default_model_drafters, "drafters_dir", lambda: out)
    return out


def test_ship_writes_the_manifest_and_the_default_model_resolves_its_drafters(tmp_path, shipped):
    assert main(["train", "ship", "--eagle", str(_run(tmp_path, SHA256)), "--default-drafter", "hybrid:eagle+ngram",
                 "--out", str(shipped)]) == 0
    manifest = json.loads((shipped / "MANIFEST.json").read_text())
    assert manifest["target"]["sha256"] == SHA256 and manifest["drafters"] == {"eagle": "eagle"}
    assert manifest["training"]["eagle"]["steps"] == 7
    assert sorted(p.name for p in (shipped / "eagle").iterdir()) == ["eagle_config.json", "eagle_head.safetensors"]
    model = default_model_file()
    assert resolve_drafter_path("eagle", model) == str(shipped / "eagle")
    assert default_drafter(model) == "hybrid:eagle+ngram"
    assert resolve_drafter_path("eagle", tmp_path / "another.gguf") is None


def test_a_manifest_for_another_file_or_naming_a_missing_drafter_is_not_used(tmp_path, shipped):
    shipped.mkdir()
    (shipped / "eagle").mkdir()
    (shipped / "eagle" / "eagle_config.json").write_text("{}")
    record = {"target": {"sha256": "0" * 64}, "drafters": {"eagle": "eagle"}, "default_drafter": "eagle"}
    (shipped / "MANIFEST.json").write_text(json.dumps(record))
    assert default_drafter(default_model_file()) == default_model_drafters.FALLBACK_DRAFTER
    assert resolve_drafter_path("eagle", default_model_file()) is None
    record["target"]["sha256"] = SHA256
    record["default_drafter"] = "medusa"  # not shipped
    (shipped / "MANIFEST.json").write_text(json.dumps(record))
    assert default_drafter(default_model_file()) == default_model_drafters.FALLBACK_DRAFTER
    assert resolve_drafter_path("eagle", default_model_file()) == str(shipped / "eagle")


@pytest.mark.parametrize("case", ["other target", "too big", "nothing"])
def test_ship_refuses_with_one_line(tmp_path, shipped, capsys, case):
    args = ["train", "ship", "--default-drafter", "eagle", "--out", str(shipped)]
    if case == "other target":
        args += ["--eagle", str(_run(tmp_path, "f" * 64))]
    elif case == "too big":
        args += ["--eagle", str(_run(tmp_path, SHA256, size=2_000_000)), "--size-limit-mb", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not shipped.exists()


def test_a_draft_model_ships_with_its_four_files_and_resolves_by_name(tmp_path, shipped):
    """A `train draft --data` run ships config, weights, draft vocabulary and draft_config (which names the file);
    one cut from another file is refused."""
    run = tmp_path / "draft-run"
    run.mkdir()
    (run / "draft_config.json").write_text(json.dumps({"embedding": "target", "target": {"file_sha256": SHA256}}))
    for name in ("config.json", "model.safetensors", "draft_vocab.safetensors"):
        (run / name).write_bytes(b"{}")
    (run / "run_config.json").write_text(json.dumps({"argv": ["train", "draft"], "data": None}))
    (run / "train_summary.json").write_text(json.dumps({"step": 3, "last_eval": {"chain1": 0.5}}))
    assert main(["train", "ship", "--draft", str(run), "--default-drafter", "suffix", "--out", str(shipped)]) == 0
    assert sorted(p.name for p in (shipped / "draft").iterdir()) == ["config.json", "draft_config.json",
                                                                     "draft_vocab.safetensors", "model.safetensors"]
    assert resolve_drafter_path("draft", default_model_file()) == str(shipped / "draft")
    (run / "draft_config.json").write_text(json.dumps({"embedding": "target", "target": {"file_sha256": "0" * 64}}))
    assert main(["train", "ship", "--draft", str(run), "--default-drafter", "suffix", "--out", str(shipped)]) == 2
