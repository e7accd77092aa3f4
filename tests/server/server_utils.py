"""Helpers shared by the server tests (imported by name: conftest puts this folder on sys.path)."""

from __future__ import annotations

import time

from specserve import SamplingParams
from specserve.server import BackgroundServer


def greedy_text(llm, prompt, max_tokens: int, ignore_eos: bool = False) -> str:
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))[0].text


def kv_blocks(srv: BackgroundServer) -> tuple[int, int]:
    """(free, total) KV blocks, read on the engine thread."""
    return srv.engine_call(lambda e: (e.cache.allocator.num_free_blocks, e.cache.allocator.num_blocks))


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
