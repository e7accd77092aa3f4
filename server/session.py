"""One websocket connection: its settings, its responses, and the events between it and the engine.

Message handling is synchronous (parse → validate → tokenize → hand to the engine thread → queue
``response.created``), so each client event is answered in order and nothing waits on another
connection; only a long prompt is tokenized on the server's tokenizer thread, so that it cannot
stall the event loop. Engine updates arrive on the event loop through :meth:`Session.on_update` and leave
through the connection's :class:`~specserve.server.outbox.Outbox`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

from websockets.exceptions import ConnectionClosed

from specserve.sampling import SamplingParams
from specserve.server.engine_worker import Update
from specserve.server.outbox import Outbox
from specserve.server.prompts import prompt_ids
from specserve.server.protocol import (
    CancelResponse,
    CreateResponse,
    ProtocolError,
    UpdateSession,
    error_event,
    parse_event,
    with_event_id,
)

log = logging.getLogger("specserve.server")

#: Prompts up to this many characters are tokenized inline (well under a millisecond); longer ones in
#: the server's tokenizer thread.
INLINE_TOKENIZE_CHARS = 16384


def _text_chars(ev: CreateResponse) -> int:
    if isinstance(ev.input, str):
        return len(ev.input)
    return sum(len(m["content"]) for m in ev.messages or ())


@dataclass
class _Response:
    id: str
    event_id: str | None
    metadata: dict
    max_tokens: int
    status: str = "in_progress"  # | "cancelling" (client asked) | "failing" (slow consumer)
    failure: ProtocolError | None = None
    unsent_tokens: int = 0  # tokens whose text is still held back (UTF-8 or stop-string holdback)


class Session:
    """Per-connection state. ``server`` is the SpecServer (llm, worker, config, shared counters)."""

    def __init__(self, ws, server) -> None:
        self.ws = ws
        self.server = server
        self.id = "sess_" + uuid.uuid4().hex[:24]
        self.defaults = dict(server.default_sampling)
        self.speculate = server.drafter_spec is not None
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
                self.handle_frame(message, time.perf_counter())
        except ConnectionClosed:
            pass
        finally:
            self.closed = True
            for resp in self.responses.values():
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
            "drafter": server.drafter_spec if self.speculate else None,
            "available_drafters": self._available_drafters(),
            "defaults": {**self.defaults, "stop": list(self.defaults["stop"])},
            "limits": server.limits(),
        }

    def _available_drafters(self) -> list[str]:
        """What a session may choose: the server's drafter (when it loaded one), or "none"."""
        return ([self.server.drafter_spec] if self.server.drafter_spec else []) + ["none"]

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
        if server.in_flight >= server.max_in_flight:
            raise ProtocolError("server_busy", f"the server has {server.in_flight} responses in flight; try again shortly")
        s = {**self.defaults, **ev.sampling}
        try:
            params = SamplingParams(
                temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], min_p=s["min_p"],
                max_tokens=s["max_output_tokens"], stop=tuple(s["stop"]), seed=s["seed"], ignore_eos=s["ignore_eos"],
            )
        except ValueError as exc:  # parse_event checked every field; this is a backstop
            raise ProtocolError("invalid_value", str(exc)) from None
        if _text_chars(ev) <= INLINE_TOKENIZE_CHARS:
            self._submit(ev, params, prompt_ids(server.llm, ev.input, ev.messages), received)
            return
        # A long text takes milliseconds to seconds to tokenize: do it off the event loop so no other
        # connection's stream stalls, holding this response's place in the limits meanwhile.
        self._tokenizing += 1
        server.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._create_later(ev, params, received))
        self._tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._tasks.discard)

    async def _create_later(self, ev: CreateResponse, params: SamplingParams, received: float) -> None:
        server = self.server
        try:
            ids = await asyncio.get_running_loop().run_in_executor(
                server.tokenize_executor, prompt_ids, server.llm, ev.input, ev.messages)
            if not self.closed:
                self._submit(ev, params, ids, received)
        except ProtocolError as err:
            err.event_id = ev.event_id
            self.outbox.send(error_event(err))
        except Exception as exc:
            log.exception("session %s: tokenizing a prompt failed", self.id)
            err = ProtocolError("internal_error", f"internal error: {type(exc).__name__}", event_id=ev.event_id)
            self.outbox.send(error_event(err))
        finally:
            self._tokenizing -= 1
            server.in_flight -= 1

    def _submit(self, ev: CreateResponse, params: SamplingParams, ids: list[int], received: float) -> None:
        """Hand a tokenized request to the engine thread and announce it."""
        server = self.server
        if len(ids) >= server.context_length:
            raise ProtocolError(
                "context_length_exceeded",
                f"the prompt has {len(ids)} tokens but the context window is {server.context_length}: "
                "leave room for at least one output token",
                "response.input" if ev.input is not None else "response.messages",
            )
        # The Responses protocol ends a reply that reaches the context window as "incomplete"
        # (context_length); the engine refuses prompt + max_tokens past the window, so clamp here.
        room = server.context_length - len(ids)
        asked = params.max_tokens if params.max_tokens is not None else room
        if asked > room:
            params = dataclasses.replace(params, max_tokens=room)
        rid = "resp_" + uuid.uuid4().hex[:24]
        self.responses[rid] = _Response(rid, ev.event_id, ev.metadata, asked)
        server.in_flight += 1
        server.worker.submit(rid, ids, params, self.speculate, received, self.on_update)
        created = {"type": "response.created", "response": {"id": rid, "status": "in_progress", "metadata": ev.metadata}}
        self.outbox.send(with_event_id(created, ev.event_id))

    def _cancel(self, ev: CancelResponse) -> None:
        resp = self.responses.get(ev.response_id)
        if resp is None:
            raise ProtocolError(
                "response_not_found", f"no response {ev.response_id[:64]!r} in flight on this connection", "response_id"
            )
        if resp.status == "in_progress":
            resp.status = "cancelling"
            self.server.worker.cancel(resp.id)
        # Cancelling twice is harmless: the one response.done (status cancelled) answers both.

    def _update(self, ev: UpdateSession) -> None:
        server = self.server
        if ev.drafter is not None:
            if ev.drafter == "none":
                speculate = False
            elif server.drafter_spec is not None and ev.drafter in (server.drafter_spec, server.drafter_name):
                speculate = True
            else:
                loaded = f"drafter {server.drafter_spec!r}" if server.drafter_spec else "no drafter"
                allowed = ", ".join(repr(d) for d in self._available_drafters())
                raise ProtocolError(
                    "drafter_unavailable",
                    f"drafter {ev.drafter[:64]!r} is not loaded: this server loaded {loaded}; a session may use {allowed}",
                    "session.drafter",
                )
            self.speculate = speculate
        self.defaults.update(ev.defaults)
        self.outbox.send(with_event_id({"type": "session.updated", "session": self.describe()}, ev.event_id))

    # ---- engine updates (on the event loop) -------------------------------------------------------

    def on_update(self, update: Update) -> None:
        resp = self.responses.get(update.request_id)
        if resp is None:
            return
        if resp.status == "in_progress":  # after a cancel, nothing more streams
            resp.unsent_tokens += update.num_tokens
            if update.text:
                self.outbox.send_delta(resp.id, update.text, resp.unsent_tokens)
                resp.unsent_tokens = 0
        if update.done is not None:
            del self.responses[resp.id]
            self.server.in_flight -= 1
            self._done(resp, update.done)

    def _done(self, resp: _Response, summary) -> None:
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
            error = ProtocolError("request_rejected", summary.error or "the engine refused the request", event_id=resp.event_id)
            self.outbox.send(error_event(error))
        else:
            body["status"] = "failed"
            error = ProtocolError("internal_error", summary.error or "the engine failed")
        if error is not None:
            body["error"] = error.to_error()
        total = summary.input_tokens + summary.output_tokens
        body["usage"] = {"input_tokens": summary.input_tokens, "output_tokens": summary.output_tokens, "total_tokens": total}
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
                self.server.worker.cancel(resp.id)
