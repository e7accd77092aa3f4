"""The OpenAI-compatible HTTP API: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Streams are server-sent events through aiohttp-sse (``data: {chunk}`` ... ``data: [DONE]``): a chunk
with the assistant role first, one per delivered piece of text, one with the finish reason, then the
usage chunk when ``stream_options.include_usage`` asks for it; the last chunk carries ``spec``
(τ, verify steps, acceptance per depth). A client that disconnects has its handler cancelled by
aiohttp, which cancels the request in the engine: its KV is free within one step.

A request goes the same way as a websocket response (submit.py): capacity, sampling, tokenizing
off the loop when long, fitting the context (policy "error": OpenAI's 400 naming both numbers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from aiohttp import web
from aiohttp_sse import EventSourceResponse

from specserve import defaults
from specserve.server.engine_worker import EngineWorker, Summary, Update
from specserve.server.openai_choices import ChoiceWriter
from specserve.server.openai_protocol import (
    CompletionRequest,
    Shapes,
    error_body,
    error_status,
    parse_body,
    parse_request,
    spec_of,
    usage_of,
)
from specserve.server.pacing import Pacer, split_text, token_weights
from specserve.server.protocol import ProtocolError
from specserve.server.submit import engine_failure, final_status, fitted, make_params, prepare, refusal

API = "openai"
FINISH_REASONS = {"stop": "stop", "length": "length"}


def add_routes(app: web.Application, server) -> None:
    api = OpenAIApi(server)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model:.+}", api.model)
    app.on_response_prepare.append(api.cors_headers)


def error_response(err: ProtocolError, headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(err), status=error_status(err), headers=headers)


async def guard_api(server, request: web.Request, handler) -> web.StreamResponse:
    """Origin and API key for ``/v1/*`` (besides the websocket), CORS preflight, errors in OpenAI's shape."""
    origin = request.headers.get("Origin")
    host = request.headers.get("Host")
    if origin is not None and not server.access.origin_allowed(origin, host):
        return error_response(ProtocolError("origin_not_allowed", f"origin {origin[:100]!r} is not allowed"))
    if request.method == "OPTIONS" and origin is not None:  # a browser's CORS preflight (no key is sent with it)
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600",
            "Vary": "Origin"})
    if not server.access.key_ok(request.headers.get("Authorization"), request.query_string):
        err = ProtocolError("invalid_api_key", "missing or wrong API key: send 'Authorization: Bearer KEY'")
        return error_response(err, {"WWW-Authenticate": "Bearer"})
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 404:
            return error_response(ProtocolError("not_found", f"no route {request.method} {request.path[:100]}"))
        if exc.status == 405:
            return error_response(ProtocolError("method_not_allowed", f"{request.method} is not allowed on {request.path[:100]}"))
        raise


class OpenAIApi:
    def __init__(self, server) -> None:
        self.server = server
        self.started = int(time.time())

    # ---- models ---------------------------------------------------------------------------------

    def _model_card(self) -> dict:
        s = self.server
        return {"id": s.model_name, "object": "model", "created": self.started, "owned_by": "specserve",
                "context_length": s.context_length, "drafter": s.drafter_spec, "speculation": s.speculation}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.server.model_name:
            return error_response(self._model_not_found(name))
        return web.json_response(self._model_card())

    def _model_not_found(self, name: str) -> ProtocolError:
        return ProtocolError("model_not_found", f"the model {name[:100]!r} does not exist here: this server serves "
                             f"{self.server.model_name!r} (GET /v1/models)", "model")

    async def cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """An allowed cross-origin browser app may read our answers (set before a stream's headers go)."""
        origin = request.headers.get("Origin")
        if (origin is not None and request.path.startswith("/v1/")
                and self.server.access.cross_origin(origin, request.headers.get("Host"))
                and self.server.access.origin_allowed(origin, request.headers.get("Host"))):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    # ---- completions ----------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        from specserve.server.app import peer_of

        received = time.perf_counter()
        server = self.server
        client = peer_of(request)
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise ProtocolError("message_too_large",
                                    f"the request body is larger than the {server.config.max_message_bytes}-byte limit") from None
            body = parse_body(raw)
            sampling_defaults = {**defaults.sampling_defaults(), "max_output_tokens": None}
            req = parse_request(body, chat, sampling_defaults)
            if req.model is not None and req.model != server.model_name:
                raise self._model_not_found(req.model)
            drafter = server.choose_drafter(req.drafter, "drafter")
            server.check_capacity()
            params = make_params(req.sampling, req.constraint)
            prompt = await prepare(server, req.input, req.messages, params, "error", req.names, req.constraint)
        except ProtocolError as err:
            server.reject(API, client, err)
            return error_response(err)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        # n choices are n requests of one prompt (its prefill shared through prefix caching), one queue:
        # items are (choice index, kind, value). Each its own seed: seed + i.
        queue: asyncio.Queue = asyncio.Queue()
        pacing = req.stream_pacing == "smooth" and req.logprobs is None and req.tools is None
        streams = [_Stream(server, rid if req.n == 1 else f"{rid}-{i}", client, pacing, len(prompt.ids), queue, i)
                   for i in range(req.n)]
        # Fairness across clients: the OpenAI `user` field when given (an end user), else the TCP connection
        # (address and port), as a websocket session is one. Not the address alone: every client behind one
        # proxy or NAT (or on loopback) would share one fair share — in the soak, well-behaved HTTP clients
        # queued behind hostile ones for seconds.
        user = body.get("user")
        fair = f"user:{user}" if isinstance(user, str) and user else "conn:" + client
        base = fitted(params, prompt)
        cache = getattr(getattr(server.llm, "engine", None), "prefix_cache", None)
        # With prefix caching the prompt is prefilled once: choice 0 first, the others held on the engine
        # thread until its first token is out (its prompt's full blocks are cached by then), each then
        # prefilling only the last partial block — n parallel prefills of the whole prompt cost n times one.
        # (Replicas keep no such hold: their choices start together.)
        follow = (req.n > 1 and cache is not None and len(prompt.ids) > cache.block_size
                  and isinstance(server.worker, EngineWorker))
        for i, stream in enumerate(streams):
            p = base if i == 0 or base.seed is None else dataclasses.replace(base, seed=base.seed + i)
            server.submit(stream.rid, prompt.ids, p, drafter, received, stream.on_update, client=fair,
                          after=streams[0].rid if follow and i > 0 else None)
        shapes = Shapes(rid, chat, server.model_name)
        texts = server.token_texts
        prompt_text = "" if chat or not req.echo else (req.input if isinstance(req.input, str) else texts.tokenizer.decode(prompt.ids))
        writers = [ChoiceWriter(i, req, shapes, texts, prompt.ids, prompt_text) for i in range(req.n)]
        try:
            if req.stream:
                return await self._stream(request, req, queue, streams, writers, shapes)
            return await self._whole(req, queue, streams, writers, shapes)
        finally:
            for stream in streams:
                if stream.summary is None:  # the client went away (or the server is stopping): free its KV now
                    server.worker.cancel(stream.rid)

    async def _whole(self, req: CompletionRequest, queue: asyncio.Queue, streams, writers, shapes: Shapes) -> web.Response:
        summaries: list[Summary | None] = [None] * len(streams)
        while any(s is None for s in summaries):
            i, kind, value = await queue.get()
            if kind == "text":
                text, _, entries, prompt_entries = value
                if prompt_entries is not None:
                    writers[i].prompt_entries = list(prompt_entries)
                writers[i].add(text, entries)
                continue
            summaries[i], leftover = value
            writers[i].entries.extend(leftover)
        for summary in summaries:
            failure = _failure(summary, req)
            if failure is not None:
                return error_response(failure)
        choices = [w.whole(FINISH_REASONS.get(s.reason, "stop")) for w, s in zip(writers, summaries)]
        body = shapes.whole(choices, usage_of(summaries[0], summaries[1:]), spec_of(summaries[-1]), summaries[0].timing)
        return web.json_response(body, dumps=_dumps)

    async def _stream(self, request: web.Request, req: CompletionRequest, queue: asyncio.Queue, streams, writers,
                      shapes: Shapes):
        self.server.track_stream(asyncio.current_task())
        sse = EventSourceResponse(sep="\n", ping_interval=15, allow_all_methods=True)  # POST, as OpenAI streams
        try:
            await sse.prepare(request)
        except ConnectionError:
            # The client left before the headers went out (it sent its request and closed). Not a server error:
            # raised out of the handler it was logged as one, with a traceback. aiohttp finishes the response
            # quietly; _handle's finally cancels the request.
            return sse
        sent_tokens = 0
        summaries: list[Summary | None] = [None] * len(streams)
        echoed = [False] * len(streams)
        try:
            if shapes.chat:
                for i in range(len(streams)):
                    await sse.send(shapes.chunk(text="", role=True, index=i))
            while any(s is None for s in summaries):
                i, kind, value = await queue.get()
                writer = writers[i]
                if kind == "text":
                    text, tokens, entries, prompt_entries = value
                    while not queue.empty() and queue._queue[0][:2] == (i, "text"):  # merge what queued up
                        more = queue.get_nowait()[2]
                        text, tokens, entries = text + more[0], tokens + more[1], entries + more[2]
                    if not echoed[i]:
                        echoed[i] = True
                        echo = writer.echo_piece(prompt_entries)
                        if echo is not None:
                            await sse.send(echo)
                    sent_tokens += tokens
                    # With continuous usage stats (one choice) the usage so far rides on every chunk.
                    running = streams[i].usage_so_far(sent_tokens) if req.continuous_usage and req.n == 1 else None
                    chunk = writer.piece(text, entries, running)
                    if chunk is not None:
                        await sse.send(chunk)
                    continue
                summary, leftover = value
                summaries[i] = summary
                failure = _failure(summary, req)
                if failure is not None:
                    await sse.send(_dumps(error_body(failure)))
                    await sse.send("[DONE]")
                    return sse
                owed, reason = writer.finish(FINISH_REASONS.get(summary.reason, "stop"), leftover)
                for chunk in owed:
                    await sse.send(chunk)
                if any(s is None for s in summaries):
                    await sse.send(shapes.chunk(finish_reason=reason, index=i))
                    continue
                usage = usage_of(summary, [s for s in summaries if s is not summary]) if req.include_usage else None
                for chunk in shapes.final_chunk(reason, spec_of(summary), usage, summary.timing, index=i):
                    await sse.send(chunk)
            await sse.send("[DONE]")
        except ConnectionError:  # the client went away mid-stream; _handle's finally cancels the request
            pass
        finally:
            sse.stop_streaming()
        return sse


class _Stream:
    """One choice's updates: text pieces (paced or not) with their tokens' log-probabilities, and finally
    its Summary, on the response's queue as (index, kind, value)."""

    def __init__(self, server, rid: str, client: str, pacing: bool, prompt_tokens: int, queue: asyncio.Queue,
                 index: int = 0) -> None:
        self.server, self.rid, self.client = server, rid, client
        self.prompt_tokens = prompt_tokens
        self.queue, self.index = queue, index
        self.summary: Summary | None = None
        self.clock = server.metrics.token_clock(API)
        self.unsent_tokens = 0  # tokens whose text the detokenizer still holds back
        self.unsent_logprobs: tuple = ()  # and their log-probabilities
        self.prompt_logprobs = None  # sent with the first text piece
        self.pacer = None
        if pacing:
            loop = asyncio.get_running_loop()
            self.pacer = Pacer(lambda text, n: self._put("text", (text, n, (), None)), loop.time, loop.call_at)

    def _put(self, kind: str, value) -> None:
        self.queue.put_nowait((self.index, kind, value))

    def usage_so_far(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def on_update(self, update: Update) -> None:
        self.clock.tokens(time.perf_counter(), update.num_tokens)
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        if self.pacer is not None:
            if update.text:
                weights = token_weights(self.server.llm.tokenizer, update.token_ids) if update.token_ids else [1]
                self.pacer.push(split_text(update.text, weights))
                if update.num_tokens > len(weights):
                    self.pacer.push_tokens(update.num_tokens - len(weights))
            else:
                self.pacer.push_tokens(update.num_tokens)
        else:
            self.unsent_tokens += update.num_tokens
            self.unsent_logprobs += tuple(update.logprobs)
            if update.text:
                self._put("text", (update.text, self.unsent_tokens, self.unsent_logprobs, self.prompt_logprobs))
                self.unsent_tokens, self.unsent_logprobs, self.prompt_logprobs = 0, (), None
        if update.done is not None:
            summary = update.done
            self.summary = summary
            self.server.finish(self.rid, API, self.client, final_status(summary), summary)
            leftover, self.unsent_logprobs = self.unsent_logprobs, ()
            if self.prompt_logprobs is not None:  # no text came at all: the echo still needs its prompt
                self._put("text", ("", 0, (), self.prompt_logprobs))
            if self.pacer is not None:
                self.pacer.finish(lambda: self._put("done", (summary, leftover)))
            else:
                self._put("done", (summary, leftover))


def _failure(summary: Summary, req: CompletionRequest) -> ProtocolError | None:
    if summary.reason == "rejected":
        return refusal(summary, req.constraint)
    if summary.reason == "error":
        return engine_failure(summary, req.constraint)
    if summary.reason == "cancelled":
        return ProtocolError("internal_error", "the request was cancelled (the server is stopping)")
    return None


def _dumps(obj) -> str:
    from specserve.server.protocol import dumps

    return dumps(obj)
