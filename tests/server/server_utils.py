"""Helpers shared by the server tests (imported by name: conftest puts this folder on sys.path)."""

from __future__ import annotations

import time

from specserve import SamplingParams
from specserve.server import BackgroundServer

#: Two tools for the tool-call tests (tool_choice named / required / auto), and their argument schemas.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                                         "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a"], "additionalProperties": False}}}]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def openai_client(srv: BackgroundServer):
    """The real `openai` client against a test server (no retries, 60 s timeout)."""
    import openai

    return openai.OpenAI(base_url=srv.openai_base_url, api_key="unused", max_retries=0, timeout=60)


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
