"""The connections of `specserve bench soak`: a websocket client and an HTTP/SSE client that check, as
they read, that every response ends with exactly one terminal event, and a Tally of what they saw.

Real sockets only (the ``websockets`` and ``aiohttp`` client libraries), no mocks. Every websocket
client event carries an ``event_id``, and the connection's reader task files each server event as it
arrives: replies (``response.created``, ``session.updated``, ``error``) by event id, deltas and
``response.done`` by response id. A response that gets a delta after its ``response.done``, a second
``response.done``, or events nobody created is a terminal-event violation on the spot; one whose
``response.done`` never comes is one when its script stops waiting (``TIMEOUT_S``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

#: How long a script waits for any one reply or terminal event before it calls it missing. Generous:
#: a loaded 2-core machine with 64 clients can take seconds per response, and a miss is a failure.
TIMEOUT_S = 120.0
#: Violations kept word for word in the report (all are counted).
MAX_KEPT = 40


class Tally:
    """What every client saw, shared by all of them (one event loop: no locks).

    kinds: actions run, by script kind; terminals: terminal events by API and status; checks: answers
    compared with a reference (``greedy``, ``seeded``); violations: broken invariants by category —
    ``terminal`` (missing, duplicate or stray terminal events), ``mismatch`` (a greedy answer that is not
    its solo reference: cross-over or corruption), ``seed`` (a seeded sampled answer that did not
    reproduce), ``answer`` (a documented answer that did not come: wrong error code, a well-behaved
    request failing, a connection the server dropped).
    """

    def __init__(self) -> None:
        self.kinds: Counter = Counter()
        self.terminals: Counter = Counter()
        self.checks: Counter = Counter()
        self.violations: Counter = Counter()
        self.examples: list[str] = []
        self.ttft_ms: dict[str, list[float]] = defaultdict(list)  # phase -> well-behaved TTFTs
        self.itl_ms: dict[str, list[float]] = defaultdict(list)  # phase -> well-behaved inter-token gaps
        # phase -> where a well-behaved TTFT went: per action, and (websocket) the server's own timing —
        # queue_ms (receipt -> admitted to the batch), ttft_ms (receipt -> first token sampled)
        self.ttft_by_action: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.server_ms: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.phase = "warmup"

    def violation(self, category: str, what: str) -> None:
        self.violations[category] += 1
        if len(self.examples) < MAX_KEPT:
            self.examples.append(f"{category}: {what}")

    def expect_error(self, where: str, got: dict | None, code: str) -> None:
        """A hostile input must be answered with its documented error code."""
        got_code = (got or {}).get("code")
        if got_code != code:
            self.violation("answer", f"{where}: expected error {code}, got {got_code or got!r}")

    def latency(self, stream: Delivered, action: str = "", timing: dict | None = None) -> None:
        """Record a well-behaved response's client-side TTFT and inter-token gaps in the current phase;
        `action` and the server's `timing` (response.done's) say where its TTFT went."""
        if stream.first is not None:
            ttft = (stream.first - stream.sent) * 1e3
            self.ttft_ms[self.phase].append(ttft)
            self.ttft_by_action[self.phase][action].append(ttft)
        for name, value in (timing or {}).items():
            if value is not None and name in ("queue_ms", "ttft_ms"):
                self.server_ms[self.phase][name].append(value)
        self.itl_ms[self.phase].extend(stream.itl_ms)


@dataclass
class Delivered:
    """One response's stream as the client saw it: text, token counts and arrival times."""

    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    itl_ms: list[float] = field(default_factory=list)  # per token: the gap since the previous delivery / its tokens
    parts: list[str] = field(default_factory=list)

    def add(self, now: float, text: str, tokens: int) -> None:
        self.parts.append(text)
        if tokens <= 0:
            return
        if self.first is None:
            self.first = now
        else:
            self.itl_ms += [(now - self.last) * 1e3 / tokens] * tokens
        self.last = now
        self.tokens += tokens

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class WsResponse:
    id: str
    seen: Delivered
    done: dict | None = None  # the response object of its response.done
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class WsConn:
    """One websocket connection with its reader task. ``open`` reads session.created first."""

    def __init__(self, ws, tally: Tally, label: str) -> None:
        self.ws = ws
        self.tally = tally
        self.label = label
        self.session: dict = {}
        self.responses: dict[str, WsResponse] = {}
        self.replies: dict[str, list[dict]] = defaultdict(list)  # event_id -> every reply that echoed it
        self._waiting: dict[str, asyncio.Future] = {}
        self._sent: dict[str, float] = {}
        self._anonymous: asyncio.Queue = asyncio.Queue()  # errors without an event_id (frames that did not parse)
        self._ids = itertools.count()
        self.reading = asyncio.Event()  # cleared: the reader stops reading (a slow reader), TCP fills up
        self.reading.set()
        self.closed = asyncio.Event()
        self.close_code: int | None = None
        self._reader: asyncio.Task | None = None

    @classmethod
    async def open(cls, url: str, tally: Tally, label: str, max_queue: int = 16, rcvbuf: int | None = None) -> WsConn:
        """``max_queue`` frames buffered unread, ``rcvbuf`` the socket's kernel receive buffer (None: the OS's,
        which grows to megabytes on loopback): both small make a reader that stops reading felt by the server."""
        from websockets.asyncio.client import connect

        sock = None
        if rcvbuf is not None:
            host, port = urlsplit(url).hostname, urlsplit(url).port
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connecting: the window is agreed then
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        ws = await connect(url, compression=None, max_size=None, max_queue=max_queue, open_timeout=TIMEOUT_S,
                           ping_interval=None, sock=sock)
        conn = cls(ws, tally, label)
        first = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
        if first.get("type") != "session.created":
            tally.violation("answer", f"{label}: first event {first.get('type')!r}, not session.created")
        conn.session = first.get("session", {})
        conn._reader = asyncio.create_task(conn._read())
        return conn

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in self.ws:
                await self.reading.wait()
                self._file(json.loads(raw), time.perf_counter())
        except ConnectionClosed:
            pass
        except Exception as exc:  # a bug of this client, not the server's: say so rather than wait out timeouts
            self.tally.violation("answer", f"{self.label}: the client's reader failed: {type(exc).__name__}: {exc}")
        finally:
            self.close_code = self.ws.close_code
            self.closed.set()
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_result(None)  # None: the connection closed before the reply

    def _open_response(self, rid, where: str, after_done: str) -> "WsResponse | None":
        """The response an output event belongs to, or None (a terminal-event violation counted) when it
        was never created or has already ended (`after_done` words that case)."""
        resp = self.responses.get(rid)
        if resp is None:
            self.tally.violation("terminal", f"{where} for a response never created")
        elif resp.done is not None:
            self.tally.violation("terminal", f"{where}{after_done} {resp.id}")
            return None
        return resp

    def _file(self, event: dict, now: float) -> None:
        kind = event.get("type")
        eid = event.get("event_id")
        where = f"{self.label}: {kind}"
        if kind == "response.output_text.delta":
            resp = self._open_response(event.get("response_id"), where, " after response.done of")
            if resp is not None:
                resp.seen.add(now, event["delta"], event["tokens"])
            return
        if kind == "response.done":
            body = event.get("response", {})
            resp = self._open_response(body.get("id"), where, ": a second one for")
            if resp is not None:
                resp.done = body
                resp.finished.set()
                self.tally.terminals[f"websocket {body.get('status')}"] += 1
            return
        if kind == "response.created":
            rid = event["response"]["id"]
            self.responses[rid] = WsResponse(rid, Delivered(self._sent.get(eid, now)))
        if kind in ("response.created", "session.updated", "error"):
            if eid is None:
                self._anonymous.put_nowait(event)
                return
            self.replies[eid].append(event)
            fut = self._waiting.pop(eid, None)
            if fut is not None and not fut.done():
                fut.set_result(event)
            return
        self.tally.violation("answer", f"{where}: an event type the protocol does not define")

    # ---- sending ----------------------------------------------------------------------------------

    async def send_raw(self, frame: str | bytes) -> None:
        await self.ws.send(frame)

    async def send(self, event: dict) -> None:
        """Send ``event`` with a fresh event_id without waiting for a reply (a cancel is answered by the
        response's response.done; its error, when the response had already ended, is filed unread)."""
        await self.ws.send(json.dumps({**event, "event_id": f"{self.label}-{next(self._ids)}"}))

    async def request(self, event: dict) -> dict | None:
        """Send ``event`` with a fresh event_id; the first reply that echoes it (None: the socket closed)."""
        eid = f"{self.label}-{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._waiting[eid] = fut
        self._sent[eid] = time.perf_counter()
        await self.ws.send(json.dumps({**event, "event_id": eid}))
        try:
            return await asyncio.wait_for(fut, TIMEOUT_S)
        except TimeoutError:
            self.tally.violation("answer", f"{self.label}: no reply to {event.get('type')} within {TIMEOUT_S:g} s")
            return None
        finally:
            self._waiting.pop(eid, None)
            self._sent.pop(eid, None)

    async def anonymous_error(self) -> dict | None:
        """The next error answering a frame that carried no event_id (it did not parse)."""
        try:
            return await asyncio.wait_for(self._anonymous.get(), TIMEOUT_S)
        except TimeoutError:
            return None

    async def create(self, response: dict) -> tuple[WsResponse | None, dict | None]:
        """``response.create``: (the response, None) once created, or (None, the error object) when refused."""
        reply = await self.request({"type": "response.create", "response": response})
        if reply is None:
            return None, None
        if reply["type"] == "response.created":
            return self.responses[reply["response"]["id"]], None
        self.tally.terminals["websocket refused"] += 1
        return None, reply.get("error")

    async def finish(self, resp: WsResponse) -> dict | None:
        """Wait for ``resp``'s response.done (a missing one is a violation); its response object."""
        try:
            await asyncio.wait_for(resp.finished.wait(), TIMEOUT_S)
        except TimeoutError:
            self.tally.violation("terminal", f"{self.label}: no response.done for {resp.id} within {TIMEOUT_S:g} s")
            return None
        return resp.done

    async def settle(self) -> None:
        """Every response created on this connection has had its response.done (violations otherwise)."""
        for resp in list(self.responses.values()):
            if resp.done is None:
                await self.finish(resp)

    def forget_finished(self) -> None:
        """Drop finished responses (a long-lived connection would otherwise keep every text it saw)."""
        for rid in [rid for rid, r in self.responses.items() if r.done is not None]:
            del self.responses[rid]
        self.replies.clear()

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    def abort(self) -> None:
        """Drop the TCP connection without a close frame: a client that crashed or lost its network."""
        self.ws.transport.abort()


# ---- HTTP ---------------------------------------------------------------------------------------------


@dataclass
class HttpResult:
    status: int
    seen: Delivered
    error: dict | None = None  # the error object (a non-200 answer, or an error chunk in the stream)
    finish_reason: str | None = None


async def http_stream(session, url: str, body: dict | bytes, tally: Tally, label: str,
                      stop_after_chunks: int | None = None) -> HttpResult | None:
    """POST ``body`` to ``url`` (a completions route) with ``stream: true`` and read the server-sent events.

    A stream must end with exactly one terminal chunk (one carrying a finish_reason, or an error chunk)
    followed by ``data: [DONE]``, and nothing after it. ``stop_after_chunks``: close the connection after
    that many chunks, mid-stream (a client that goes away; None is returned).
    """
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    seen = Delivered(time.perf_counter())
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            try:
                error = (await resp.json(content_type=None)).get("error")
            except ValueError:
                error = {"code": f"not JSON: {(await resp.text())[:80]!r}"}
            tally.terminals[f"http {resp.status}"] += 1
            return HttpResult(resp.status, seen, error)
        terminals, done_marks, after_done = 0, 0, 0
        result = HttpResult(200, seen)
        counted = chunks = 0
        async for raw in resp.content:  # "data: {json}" lines with blank lines between
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if done_marks:
                after_done += 1
                continue
            if payload == b"[DONE]":
                done_marks += 1
                continue
            chunk = json.loads(payload)
            chunks += 1
            if "error" in chunk:
                terminals += 1
                result.error = chunk["error"]
                continue
            usage = chunk.get("usage")
            for choice in chunk.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                tokens = usage["completion_tokens"] - counted if usage else int(bool(text))
                if usage:
                    counted = usage["completion_tokens"]
                seen.add(time.perf_counter(), text, tokens)
                if choice.get("finish_reason") is not None:
                    terminals += 1
                    result.finish_reason = choice["finish_reason"]
            if stop_after_chunks is not None and chunks >= stop_after_chunks:
                resp.close()  # drop the connection mid-stream: the server must cancel the request
                return None
    if terminals != 1 or done_marks != 1 or after_done:
        tally.violation("terminal", f"{label}: SSE stream with {terminals} terminal chunk(s), {done_marks} [DONE], "
                                    f"{after_done} event(s) after it")
    tally.terminals["http " + ("error chunk" if result.error else f"finish {result.finish_reason}")] += 1
    return result


async def http_whole(session, url: str, body: dict, tally: Tally, label: str) -> HttpResult:
    """POST ``body`` with ``stream: false``: one JSON answer, the whole text and its finish_reason."""
    seen = Delivered(time.perf_counter())
    async with session.post(url, json=body) as resp:
        answer = await resp.json(content_type=None)
        tally.terminals[f"http {resp.status}" if resp.status != 200 else "http whole"] += 1
        if resp.status != 200:
            return HttpResult(resp.status, seen, answer.get("error") if isinstance(answer, dict) else None)
    choice = answer["choices"][0]
    seen.add(time.perf_counter(), choice.get("text") or choice.get("message", {}).get("content") or "",
             answer["usage"]["completion_tokens"])
    return HttpResult(200, seen, None, choice.get("finish_reason"))


async def http_post(session, url: str, body: dict | bytes, tally: Tally) -> tuple[int, dict | None]:
    """A request expected to be refused: (status, the error object)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        tally.terminals[f"http {resp.status}"] += 1
        try:
            answer = await resp.json(content_type=None)
        except ValueError:
            return resp.status, None
        return resp.status, answer.get("error") if isinstance(answer, dict) else None


async def http_send_and_leave(base: str, path: str, body: dict) -> None:
    """Send a whole request on a raw socket and close our side at once (no reading): the server finds the
    request and an end of stream together, and its answer has nowhere to go."""
    url = urlsplit(base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    writer.write_eof()
    try:
        await asyncio.wait_for(reader.read(), TIMEOUT_S)  # until the server closes too
    except (TimeoutError, ConnectionError):
        pass
    writer.close()
