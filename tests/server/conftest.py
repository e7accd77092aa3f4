"""Fixtures: real servers on loopback (BackgroundServer) over tiny models, and a plain-decoding reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specserve import LLM
from specserve.server import BackgroundServer, ServerConfig

sys.path.insert(0, str(Path(__file__).parent))  # wsclient, server_utils


@pytest.fixture(scope="session")
def reference_llm(llama_dir):
    """Plain greedy decoding of the same checkpoint: what every greedy stream must equal."""
    return LLM(llama_dir)


@pytest.fixture(scope="session")
def server(llama_dir):
    """The shared server: n-gram drafter, one engine thread, a 64 KiB frame limit."""
    llm = LLM(llama_dir, drafter="ngram", speculation="static")  # tests count multi-token deltas
    with BackgroundServer(llm, ServerConfig(port=0, threads=1, max_message_bytes=64 * 1024)) as srv:
        yield srv


@pytest.fixture
def make_server(llama_dir):
    """Start a server with its own LLM: make_server(config_kwargs..., llm_kwargs={...}); a drafter runs
    static speculation unless llm_kwargs say otherwise (tests count what its drafts deliver)."""
    started = []

    def make(llm_kwargs: dict | None = None, model_dir=None, **config) -> BackgroundServer:
        kwargs = {"speculation": "static", **(llm_kwargs or {})}
        llm = LLM(model_dir or llama_dir, **kwargs)
        srv = BackgroundServer(llm, ServerConfig(port=0, threads=1, **config)).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def noeos_dir(tmp_path_factory):
    """A tiny Llama with a 2,048-token context and no end-of-sequence token: replies run until stopped."""
    import json

    from tiny_models import build_model

    path = build_model(tmp_path_factory.mktemp("noeos"), "llama", init_std=0.2, max_positions=2048)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    return path
