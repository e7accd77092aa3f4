"""specserve.server — one port serving the OpenAI-compatible HTTP API (with server-sent events), the
websocket protocol, the browser chat page, /health and /metrics; plus the `specserve chat` client.

    from specserve import LLM
    from specserve.server import BackgroundServer, ServerConfig

    with BackgroundServer(LLM(drafter="ngram"), ServerConfig(port=0)) as srv:
        print(srv.http_url)  # http://127.0.0.1:PORT/ ; OpenAI base URL srv.http_url + "v1", websocket srv.ws_url

Modules, one job each: ``app`` (the aiohttp application, limits, lifecycle), ``access`` (Host, Origin
and API-key rules), ``engine_worker`` (the engine thread), ``submit`` (what every request goes through
on its way to the engine: limits, sampling, tokenizing, fitting the context), ``protocol``, ``session``
and ``outbox`` (the websocket), ``openai_protocol`` and ``openai_api`` (HTTP), ``pacing`` (smooth
streaming), ``prompts`` (messages → token ids, fitting a chat into the context), ``metrics``
(Prometheus) and ``request_log`` (one line per request), ``page`` (the chat page), ``client`` and
``cli`` (`specserve chat` / `specserve serve`).
"""

from specserve.lazy import lazy_exports as _lazy_exports

__all__ = ["ERROR_CODES", "BackgroundServer", "ProtocolError", "ServerConfig", "SpecServer"]

# Imported on first use, so `specserve chat` and the CLI's parser do not import torch.
_LAZY = {"BackgroundServer": "specserve.server.app", "ServerConfig": "specserve.server.app",
         "SpecServer": "specserve.server.app", "ERROR_CODES": "specserve.server.protocol",
         "ProtocolError": "specserve.server.protocol"}


__getattr__, __dir__ = _lazy_exports(__name__, _LAZY, globals())
