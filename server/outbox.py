"""One connection's outgoing events: a queue with one writer task, bounded, never blocking others.

Events are queued synchronously (from the engine's deliveries and from message handling) and a
single writer task sends them in order. A reader that keeps up sees each delta the moment it is
queued — there is no batching timer. A slow reader only slows itself: while the writer waits on the
socket, new deltas of a response merge into that response's delta still in the queue, so the queue
holds at most one delta per response; and once the text waiting to go out passes ``max_pending_bytes``
the owner's ``on_overflow`` runs (the session then fails that connection's responses with
``slow_consumer``), which bounds memory however long the reader stalls.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from specserve.server.protocol import delta_event, dumps

log = logging.getLogger("specserve.server")


class _Delta:
    __slots__ = ("response_id", "text", "tokens", "logprobs", "extra_bytes")

    def __init__(self, response_id: str, text: str, tokens: int, logprobs: list | None) -> None:
        self.response_id = response_id
        self.text = text
        self.tokens = tokens
        self.logprobs = logprobs  # one entry per token when the response asked for log-probabilities
        self.extra_bytes = 0  # what the logprobs count against the pending bound


class Outbox:
    """``ws``: an aiohttp WebSocketResponse (anything with ``async send_str``)."""

    def __init__(self, ws, max_pending_bytes: int, on_overflow: Callable[[], None]) -> None:
        self.ws = ws
        self.max_pending_bytes = max_pending_bytes
        self.on_overflow = on_overflow
        self.pending_bytes = 0  # text queued but not yet handed to the socket (deltas' text, events' JSON)
        self.closed = False
        self._queue: deque[_Delta | str] = deque()
        self._open_delta: dict[str, _Delta] = {}  # response id -> its delta still in the queue
        self._wake = asyncio.Event()
        self._overflowed = False

    def send(self, event: dict) -> None:
        """Queue one event (serialized now, so later changes to ``event`` do not leak out)."""
        if self.closed:
            return
        rid = event.get("response", {}).get("id") if event.get("type") == "response.done" else None
        if rid is not None:
            self._open_delta.pop(rid, None)  # nothing may merge into a delta queued before the done
        text = dumps(event)
        self._queue.append(text)
        self._grow(len(text))

    def send_delta(self, response_id: str, text: str, tokens: int, logprobs: list | None = None,
                   logprobs_bytes: int = 0) -> None:
        """Queue text for a response, merging it into that response's queued delta if there is one.
        ``logprobs``: the tokens' log-probability entries (counted as ``logprobs_bytes`` against the bound)."""
        if self.closed:
            return
        open_delta = self._open_delta.get(response_id)
        if open_delta is not None:
            open_delta.text += text
            open_delta.tokens += tokens
            if logprobs is not None:
                if open_delta.logprobs is None:
                    open_delta.logprobs = logprobs
                else:
                    open_delta.logprobs.extend(logprobs)  # (the delta owns its list: the caller's is fresh)
        else:
            open_delta = _Delta(response_id, text, tokens, logprobs)
            self._open_delta[response_id] = open_delta
            self._queue.append(open_delta)
        open_delta.extra_bytes += logprobs_bytes
        self._grow(len(text) + logprobs_bytes)

    def _grow(self, size: int) -> None:
        self.pending_bytes += size
        self._wake.set()
        if self.pending_bytes > self.max_pending_bytes and not self._overflowed:
            self._overflowed = True
            self.on_overflow()

    async def run(self) -> None:
        """The writer task: send queued events in order until the socket closes or close() is called."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue:
                    item = self._queue.popleft()
                    if isinstance(item, _Delta):
                        if self._open_delta.get(item.response_id) is item:
                            del self._open_delta[item.response_id]
                        self.pending_bytes -= len(item.text) + item.extra_bytes
                        frame = dumps(delta_event(item.response_id, item.text, item.tokens, item.logprobs))
                    else:
                        self.pending_bytes -= len(item)
                        frame = item
                    await self.ws.send_str(frame)
                    if self.pending_bytes <= self.max_pending_bytes // 2:
                        self._overflowed = False
                if self.closed:
                    return
        except ConnectionError:  # the socket closed under us: nobody is left to read the rest
            pass
        finally:
            self.closed = True
            self._queue.clear()
            self._open_delta.clear()

    def close(self) -> None:
        """Stop accepting events; the writer sends what is queued, then ends."""
        self.closed = True
        self._wake.set()
