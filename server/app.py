"""The server: one asyncio event loop on ``websockets``, one engine thread, many sessions.

- ``GET /`` (plain HTTP) is the browser chat page; ``/v1/ws`` is the websocket endpoint.
- The handshake enforces the security rules: when bound to a loopback address only loopback Host
  names are served (DNS-rebinding defence); a browser's Origin must be this server's own origin or
  one listed in ``allowed_origins``; with an API key, ``Authorization: Bearer KEY`` or
  ``?api_key=KEY`` is required (401 otherwise).
- Limits answer with error codes, never hangs: connections past ``max_connections`` get one
  ``too_many_connections`` error and a 1013 close; see ServerConfig for the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from specserve.server.engine_worker import EngineWorker
from specserve.server.page import page_response
from specserve.server.protocol import ProtocolError, dumps, error_event
from specserve.server.session import Session

log = logging.getLogger("specserve.server")

WS_PATH = "/v1/ws"


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen and the limits. Validated on construction (ValueError naming the field).

    max_connections:   open websockets at once.
    max_queued:        responses that may wait for a batch slot beyond the engine's max_num_seqs
                       running ones; past that ``response.create`` gets ``server_busy``.
    max_responses_per_connection: concurrent responses one socket may have (``too_many_responses``).
    max_message_bytes: client frames above this get ``message_too_large`` (above twice this the
                       websocket library closes the connection with 1009 without reading it all).
    max_pending_bytes: a connection's output waiting on a slow reader before its responses fail
                       with ``slow_consumer``.
    send_buffer_bytes: the kernel send buffer of each connection (None: the OS default, which grows to
                       megabytes on loopback); smaller makes a stalled reader felt sooner.
    threads:           torch threads of the engine thread (None: the starting thread's setting).
    """

    host: str = "127.0.0.1"
    port: int = 8765
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_connections: int = 64
    max_queued: int = 256
    max_responses_per_connection: int = 8
    max_message_bytes: int = 1 << 20
    max_pending_bytes: int = 1 << 20
    default_max_output_tokens: int = 256
    ping_interval: float | None = 20.0
    ping_timeout: float | None = 20.0
    send_buffer_bytes: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port!r}")
        for name in ("max_connections", "max_responses_per_connection", "max_message_bytes", "max_pending_bytes",
                     "default_max_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"ServerConfig.max_queued must be >= 0, got {self.max_queued}")
        if self.send_buffer_bytes is not None and self.send_buffer_bytes < 1:
            raise ValueError(f"ServerConfig.send_buffer_bytes must be >= 1, got {self.send_buffer_bytes}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"ServerConfig.threads must be >= 1, got {self.threads}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key is empty: give a key or none")
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/") for o in self.allowed_origins))


class SpecServer:
    """Serve an ``LLM`` over websockets. ``await start()``, then ``await serve_forever()`` or ``close()``."""

    def __init__(self, llm, config: ServerConfig | None = None) -> None:
        self.llm = llm
        self.config = config or ServerConfig()
        engine = llm.engine
        self.context_length = engine.config.max_model_len
        self.max_in_flight = engine.config.max_num_seqs + self.config.max_queued
        from specserve.training.bundle_paths import is_default_model

        # The bundle's directory is just "target": name the embedded model for what it is.
        default = is_default_model(llm.model_dir)
        self.model_name = "specserve-default" if default else (Path(llm.model_dir).name or str(llm.model_dir))
        self.drafter_spec: str | None = llm.drafter_spec if engine.drafter is not None else None
        self.drafter_name = engine.drafter.name if engine.drafter is not None else None
        self.default_sampling = {
            "max_output_tokens": min(self.config.default_max_output_tokens, self.context_length - 1),
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": (), "ignore_eos": False,
        }
        self.connections = 0
        self.in_flight = 0  # responses handed to the engine whose response.done has not been delivered
        self.worker: EngineWorker | None = None
        # Long prompts are tokenized here, one at a time, so the event loop never stalls on them.
        self.tokenize_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenize")
        self._server = None

    def limits(self) -> dict:
        c = self.config
        return {
            "context_length": self.context_length,
            "max_output_tokens": self.context_length - 1,
            "max_message_bytes": c.max_message_bytes,
            "max_responses_per_connection": c.max_responses_per_connection,
            "max_pending_bytes": c.max_pending_bytes,
        }

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self.worker = EngineWorker(self.llm.engine, asyncio.get_running_loop(), self.config.threads)
        self.worker.start()
        c = self.config
        try:
            self._server = await serve(
                self._handle, c.host, c.port,
                process_request=self._process_request,
                compression=None,  # deltas are tiny: deflate would cost latency and save nothing
                max_size=2 * c.max_message_bytes,
                max_queue=64,
                write_limit=64 * 1024,
                ping_interval=c.ping_interval, ping_timeout=c.ping_timeout,
                server_header="specserve",
            )
        except OSError as exc:
            self.worker.stop()
            raise ValueError(f"cannot listen on {c.host}:{c.port}: {exc.strerror or exc}") from None

    async def serve_forever(self) -> None:
        await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self.worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self.tokenize_executor.shutdown(wait=False, cancel_futures=True)

    # ---- HTTP and handshake -----------------------------------------------------------------------

    def _process_request(self, connection, request):
        headers = request.headers
        try:
            host = headers.get("Host")
            origin = headers.get("Origin")
            auth = headers.get("Authorization")
        except LookupError:  # a header given twice
            return connection.respond(400, "Bad Request: a header is repeated\n")
        if not self._host_allowed(host):
            return connection.respond(403, "Forbidden: this server only answers to localhost names\n")
        url = urlsplit(request.path)
        if url.path == WS_PATH:
            if origin is not None and not self._origin_allowed(origin, host):
                return connection.respond(403, f"Forbidden: origin {origin!r} is not allowed\n")
            if self.config.api_key is not None and not self._key_ok(auth, url.query):
                response = connection.respond(401, "Unauthorized: give the API key as 'Authorization: Bearer KEY' or ?api_key=KEY\n")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            return None  # go on with the websocket handshake (a plain GET gets 426 from the library)
        if "Upgrade" in headers:
            return connection.respond(404, f"Not Found: the websocket endpoint is {WS_PATH}\n")
        if url.path in ("/", "/index.html"):
            return page_response()
        if url.path == "/healthz":
            return connection.respond(200, "ok\n")
        return connection.respond(404, "Not Found\n")

    def _host_allowed(self, host: str | None) -> bool:
        """Bound to loopback: only loopback Host names, so a rebound DNS name cannot reach us."""
        if not _is_loopback(self.config.host):
            return True
        if not host:
            return False
        name = urlsplit("//" + host).hostname or ""
        return name == "localhost" or name.endswith(".localhost") or _is_loopback(name)

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.rstrip("/")
        if "*" in self.config.allowed_origins or origin in self.config.allowed_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and host is not None and parts.netloc.lower() == host.lower()

    def _key_ok(self, auth: str | None, query: str) -> bool:
        key = self.config.api_key.encode()
        candidates = []
        if auth and auth[:7].lower() == "bearer ":
            candidates.append(auth[7:].strip())
        candidates += parse_qs(query).get("api_key", [])
        return any(hmac.compare_digest(c.encode(), key) for c in candidates)

    # ---- connections ------------------------------------------------------------------------------

    async def _handle(self, ws) -> None:
        if self.connections >= self.config.max_connections:
            err = ProtocolError("too_many_connections", f"the server holds {self.connections} connections (its limit); try again later")
            try:
                await ws.send(dumps(error_event(err)))
                await ws.close(1013, "too many connections")
            except ConnectionClosed:
                pass
            return
        self.connections += 1
        if self.config.send_buffer_bytes is not None:
            sock = ws.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.send_buffer_bytes)
        try:
            await Session(ws, self).run()
        finally:
            self.connections -= 1


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class BackgroundServer:
    """A SpecServer on its own event loop in a daemon thread (tests, benchmarks, notebooks).

    ``with BackgroundServer(llm, ServerConfig(port=0)) as srv: ... srv.ws_url ...``
    """

    def __init__(self, llm, config: ServerConfig | None = None) -> None:
        self.server = SpecServer(llm, config or ServerConfig(port=0))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="specserve-loop", daemon=True)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{WS_PATH}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=60)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.loop.close()

    def engine_call(self, fn, timeout: float = 10.0):
        """Run ``fn(engine)`` on the engine thread and return its result (e.g. free KV blocks)."""
        return self.server.worker.call(fn).result(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
