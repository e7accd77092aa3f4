"""The set-up every training entry point shares (`train_lm`, `train_draft`, `train_medusa`, `train_eagle`).

- `RunOptions`: the run options each of them takes as keywords (device, budget, resume/force, the
  training-setting overrides, ``stop_at_step``, ``argv``), checked once;
- `distributed_run`: the process group for the run's lifetime (torn down on errors too);
- `start_drafter_run`: a drafter's run on its target's self-distillation data — the output directory,
  the recorded run configuration, the data (generated into ``OUT/distill`` when none is given), loaded;
- `run_trainer` and `finish_run`: the timed training loop, then the loss curve and ``train_summary.json``.

Each entry point keeps what is its own: its model, its losses and metrics, its outputs.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

from specserve.training.outputs import check_run_options, prepare_out_dir, write_json

SUMMARY_FILE = "train_summary.json"
RUN_CONFIG_FILE = "run_config.json"
_SETTING_OVERRIDES = ("max_steps", "batch_size", "lr", "seed", "max_minutes")


@dataclass(frozen=True)
class RunOptions:
    """The options of one training run that every entry point takes (as keyword arguments).

    device: ``auto`` | ``cpu`` | ``cuda``; max_minutes: the wall-clock budget; resume: continue the run in
    the output directory; force: overwrite its run files; max_steps, batch_size, lr, seed: override the
    recipe's training settings (None: keep them); stop_at_step: stop cleanly after this step; argv: the
    command line, recorded with the run.
    """

    device: str = "auto"
    max_minutes: float | None = None
    resume: bool = False
    force: bool = False
    max_steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int | None = None
    stop_at_step: int | None = None
    argv: list[str] | None = None

    @classmethod
    def of(cls, caller: str, options: dict) -> "RunOptions":
        """The options ``caller`` was given as keywords (TypeError naming it for an unknown one), checked."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
        run = cls(**options)
        check_run_options(resume=run.resume, force=run.force, stop_at_step=run.stop_at_step)
        return run

    def overrides(self) -> dict:
        """The training settings this run overrides (those given)."""
        return {name: getattr(self, name) for name in _SETTING_OVERRIDES if getattr(self, name) is not None}


@contextlib.contextmanager
def distributed_run(device: str, single_process: str | None = None) -> Iterator:
    """This process's `DistInfo` for the run (torchrun's process group, torn down at the end, errors
    included); ``single_process``: the command's name when it refuses to run under torchrun."""
    from specserve.training.trainer import setup_distributed, teardown_distributed

    dist = setup_distributed(device)
    try:
        if single_process is not None and dist.world > 1:
            raise ValueError(f"{single_process} runs as a single process, not under torchrun")
        yield dist
    finally:
        teardown_distributed(dist)


def distill_settings_for(data, distill_settings, max_positions: int, vocab_size: int):
    """The settings of the data a drafter run generates (None when it is given ``data``), validated."""
    if data is not None:
        return distill_settings
    from specserve.training.distill import DistillSettings

    return (distill_settings or DistillSettings()).validate(max_positions, vocab_size)


def run_record(command: str, run: RunOptions, dist, target_dir: Path, data, **fields) -> dict:
    """A drafter run's ``run_config.json``: the command, its line, target, data and device, then ``fields``."""
    return {"command": command, "argv": run.argv, "target": str(target_dir),
            "data": str(data) if data is not None else None, "device": str(dist.device), **fields}


def start_drafter_run(dist, run: RunOptions, target_dir: Path, out_dir: Path, data, distill_settings, *,
                      run_config: dict | None = None, own_files: tuple[str, ...] = ()):
    """Prepare a drafter run on ``target_dir``'s self-distillation data; return (data_dir, train set,
    held-out set or None, data manifest).

    The main process prepares ``out_dir`` (``force`` also removes ``own_files``, the outputs the
    shared list does not know), writes ``run_config`` for a fresh run and, without ``data``, generates
    the run's own data in ``OUT/distill`` (completing a partial one); then every process loads it.
    """
    from specserve.training.distill import load_training_distill, make_run_distill_data, run_distill_dir
    from specserve.training.trainer import barrier

    if dist.is_main:
        prepare_out_dir(out_dir, resume=run.resume, force=run.force)
        if run.force:
            for name in own_files:
                (out_dir / name).unlink(missing_ok=True)
        if run_config is not None and not run.resume:
            write_json(out_dir / RUN_CONFIG_FILE, run_config)
        if data is None:
            make_run_distill_data(target_dir, out_dir, distill_settings, run.device)
    barrier(dist)
    data_dir = run_distill_dir(out_dir, data)
    train_set, heldout_set, manifest = load_training_distill(data_dir, target_dir, warn=dist.is_main)
    return data_dir, train_set, heldout_set, manifest


def start_feature_run(dist, run: RunOptions, target: Path, out_dir: Path, data, own_files: tuple[str, ...] = ()):
    """`start_drafter_run` for captured feature data (training/feature_data.py): prepare ``out_dir``, load
    the data; return (data_dir, train set, held-out set or None, manifest). ValueError when the data was
    captured from another target than ``target``."""
    from specserve.drafters.eagle_checkpoint import fingerprint_mismatch
    from specserve.training.feature_data import load_features
    from specserve.training.trainer import barrier

    if dist.is_main:
        prepare_out_dir(out_dir, resume=run.resume, force=run.force)
        if run.force:
            for name in own_files:
                (out_dir / name).unlink(missing_ok=True)
    barrier(dist)
    data_dir = Path(data).expanduser()
    train_set, manifest = load_features(data_dir, "train")
    heldout_set, _ = load_features(data_dir, "heldout")
    if train_set is None:
        raise ValueError(f"{str(data_dir)!r} holds no training sequences")
    key = fingerprint_mismatch(manifest.get("target", {}), target, keys=("file_sha256", "config_sha256"))
    if key is not None:
        raise ValueError(f"the feature data in {str(data_dir)!r} was captured from another target than "
                         f"{str(target)!r} ({key} differs)")
    if dist.is_main and not manifest.get("complete", False):
        print("warning: the feature data is incomplete (its run stopped early)", file=sys.stderr)
    return data_dir, train_set, heldout_set, manifest


def run_trainer(trainer, run: RunOptions) -> tuple[dict, float]:
    """Run (or resume) ``trainer``'s loop; return its summary and when it started (perf_counter)."""
    started = time.perf_counter()
    return trainer.run(resume=run.resume, stop_at_step=run.stop_at_step), started


def finish_run(out_dir: Path, summary: dict, started: float, title: str, **fields) -> list[dict]:
    """Plot the loss curve (``loss_curve.png``, titled ``title``), complete ``summary`` with ``fields``,
    this session's wall time and the first and last loss, write it to ``train_summary.json``; return
    the log's records."""
    from specserve.training.plots import plot_loss_curve
    from specserve.training.trainer import LOG_FILE, read_log

    records = read_log(out_dir / LOG_FILE)
    plot_loss_curve(records, out_dir / "loss_curve.png", title)
    losses = [r["loss"] for r in records if "loss" in r]
    summary.update(fields)
    summary.update({"wall_seconds_this_session": round(time.perf_counter() - started, 2),
                    "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None})
    write_json(out_dir / SUMMARY_FILE, summary)
    return records
