"""Small pieces the `specserve bench` commands and `specserve eval` share."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def sync(device) -> None:
    """Wait for queued CUDA work on `device` (a no-op elsewhere), so a timer reads finished work."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_threads(threads: int | None) -> None:
    """--threads: the CPU kernels' threads and torch's (None keeps the default: every core)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    from specserve.kernels import set_threads as set_kernel_threads

    set_kernel_threads(threads)


def write_json(result: dict, path: str | None) -> None:
    """--json FILE: the figures, indented; nothing when no file was asked for."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2))


def model_label(model: str | None) -> str:
    """What a report calls the target: the path or name given, else the default model's description."""
    from specserve.loading.default_model import DESCRIPTION

    return model or DESCRIPTION


def host() -> dict:
    """The platform string and processor of this machine."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine()}


def machine(llm) -> dict:
    """What a benchmark ran on: the host, thread counts and versions, and `llm`'s device and dtype."""
    import torch

    from specserve.kernels import get_threads

    return host() | {"threads": get_threads(), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                     "torch": torch.__version__, "python": platform.python_version(),
                     "device": str(llm.device), "dtype": str(llm.dtype)}


@contextlib.contextmanager
def use_model_dir(model: str | None, build: Callable[[Path], Path], what: str) -> Iterator[Path]:
    """`model` as a Path, or (None) a model `build` writes into a temporary directory removed on exit."""
    if model is not None:
        yield Path(model)
        return
    with tempfile.TemporaryDirectory() as tmp:
        built = build(Path(tmp))
        print(f"built {what} in {built}", file=sys.stderr)
        yield built


def parse_batch_sizes(text: str) -> list[int]:
    """`--batch-sizes 1,4,16` → sorted distinct sizes, each >= 1."""
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--batch-sizes expects comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batch-sizes must be integers >= 1, got {text!r}")
    return sizes


def check_positive(args, *names: str) -> None:
    """ValueError naming the flag for the first of `args`' integer options `names` that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def clear_prefix_cache(engine) -> None:
    """Empty `engine`'s prefix cache (where caching is on), so the next prompt prefills cold."""
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()


def start_cold(llm) -> None:
    """Before a timed run: nothing from earlier requests carries over. The drafter forgets what it learned
    from them (the suffix drafter's index of finished outputs), so a prompt measured again is not drafted
    from its own answer; the prefix cache is emptied, so every system prefills every prompt, as llama.cpp's
    peer does (`reset()`). With the cache kept, plain decoding had prefilled multi-turn prompts while
    writing their earlier turns and a speculative system had not, and a second repeat timed no prefill at
    all (BENCHMARKS.md, "A cold prefix cache for every system in every timed run")."""
    engine = getattr(llm, "engine", None)
    if engine is None:
        return
    if engine.drafter is not None:
        engine.drafter.forget_shared()
    clear_prefix_cache(engine)


def median_spread(xs: list[float]) -> dict:
    """Median, min and max of repeated timings, and how many there were."""
    import statistics

    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two greedy continuations differ (None: they agree as far as both go).
    After it they continue from different prefixes, so only the common prefix is comparable."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
