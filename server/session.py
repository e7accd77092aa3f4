"""One websocket connection: its settings, its responses, and the events between it and the engine.

Message handling is synchronous (parse → validate → tokenize → hand to the engine thread → queue
``response.created``), so each client event is answered in order and nothing waits on another
connection; only a long prompt is tokenized on the server's tokenizer thread, so that it cannot
stall the event loop. Engine updates arrive on the event loop through :meth:`Session.on_update` and
leave through the connection's :class:`~specserve.server.outbox.Outbox` — directly, or through a
:class:`~specserve.server.pacing.Pacer` when the response asked for ``stream_pacing: "smooth"``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import WSMsgType

from specserve.sampling import SamplingParams
from specserve.server.engine_worker import Summary, Update
from specserve.server.metrics import TokenClock
from specserve.server.openai_logprobs import chat_logprobs
from specserve.server.outbox import Outbox
from specserve.server.pacing import Pacer, split_text, token_weights
from specserve.server.prompts import WEBSOCKET_NAMES, Prompt
from specserve.server.protocol import (
    CancelResponse,
    ConstraintSpec,
    CreateResponse,
    ProtocolError,
    UpdateSession,
    error_event,
    parse_event,
    with_event_id,
)
from specserve.server.submit import (engine_failure, final_status, fitted, make_params, needs_thread, prepare_now,
                                     refusal)

log = logging.getLogger("specserve.server")

API = "websocket"


@dataclass
class _Response:
    id: str
    event_id: str | None
    metadata: dict
    max_tokens: int  # what the client asked for (or its default), before fitting the window
    clock: TokenClock
    pacer: Pacer | None = None
    status: str = "in_progress"  # | "cancelling" (client asked) | "failing" (slow consumer)
    failure: ProtocolError | None = None
    unsent_tokens: int = 0  # tokens whose text is still held back (UTF-8 or stop-string holdback)
    constraint: ConstraintSpec | None = None  # its structured output, if any (names the field of a refusal)
    top_logprobs: int | None = None  # logprobs asked: alternatives per token (None: no logprobs)
    unsent_logprobs: tuple = ()  # TokenLogprob entries of the unsent tokens


class Session:
    """Per-connection state. ``server`` is the SpecServer (llm, worker, config, shared counters)."""

    def __init__(self, ws, server, peer: str = "") -> None:
        self.ws = ws
        self.server = server
        self.id = "sess_" + uuid.uuid4().hex[:24]
        self.client = f"{peer} {self.id}".strip()
        self.defaults = dict(server.default_sampling)
        self.drafter: str | None = server.drafter_spec  # what this session's requests draft with (None: plain)
        self.responses: dict[str, _Response] = {}
        self.closed = False
        self._tokenizing = 0  # long prompts being tokenized off the loop, counted against the limits
        self._tasks: set[asyncio.Task] = set()
        self.outbox = Outbox(ws, server.config.max_pending_bytes, self._on_overflow)

    # ---- lifecycle --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until it closes; then cancel whatever it still has running."""
        writer = asyncio.create_task(self.outbox.run(), name=f"{self.id}-writer")
        self.outbox.send({"type": "session.created", "session": self.describe()})
        try:
            async for message in self.ws:
                if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    self.handle_frame(message.data, time.perf_counter())
                else:  # ERROR: the library has closed the socket (e.g. 1009, a frame past twice the limit)
                    break
        except ConnectionError:
            pass
        finally:
            self.closed = True
            for resp in self.responses.values():
                if resp.pacer is not None:
                    resp.pacer.cancel()
                if resp.status == "in_progress":
                    resp.status = "cancelling"
                    self.server.worker.cancel(resp.id)
            self.outbox.close()
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    def describe(self) -> dict:
        """The ``session`` object of session.created / session.updated."""
        server = self.server
        return {
            "id": self.id,
            "model": server.model_name,
            "drafter": self.drafter,
            "available_drafters": server.available_drafters(),
            "defaults": {**self.defaults, "stop": list(self.defaults["stop"])},
            "limits": server.limits(),
        }

    # ---- client events ----------------------------------------------------------------------------

    def handle_frame(self, message: str | bytes, received: float) -> None:
        """Answer one frame; no exception escapes. Its reply is queued before this returns, except for a
        response.create with a long prompt, answered once the prompt is tokenized off the loop."""
        event = None
        try:
            if isinstance(message, bytes):
                raise ProtocolError("binary_not_supported", "binary frames are not supported: send JSON text frames")
            limit = self.server.config.max_message_bytes
            if len(message) > limit or (len(message) * 4 > limit and len(message.encode("utf-8", "replace")) > limit):
                raise ProtocolError("message_too_large", f"frame is larger than the {limit}-byte limit")
            event = parse_event(message, max_output_tokens=self.server.context_length - 1)
            if isinstance(event, CreateResponse):
                self._create(event, received)
            elif isinstance(event, CancelResponse):
                self._cancel(event)
            else:
                self._update(event)
        except ProtocolError as err:
            if err.event_id is None and event is not None:
                err.event_id = event.event_id
            if isinstance(event, CreateResponse) or err.event_type == "response.create":
                self.server.reject(API, self.client, err)
            self.outbox.send(error_event(err))
        except Exception as exc:  # a bug: say so, keep the session
            log.exception("session %s: handling a frame failed", self.id)
            self.outbox.send(error_event(ProtocolError("internal_error", f"internal error: {type(exc).__name__}")))

    def _create(self, ev: CreateResponse, received: float) -> None:
        server, config = self.server, self.server.config
        if len(self.responses) + self._tokenizing >= config.max_responses_per_connection:
            raise ProtocolError(
                "too_many_responses",
                f"this connection already has {len(self.responses) + self._tokenizing} responses in flight "
                f"(limit {config.max_responses_per_connection}); wait for one to finish or cancel one",
            )
        server.check_capacity()
        s = {**self.defaults, **ev.sampling}
        params = make_params(s, ev.constraint)
        policy = "auto" if s["truncation"] == "auto" else "clamp"
        if not needs_thread(ev.input, ev.messages, params, server):
            prompt = prepare_now(server, ev.input, ev.messages, params, policy, WEBSOCKET_NAMES, ev.constraint)
            self._submit(ev, s, params, prompt, received)
            return
        # A long text takes milliseconds to seconds to tokenize, a new constraint up to a second to compile:
        # do it off the event loop (and off the engine thread) so no other connection's stream stalls,
        # holding this response's place in the limits meanwhile.
        self._tokenizing += 1
        server.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._create_later(ev, s, params, policy, received))
        self._tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._tasks.discard)

    async def _create_later(self, ev: CreateResponse, s: dict, params: SamplingParams, policy: str, received: float) -> None:
        server = self.server
        prompt = None
        try:
            prompt = await asyncio.get_running_loop().run_in_executor(
                server.tokenize_executor, prepare_now, server, ev.input, ev.messages, params, policy,
                WEBSOCKET_NAMES, ev.constraint)
        except ProtocolError as err:
            err.event_id = ev.event_id
            server.reject(API, self.client, err)
            self.outbox.send(error_event(err))
        except Exception as exc:
            log.exception("session %s: tokenizing a prompt failed", self.id)
            err = ProtocolError("internal_error", f"internal error: {type(exc).__name__}", event_id=ev.event_id)
            self.outbox.send(error_event(err))
        finally:
            self._tokenizing -= 1
            server.in_flight -= 1  # the place it held; submit takes one of its own
        if prompt is not None and not self.closed:
            self._submit(ev, s, params, prompt, received)

    def _submit(self, ev: CreateResponse, s: dict, params: SamplingParams, prompt: Prompt, received: float) -> None:
        """Hand a tokenized request to the engine thread and announce it."""
        server = self.server
        asked = params.max_tokens if params.max_tokens is not None else prompt.max_tokens
        rid = "resp_" + uuid.uuid4().hex[:24]
        resp = _Response(rid, ev.event_id, ev.metadata, asked, server.metrics.token_clock(API), constraint=ev.constraint,
                         top_logprobs=params.logprobs)
        # Log-probabilities ride on the deltas of their tokens, so a response that asks for them streams
        # each step's tokens as they come (as on HTTP): smooth pacing re-splits text along token widths.
        if s["stream_pacing"] == "smooth" and params.logprobs is None:
            loop = asyncio.get_running_loop()
            resp.pacer = Pacer(lambda text, n, rid=rid: self.outbox.send_delta(rid, text, n), loop.time, loop.call_at)
        self.responses[rid] = resp
        server.submit(rid, prompt.ids, fitted(params, prompt), self.drafter, received, self.on_update, client=self.id)
        created = {"type": "response.created", "response": {
            "id": rid, "status": "in_progress", "metadata": ev.metadata, "input_tokens": len(prompt.ids),
            "max_output_tokens": prompt.max_tokens, "dropped_messages": prompt.dropped_messages}}
        self.outbox.send(with_event_id(created, ev.event_id))

    def _cancel(self, ev: CancelResponse) -> None:
        resp = self.responses.get(ev.response_id)
        if resp is None:
            raise ProtocolError(
                "response_not_found", f"no response {ev.response_id[:64]!r} in flight on this connection", "response_id"
            )
        if resp.status == "in_progress":
            resp.status = "cancelling"
            if resp.pacer is not None:
                resp.pacer.cancel()  # nothing more streams after a cancel, held text included
            self.server.worker.cancel(resp.id)
        # Cancelling twice is harmless: the one response.done (status cancelled) answers both.

    def _update(self, ev: UpdateSession) -> None:
        server = self.server
        if ev.drafter is not None:
            self.drafter = server.choose_drafter(ev.drafter, "session.drafter")
        self.defaults.update(ev.defaults)
        self.outbox.send(with_event_id({"type": "session.updated", "session": self.describe()}, ev.event_id))

    # ---- engine updates (on the event loop) -------------------------------------------------------

    def on_update(self, update: Update) -> None:
        resp = self.responses.get(update.request_id)
        if resp is None:
            return
        resp.clock.tokens(time.perf_counter(), update.num_tokens)
        if resp.status == "in_progress":  # after a cancel, nothing more streams
            if resp.pacer is not None:
                self._pace(resp, update)
            else:
                resp.unsent_tokens += update.num_tokens
                if resp.top_logprobs is not None:
                    resp.unsent_logprobs += tuple(update.logprobs)
                # The last step's tokens go out even without text (EOS, a stop string's tokens): a client
                # that adds up the deltas' tokens gets usage.output_tokens.
                if update.text or (update.done is not None and resp.unsent_tokens):
                    self._send_delta(resp, update.text)
        if update.done is not None:
            del self.responses[resp.id]
            if resp.pacer is not None and resp.status == "in_progress":
                resp.pacer.finish(lambda: self._done(resp, update.done))  # after the held text has gone
            else:
                self._done(resp, update.done)

    def _send_delta(self, resp: _Response, text: str) -> None:
        """The text and tokens held so far, with their log-probabilities when the response asked: one
        {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]} per token, as OpenAI chat's
        logprobs.content entries."""
        logprobs = None
        size = 0
        if resp.top_logprobs is not None:
            logprobs = chat_logprobs(resp.unsent_logprobs, self.server.token_texts)["content"]
            size = len(logprobs) * (64 + 48 * resp.top_logprobs)  # about their JSON, for the pending bound
            resp.unsent_logprobs = ()
        self.outbox.send_delta(resp.id, text, resp.unsent_tokens, logprobs, size)
        resp.unsent_tokens = 0

    def _pace(self, resp: _Response, update: Update) -> None:
        if not update.text:
            resp.pacer.push_tokens(update.num_tokens)
            return
        weights = token_weights(self.server.llm.tokenizer, update.token_ids) if update.token_ids else [1]
        resp.pacer.push(split_text(update.text, weights))
        extra = update.num_tokens - len(weights)
        if extra > 0:
            resp.pacer.push_tokens(extra)

    def _done(self, resp: _Response, summary: Summary) -> None:
        self.server.finish(resp.id, API, self.client, final_status(summary, resp.failure is not None), summary)
        body: dict = {"id": resp.id, "status": "completed", "metadata": resp.metadata}
        error: ProtocolError | None = None
        if summary.reason == "stop":
            pass
        elif summary.reason == "length":
            body["status"] = "incomplete"
            hit_max = summary.output_tokens >= resp.max_tokens
            body["incomplete_details"] = {"reason": "max_output_tokens" if hit_max else "context_length"}
        elif summary.reason == "cancelled":
            body["status"] = "failed" if resp.failure else "cancelled"
            error = resp.failure
        elif summary.reason == "rejected":
            body["status"] = "failed"
            error = refusal(summary, resp.constraint)
            error.event_id = resp.event_id
            self.outbox.send(error_event(error))
        else:
            body["status"] = "failed"
            error = engine_failure(summary, resp.constraint)
        if error is not None:
            body["error"] = error.to_error()
        total = summary.input_tokens + summary.output_tokens
        body["usage"] = {"input_tokens": summary.input_tokens, "output_tokens": summary.output_tokens, "total_tokens": total,
                         "input_tokens_details": {"cached_tokens": summary.cached_tokens}}
        body["spec"] = summary.spec or {"tau": 0.0, "steps": 0, "accepted_per_position": []}
        body["timing"] = summary.timing or {"queue_ms": None, "ttft_ms": None, "e2e_ms": None, "engine_ttft_ms": None}
        self.outbox.send({"type": "response.done", "response": body})

    def _on_overflow(self) -> None:
        """The reader fell too far behind: fail this connection's responses (others are untouched)."""
        limit = self.server.config.max_pending_bytes
        for resp in self.responses.values():
            if resp.status == "in_progress":
                resp.status = "failing"
                resp.failure = ProtocolError(
                    "slow_consumer", f"the client read too slowly: more than {limit} bytes waited to be sent"
                )
                if resp.pacer is not None:
                    resp.pacer.cancel()
                self.server.worker.cancel(resp.id)
