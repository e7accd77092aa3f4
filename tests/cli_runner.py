"""Running `specserve` from a test: in a process of its own (`run`), or through the console script's `main()`
in the test's process (`cli`), where torch, the tiny model and its kernels are already loaded (~1 s a command
instead of a process start's ~6 s). Tests about the process itself (what a pipe gets, errors before torch
loads, README's command as written) use `run`; the rest `cli`."""

from __future__ import annotations

import subprocess
import sys

from tiny_models import cli_env


def run(*args: str) -> subprocess.CompletedProcess:
    """`specserve ARGS` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "specserve", *args], capture_output=True, text=True, timeout=120,
                          env=cli_env())


def cli(capsys, *args: str) -> subprocess.CompletedProcess:
    """`specserve ARGS` through `main()` in this process (capsys: pytest's fixture): its exit status and what it
    printed."""
    from specserve.cli import main

    capsys.readouterr()  # what earlier steps printed is not this command's
    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), status, printed.out, printed.err)
