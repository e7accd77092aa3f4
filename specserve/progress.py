"""Start-up progress: one line per loading phase on stderr, for the CLI (`generate`, `serve`).

Off unless `enable()` is called (the Python API stays silent): `specserve generate` and `serve` turn it
on when stderr is a terminal, and `--quiet` / `--json` leave it off (so a pipe or a log gets no progress
lines, and bad input is still one line). Each phase prints its name when it starts and its time when it
ends, on one line:

    specserve: importing torch… 0.9 s
    specserve: loading model (ngram drafter)… 0.4 s
    specserve: compiling kernels (first run only, cached for the next)… 11.8 s
    specserve: calibrating speculation… 0.1 s

Kept free of heavy imports (the CLI imports it before torch).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import TextIO

_stream: TextIO | None = None


def enable(stream: TextIO | None = None) -> None:
    """Report phases to `stream` (default stderr) from now on."""
    global _stream
    _stream = stream if stream is not None else sys.stderr


_pending: tuple[str, float] | None = None  # the phase whose line is open (its name and start time)


def begin(name: str) -> None:
    """Start a phase: print ``specserve: NAME… `` (its time follows when `end` is called)."""
    global _pending
    abort()
    _pending = (name, time.perf_counter())
    if _stream is not None:
        _stream.write(f"specserve: {name}… ")
        _stream.flush()


def end(detail: str | None = None) -> float:
    """End the open phase: print its time (and ``(detail)``); returns the seconds it took."""
    global _pending
    if _pending is None:
        return 0.0
    elapsed = time.perf_counter() - _pending[1]
    _pending = None
    if _stream is not None:
        _stream.write(f"{elapsed:.1f} s{f' ({detail})' if detail else ''}\n")
        _stream.flush()
    return elapsed


def abort() -> None:
    """Close a phase that failed: on a terminal its line is erased (the error that follows is the one
    line shown about it); elsewhere it ends with "failed"."""
    global _pending
    if _pending is None:
        return
    _pending = None
    if _stream is not None:
        _stream.write("\r\033[K" if _isatty(_stream) else "failed\n")
        _stream.flush()


@contextmanager
def suspended():
    """Print nothing inside (an inner LLM's phases while an outer phase's line is open)."""
    global _stream, _pending
    saved = _stream, _pending
    _stream, _pending = None, None
    try:
        yield
    finally:
        _stream, _pending = saved


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
