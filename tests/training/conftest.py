"""Fixtures: a tiny LM trained end to end on a slice of the stdlib, its distillation data and draft model.

Session-scoped and small (tens of optimiser steps on short sequences): enough for the loss to fall and
for every file and code path to exist, not for a useful model.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from specserve.cli import main

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SLICE = ["json", "email", "argparse.py", "textwrap.py", "csv.py", "shlex.py", "copy.py"]
LM_ARGS = ["--preset", "tiny", "--max-steps", "24", "--batch-size", "8", "--seq-len", "64"]


def corpus_args() -> list[str]:
    args = []
    for name in SLICE:
        args += ["--corpus", str(STDLIB / name)]
    return args


@pytest.fixture(scope="session")
def lm_argv() -> list[str]:
    """``train lm`` arguments of the fixture run, without --out: preset, bounded steps, corpus slice."""
    return [*LM_ARGS, *corpus_args()]


@pytest.fixture(scope="session")
def trained_lm(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm") / "tiny"
    assert main(["train", "lm", *LM_ARGS, "--out", str(out), *corpus_args()]) == 0
    return out


@pytest.fixture(scope="session")
def distill_dir(trained_lm, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distill") / "data"
    assert main(["train", "distill-data", "--target", str(trained_lm), "--out", str(out), "--num-prompts", "24",
                 "--heldout-prompts", "8", "--prompt-tokens", "16", "--new-tokens", "32", "--gen-batch-size", "12",
                 "--topk", "8", "--device", "cpu"]) == 0
    return out


@pytest.fixture(scope="session")
def trained_draft(trained_lm, distill_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "tiny"
    assert main(["train", "draft", "--preset", "tiny", "--target", str(trained_lm), "--data", str(distill_dir),
                 "--out", str(out), "--max-steps", "20", "--batch-size", "8"]) == 0
    return out
