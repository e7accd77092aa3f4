"""The server: one aiohttp application on one port, one asyncio event loop, one engine thread.

Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` — the OpenAI-compatible
  HTTP API, streaming as server-sent events (openai_api.py);
- ``/v1/ws`` — the websocket protocol (protocol.py, session.py);
- ``GET /`` — the browser chat page; ``GET /health`` (and ``/healthz``) — 200 while the engine thread
  runs, 503 once it has died; ``GET /metrics`` — Prometheus text (metrics.py).

aiohttp serves HTTP, SSE and websockets from one well-kept library, and lets the handshake answer
401/403/404/426 itself, close with 1013, size frames and reach each socket's send buffer — everything
the websocket endpoint did on the ``websockets`` library, on the same port as the HTTP API.

Access (access.py) applies to every route: loopback Host names only on a loopback bind; a browser
Origin must be ours or allowed; the API key guards ``/v1/*``. Limits answer with errors, never hangs:
see ServerConfig.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from aiohttp import WSCloseCode, web

from specserve import defaults
from specserve.server.access import Access
from specserve.server.engine_worker import EngineWorker
from specserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from specserve.server.page import page_response
from specserve.server.protocol import ProtocolError, dumps, error_event
from specserve.server.request_log import log_request
from specserve.server.session import Session

log = logging.getLogger("specserve.server")

WS_PATH = "/v1/ws"
API_PREFIX = "/v1/"


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen and the limits. Validated on construction (ValueError naming the field).

    max_connections:   open websockets at once.
    max_queued:        responses that may wait for a batch slot beyond the engine's max_num_seqs
                       running ones (both APIs together); past that a new one gets ``server_busy`` (429).
    max_responses_per_connection: concurrent responses one socket may have (``too_many_responses``).
    max_message_bytes: client frames above this get ``message_too_large`` (above twice this the
                       connection closes with 1009 without reading it all); HTTP bodies above it get 413.
    max_pending_bytes: a connection's output waiting on a slow reader before its responses fail
                       with ``slow_consumer``.
    default_max_output_tokens: a websocket session's default reply length (chats; the HTTP API
                       defaults to the rest of the context, as OpenAI does).
    ping_interval:     seconds between websocket pings (None: none); a pong missing for half of that
                       closes the connection (aiohttp's heartbeat).
    send_buffer_bytes: the kernel send buffer of each connection, and the high-water mark of asyncio's
                       buffer in front of it (None: the OS default, which grows to megabytes on
                       loopback, and asyncio's 64 KiB); smaller makes a stalled reader felt sooner.
    threads:           torch threads of the engine thread (None: the starting thread's setting).
    shutdown_grace:    seconds ``shutdown()`` lets running responses finish before it cancels the rest
                       (each still gets its terminal event).
    replicas:          engines serving requests (`replicas.py`): the server's LLM plus replicas - 1 child
                       processes rebuilt from its `init_args`, each request routed to the least loaded.
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
    default_max_output_tokens: int = defaults.CHAT_MAX_OUTPUT_TOKENS
    ping_interval: float | None = 20.0
    send_buffer_bytes: int | None = None
    threads: int | None = None
    shutdown_grace: float = 10.0
    replicas: int = 1

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
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"ServerConfig.replicas must be an integer >= 1, got {self.replicas!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"ServerConfig.threads must be >= 1, got {self.threads}")
        if not self.shutdown_grace >= 0:
            raise ValueError(f"ServerConfig.shutdown_grace must be >= 0 seconds, got {self.shutdown_grace!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key is empty: give a key or none")
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/") for o in self.allowed_origins))


class SpecServer:
    """Serve an ``LLM``. ``await start()``, then ``await serve_forever()`` or ``close()``."""

    def __init__(self, llm, config: ServerConfig | None = None) -> None:
        self.llm = llm
        from specserve.server.openai_logprobs import TokenTexts

        self.token_texts = TokenTexts(llm.tokenizer)  # token id -> text, for log-probabilities
        self.config = config or ServerConfig()
        engine = llm.engine
        self.context_length = engine.config.max_model_len
        self.max_in_flight = engine.config.max_num_seqs + self.config.max_queued
        from specserve.bundle_paths import is_default_model

        # The bundle's directory is just "target": name the embedded model for what it is.
        default = is_default_model(llm.model_dir)
        self.model_name = "specserve-default" if default else (Path(llm.model_dir).name or str(llm.model_dir))
        self.drafter_spec: str | None = llm.drafter_spec if engine.drafter is not None else None
        self.drafter_name = engine.drafter.name if engine.drafter is not None else None
        # A hybrid drafter's parts: each may also be chosen alone, per session or per request.
        self.drafter_parts: tuple[str, ...] = engine.drafter.part_names if engine.drafter else ()
        self.speculation = getattr(llm, "speculation", "static") if engine.drafter is not None else None
        self.default_sampling = {
            "max_output_tokens": min(self.config.default_max_output_tokens, self.context_length - 1),
            **defaults.sampling_defaults(),
            "stream_pacing": defaults.STREAM_PACING, "truncation": "disabled",
        }
        self.access = Access(self.config.host, self.config.api_key, self.config.allowed_origins)
        self.metrics = ServerMetrics(self)
        self.connections = 0
        self.in_flight = 0  # responses accepted (both APIs) whose end has not been delivered
        self.worker: EngineWorker | None = None
        # Long prompts are tokenized here, one at a time, so the event loop never stalls on them.
        self.tokenize_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenize")
        self._drafter_of: dict[str, str | None] = {}  # request id -> drafter label, for the metrics
        self._sockets: set[web.WebSocketResponse] = set()
        self._sessions: set[Session] = set()
        self.draining = False  # shutdown() has begun: no new connections or responses
        self._streams: set[asyncio.Task] = set()  # HTTP handlers streaming a response
        self._runner: web.AppRunner | None = None
        self._stopped = asyncio.Event()

    def limits(self) -> dict:
        c = self.config
        return {
            "context_length": self.context_length,
            "max_output_tokens": self.context_length - 1,
            "speculation": self.speculation,
            "max_message_bytes": c.max_message_bytes,
            "max_responses_per_connection": c.max_responses_per_connection,
            "max_pending_bytes": c.max_pending_bytes,
        }

    @property
    def port(self) -> int:
        return self._runner.addresses[0][1]

    # ---- the way to the engine, for both APIs -----------------------------------------------------

    def check_capacity(self) -> None:
        if self.draining:
            raise ProtocolError("server_busy", "the server is shutting down; try again later")
        if self.in_flight >= self.max_in_flight:
            raise ProtocolError("server_busy", f"the server has {self.in_flight} responses in flight; try again shortly")

    def available_drafters(self) -> list[str]:
        """What a client may choose: the server's drafter, each part of a hybrid one alone, or "none"."""
        return ([self.drafter_spec, *self.drafter_parts] if self.drafter_spec else []) + ["none"]

    def choose_drafter(self, name: str | None, field: str) -> str | None:
        """A client's drafter choice → what its requests draft with: the server's drafter spec, one of its
        parts, or None (plain decoding). name None: the server's drafter. ProtocolError otherwise."""
        if name is None:
            return self.drafter_spec
        if name == "none":
            return None
        if self.drafter_spec is not None and name in (self.drafter_spec, self.drafter_name):
            return self.drafter_spec
        if name in self.drafter_parts:
            return name
        loaded = f"drafter {self.drafter_spec!r}" if self.drafter_spec else "no drafter"
        allowed = ", ".join(repr(d) for d in self.available_drafters())
        raise ProtocolError("drafter_unavailable",
                            f"drafter {name[:64]!r} is not loaded: this server loaded {loaded}; choose one of {allowed}", field)

    def submit(self, rid: str, ids: list[int], params, drafter: str | None, received: float, sink,
               client: str | None = None, after: str | None = None) -> None:
        """Hand a request to the engine thread; ``finish`` must follow once its summary has arrived.
        drafter: what `choose_drafter` returned (None: decode plainly); client: who sent it (a websocket
        session, an API user or peer address): the engine admits requests fairly across clients; after: hold
        it on the engine thread until that request has its first token (EngineWorker only)."""
        self.in_flight += 1
        self._drafter_of[rid] = drafter
        parts = (drafter,) if drafter in self.drafter_parts else None
        if after is not None:
            self.worker.submit(rid, ids, params, drafter is not None, received, sink, parts, client, after=after)
        else:
            self.worker.submit(rid, ids, params, drafter is not None, received, sink, parts, client)

    def finish(self, rid: str, api: str, client: str, status: str, summary) -> None:
        """A submitted request has ended: free its place, count it, log it."""
        self.in_flight -= 1
        self.metrics.finished(api, status, summary, self._drafter_of.pop(rid, None))
        timing = summary.timing or {}
        ttft, e2e = timing.get("ttft_ms"), timing.get("e2e_ms")
        out = summary.output_tokens
        tps = (out - 1) / ((e2e - ttft) / 1e3) if ttft is not None and e2e is not None and e2e > ttft and out > 1 else None
        steps = (summary.spec or {}).get("steps", 0)
        log_request({"id": rid, "api": api, "client": client, "status": status, "prompt_tokens": summary.input_tokens,
                     "cached_tokens": summary.cached_tokens, "output_tokens": out, "ttft_ms": ttft, "tokens_per_s": tps,
                     "tau": summary.spec["tau"] if steps else None, "error": summary.error})

    def reject(self, api: str, client: str, err: ProtocolError) -> None:
        """A request refused before reaching the engine (bad input, busy, too long)."""
        self.metrics.finished(api, "rejected")
        log_request({"id": None, "api": api, "client": client, "status": "rejected", "error": err.code})

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        from specserve.server.openai_api import add_routes

        loop = asyncio.get_running_loop()
        worker = EngineWorker(self.llm.engine, loop, self.config.threads)
        if self.config.replicas > 1:
            from specserve.server.replicas import ReplicaPool

            if getattr(self.llm, "tensor_parallel_size", 1) > 1:
                raise ValueError("replicas and tensor parallelism together are not supported yet: choose one")
            worker = ReplicaPool(worker, self.llm.init_args, self.config.replicas, loop)
            await loop.run_in_executor(None, worker.start)  # children load their models: minutes at most
        else:
            worker.start()
        self.worker = worker
        c = self.config
        app = web.Application(middlewares=[self._guard], client_max_size=c.max_message_bytes)
        app.router.add_get("/", self._page)
        app.router.add_get("/index.html", self._page)
        app.router.add_get("/health", self._health)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get(WS_PATH, self._websocket)
        add_routes(app, self)
        app.on_response_prepare.append(_server_header)
        app.on_shutdown.append(self._on_shutdown)
        # handler_cancellation: a client that goes away cancels its handler, which cancels its request
        # in the engine (within one step) — for streams and for plain requests alike.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, c.host, c.port, backlog=max(128, c.max_connections))
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            self.worker.stop()
            raise ValueError(f"cannot listen on {c.host}:{c.port}: {exc.strerror or exc}") from None

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def stop_accepting(self) -> None:
        """The first half of ``shutdown()``: close the listening socket (open connections stay) and refuse
        new responses (``server_busy``)."""
        self.draining = True
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()

    async def shutdown(self, grace: float | None = None, now: asyncio.Event | None = None) -> None:
        """Graceful stop: stop listening and refuse new responses, let running ones finish for up to
        ``grace`` seconds (default ``config.shutdown_grace``; ``now`` set cuts it short), cancel the rest
        (each gets its terminal event: response.done cancelled, the HTTP API's error chunk), then close."""
        grace = self.config.shutdown_grace if grace is None else grace
        await self.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.in_flight and loop.time() < deadline and not (now is not None and now.is_set()):
            await asyncio.sleep(0.02)
        if self.in_flight and self.worker is not None:
            log.info("shutdown: cancelling %d response(s) still running", self.in_flight)
            self.worker.cancel_all()
            deadline = loop.time() + 5.0
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.02)
        # Let the websockets' writers send what is queued (the terminal events) before the sockets close.
        deadline = loop.time() + 2.0
        while any(s.outbox.pending_bytes for s in self._sessions) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await self.close()

    async def close(self) -> None:
        if self._stopped.is_set():
            return
        if self._runner is not None:
            await self._runner.cleanup()
        if self.worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self.tokenize_executor.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()

    async def _on_shutdown(self, app) -> None:
        for ws in list(self._sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
        for task in list(self._streams):
            task.cancel()

    def track_stream(self, task: asyncio.Task) -> None:
        """An HTTP handler streaming a response: cancelled when the server shuts down."""
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)

    # ---- HTTP ---------------------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        headers = request.headers
        if any(len(headers.getall(name, ())) > 1 for name in ("Host", "Origin", "Authorization")):
            return _text(400, "Bad Request: a header is repeated")
        if not self.access.host_allowed(headers.get("Host")):
            return _text(403, "Forbidden: this server only answers to localhost names")
        if "Upgrade" in headers and request.path != WS_PATH:
            return _json_error("not_found", f"no websocket at {request.path[:100]}: the websocket endpoint is {WS_PATH}")
        if request.path.startswith(API_PREFIX) and request.path != WS_PATH:
            from specserve.server.openai_api import guard_api

            return await guard_api(self, request, handler)
        try:
            return await handler(request)
        except web.HTTPException as exc:  # the router's 404/405: JSON in OpenAI's error shape, as under /v1
            if exc.status == 404:
                return _json_error("not_found", f"no route {request.method} {request.path[:100]}: the page is /, the "
                                                f"OpenAI API under {API_PREFIX}, the websocket {WS_PATH}")
            if exc.status == 405:
                return _json_error("method_not_allowed", f"{request.method} is not allowed on {request.path[:100]}")
            if exc.status >= 400:
                return _text(exc.status, exc.reason)
            raise

    async def _page(self, request: web.Request) -> web.Response:
        return page_response()

    async def _health(self, request: web.Request) -> web.Response:
        alive = self.worker is not None and self.worker.alive
        body: dict = {"status": "ok" if alive else "the engine thread has stopped"}
        describe = getattr(self.worker, "describe", None)
        if describe is not None:  # replicas: each one's state; some dead is "degraded", still serving
            body["replicas"] = replicas = describe()
            dead = [r["replica"] for r in replicas if not r["alive"]]
            if dead and alive:
                body["status"] = f"degraded: replica(s) {', '.join(map(str, dead))} stopped"
        return web.json_response(body, status=200 if alive else 503)

    async def _healthz(self, request: web.Request) -> web.Response:
        alive = self.worker is not None and self.worker.alive
        return _text(200, "ok") if alive else _text(503, "the engine thread has stopped")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- websocket ----------------------------------------------------------------------------------

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        headers = request.headers
        origin = headers.get("Origin")
        if origin is not None and not self.access.origin_allowed(origin, headers.get("Host")):
            return _text(403, f"Forbidden: origin {origin!r} is not allowed")
        if not self.access.key_ok(headers.get("Authorization"), request.query_string):
            response = _text(401, "Unauthorized: give the API key as 'Authorization: Bearer KEY' or ?api_key=KEY")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        c = self.config
        ws = web.WebSocketResponse(
            compress=False,  # deltas are tiny: deflate would cost latency and save nothing
            max_msg_size=2 * c.max_message_bytes,
            heartbeat=c.ping_interval,
            # aiohttp checks for back-pressure once per writer_limit bytes: check often, so that a stalled
            # reader blocks our writer (and its outbox starts merging and counting) as soon as the
            # transport's 64 KiB buffer is full, as the websockets library did.
            writer_limit=4096,
        )
        if not ws.can_prepare(request).ok:
            response = _text(426, "Upgrade Required: this is the websocket endpoint")
            response.headers["Upgrade"] = "websocket"
            return response
        await ws.prepare(request)
        if self.connections >= c.max_connections:
            err = ProtocolError("too_many_connections", f"the server holds {self.connections} connections (its limit); try again later")
            try:
                await ws.send_str(dumps(error_event(err)))
                await ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"too many connections")
            except ConnectionError:
                pass
            return ws
        self.connections += 1
        self._sockets.add(ws)
        if c.send_buffer_bytes is not None and request.transport is not None:
            sock = request.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, c.send_buffer_bytes)
            # asyncio's own buffer in front of the socket (64 KiB by default) shrinks with it: otherwise a
            # stalled reader still has that much of our output absorbed before our writer feels it.
            request.transport.set_write_buffer_limits(high=c.send_buffer_bytes)
        try:
            session = Session(ws, self, peer=peer_of(request))
            self._sessions.add(session)
            try:
                await session.run()
            finally:
                self._sessions.discard(session)
        finally:
            self.connections -= 1
            self._sockets.discard(ws)
            if not ws.closed:
                await ws.close()
        return ws


def peer_of(request: web.Request) -> str:
    """The client's address as host:port (the request log's ``client``)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    if not peer:
        return "?"
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _json_error(code: str, message: str) -> web.Response:
    """An error in the API's shape, ``{"error": {message, type, param, code}}``, with its status."""
    from specserve.server.openai_api import error_response
    from specserve.server.protocol import ProtocolError

    return error_response(ProtocolError(code, message))


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text + "\n")


async def _server_header(request, response) -> None:
    response.headers["Server"] = "specserve"


class BackgroundServer:
    """A SpecServer on its own event loop in a daemon thread (tests, benchmarks, notebooks).

    ``with BackgroundServer(llm, ServerConfig(port=0)) as srv: ... srv.http_url, srv.ws_url ...``
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
    def openai_base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{WS_PATH}"

    def start(self) -> BackgroundServer:
        # As `specserve serve` does before it listens: the first requests would otherwise wait for kernels
        # compiling on first use (a fresh install: up to a minute each on two cores).
        self.server.llm.warm_up()
        self._thread.start()
        from specserve.server.replicas import READY_TIMEOUT_S

        # Starting waits for child replicas to build and warm up (kernels compiling in a fresh install).
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=READY_TIMEOUT_S + 60)
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
