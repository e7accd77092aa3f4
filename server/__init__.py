"""specserve.server — the websocket server, its protocol, the browser chat page and the CLI chat client.

    from specserve import LLM
    from specserve.server import BackgroundServer, ServerConfig

    with BackgroundServer(LLM("path/to/hf-dir", drafter="ngram"), ServerConfig(port=0)) as srv:
        print(srv.ws_url)  # ws://127.0.0.1:PORT/v1/ws ; the chat page is srv.http_url

Modules, one job each: ``protocol`` (events, validation, error codes), ``prompts`` (input/messages →
token ids), ``engine_worker`` (the engine thread), ``outbox`` (bounded per-connection sending),
``session`` (one connection), ``app`` (handshake, HTTP, limits, the server), ``page`` (the chat page),
``client`` and ``cli`` (`specserve chat` / `specserve serve`).
"""

from specserve.server.app import BackgroundServer, ServerConfig, SpecServer
from specserve.server.protocol import ERROR_CODES, ProtocolError

__all__ = ["ERROR_CODES", "BackgroundServer", "ProtocolError", "ServerConfig", "SpecServer"]
