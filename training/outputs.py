"""Output directories and model files shared by the training commands.

An output directory that exists and is not empty is refused unless the run resumes (``--resume``) or
overwrites (``--force``, which removes only the files the training commands write there).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from specserve.training.presets import Preset
from specserve.training.tokenizer import TOKENIZER_FILES

MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json", *TOKENIZER_FILES)
RUN_FILES = ("checkpoint", "data", "train_log.jsonl", "loss_curve.png", "corpus_manifest.json", "train_summary.json",
             "run_config.json", "draft_config.json", "distill", "distill_manifest.json", "shards")


def prepare_out_dir(out_dir: Path, *, resume: bool, force: bool, what: str = "output directory") -> Path:
    """Check and create ``out_dir`` for a fresh run, a resumed run (``resume``) or an overwrite (``force``)."""
    out_dir = Path(out_dir).expanduser()
    check_run_options(resume=resume, force=force)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{what} {str(out_dir)!r} exists and is not a directory")
    if resume:
        if not out_dir.is_dir():
            raise ValueError(f"--resume: {what} {str(out_dir)!r} does not exist")
        return out_dir
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise ValueError(
                f"{what} {str(out_dir)!r} exists and is not empty: pass --resume to continue its run or --force to overwrite it"
            )
        for name in (*MODEL_FILES, *RUN_FILES):
            target = out_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def save_hf_model(model, out_dir: Path, eos_token_id: int) -> None:
    """``config.json`` + ``model.safetensors`` (transformers' own writer) and ``generation_config.json``."""
    from transformers import GenerationConfig

    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id, bos_token_id=None).save_pretrained(str(out_dir))


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def write_shard(path: Path, tensors: dict) -> None:
    """Write a safetensors shard atomically (a temporary file renamed over ``path``): an interrupted run
    leaves whole shards only, which is what ``--resume`` counts on."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from exc


def check_run_options(*, resume: bool, force: bool, stop_at_step: int | None = None) -> None:
    """The checks every training command makes of its run options, before any work."""
    if resume and force:
        raise ValueError("--resume and --force contradict each other: pick one")
    if stop_at_step is not None and stop_at_step < 1:
        raise ValueError(f"stop_at_step must be >= 1, got {stop_at_step}")


def read_run_config(out_dir: Path, what: str = "a training run") -> dict:
    """The ``run_config.json`` of the run in ``out_dir`` (for ``--resume``)."""
    if not out_dir.is_dir():
        raise ValueError(f"--resume: {str(out_dir)!r} does not exist")
    path = out_dir / "run_config.json"
    if not path.is_file():
        raise ValueError(f"--resume: {str(out_dir)!r} has no run_config.json (is it {what}?)")
    return read_json(path)


def recorded_preset(out_dir: Path, preset: str | None):
    """The recipe a run in ``out_dir`` was started with (its ``run_config.json``)."""
    recorded = Preset.from_dict(read_run_config(out_dir)["preset"])
    if preset is not None and preset != recorded.name:
        raise ValueError(f"--resume: the run in {str(out_dir)!r} uses preset {recorded.name!r}, not {preset!r}")
    return recorded
