"""`specserve chat`: an interactive terminal chat client for a specserve websocket server.

Each line typed (or piped in) is a user message; the reply streams as it is generated. Ctrl-C
while a reply streams cancels it (``response.cancel``); Ctrl-C at the prompt, or end of input, quits.
``--json`` prints every server event as one JSON line on stdout instead of the text.

The conversation never dead-ends: requests ask for ``truncation: "auto"``, so the server leaves out
the oldest turns (never the system message) when the context would not hold the next reply; the
client drops them from its history too and says so. Each reply ends with a status line: its tokens,
TTFT, tokens/s and τ, and "stopped", "failed: reason" or "cut at N tokens" when it did not complete.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

DEFAULT_URL = "ws://127.0.0.1:8765/v1/ws"


async def open_connection(url: str, api_key: str | None):
    """Connect, turning every way it can fail into one ValueError line."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        return await connect(url, additional_headers=headers, compression=None, open_timeout=10, max_size=None)
    except InvalidStatus as exc:
        status = exc.response.status_code
        hint = " (wrong or missing --api-key)" if status == 401 else ""
        raise ValueError(f"{url} refused the connection: HTTP {status}{hint}") from None
    except InvalidURI as exc:
        raise ValueError(f"--url is not a websocket URL: {exc}") from None
    except ConnectionRefusedError as exc:
        hint = "start one with `specserve serve`" + (", or give --url" if url == DEFAULT_URL else "")
        raise ValueError(f"cannot connect to {url}: no server is running there ({exc or type(exc).__name__}); {hint}") from None
    except (OSError, InvalidHandshake, TimeoutError) as exc:
        raise ValueError(f"cannot connect to {url}: {exc or type(exc).__name__}") from None


def _stdin_lines(loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
    """Lines of stdin, read by a daemon thread (never blocks the loop or interpreter exit); None at EOF."""
    lines: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line.rstrip("\n"))
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, name="stdin", daemon=True).start()
    return lines


@dataclass
class _Reply:
    event_id: str
    sent_at: float
    id: str | None = None
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    first_tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None
    cancel_requested: bool = False
    cancel_sent: bool = False


class ChatClient:
    def __init__(self, ws, args) -> None:
        self.ws = ws
        self.args = args
        self.events: asyncio.Queue = asyncio.Queue()
        self.reply: _Reply | None = None
        self.quit = asyncio.Event()
        self.interrupted = False
        self._n = 0

    def out(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def note(self, text: str) -> None:
        if not self.args.json:
            print(text, file=sys.stderr, flush=True)

    async def receive(self) -> None:
        try:
            async for message in self.ws:
                event = json.loads(message)
                if self.args.json:
                    self.out(message + "\n")
                await self.events.put(event)
        except ConnectionClosed:
            pass
        await self.events.put(None)

    def on_sigint(self) -> None:
        reply = self.reply
        if reply is None or reply.cancel_requested:
            self.interrupted = True
            self.quit.set()
            return
        reply.cancel_requested = True
        self.note("\n[cancelling]")
        self._maybe_cancel()

    def _maybe_cancel(self) -> None:
        reply = self.reply
        if reply and reply.cancel_requested and reply.id and not reply.cancel_sent:
            reply.cancel_sent = True
            asyncio.ensure_future(self.send({"type": "response.cancel", "response_id": reply.id}))

    async def send(self, event: dict) -> None:
        try:
            await self.ws.send(json.dumps(event))
        except ConnectionClosed:
            pass

    async def next_event(self) -> dict:
        """The next server event; ValueError if the connection closed; None if the user quit."""
        getter = asyncio.ensure_future(self.events.get())
        quitter = asyncio.ensure_future(self.quit.wait())
        await asyncio.wait([getter, quitter], return_when=asyncio.FIRST_COMPLETED)
        quitter.cancel()
        if not getter.done():
            getter.cancel()
            return None
        event = getter.result()
        if event is None:
            code = self.ws.close_code
            reason = f" {self.ws.close_reason}" if self.ws.close_reason else ""
            raise ValueError(f"the server closed the connection (code {code}{reason})")
        return event

    async def ask(self, messages: list[dict]) -> str | None:
        """Send one response.create and stream its reply; the reply's text, or None if the user quit.

        When the server leaves older turns out to fit the context, they are removed from ``messages``.
        """
        self._n += 1
        reply = self.reply = _Reply(event_id=f"chat-{self._n}", sent_at=time.perf_counter())
        response: dict = {"messages": list(messages), "truncation": "auto", "stream_pacing": self.args.pacing}
        for key in ("max_output_tokens", "temperature", "seed"):
            value = getattr(self.args, key)
            if value is not None:
                response[key] = value
        if getattr(self.args, "json_schema", None) is not None:
            response["text"] = {"format": {"type": "json_schema", "name": "reply", "schema": self.args.json_schema}}
        await self.send({"type": "response.create", "event_id": reply.event_id, "response": response})
        try:
            while True:
                event = await self.next_event()
                if event is None:
                    return None
                kind = event.get("type")
                if kind == "response.created" and event.get("event_id") == reply.event_id:
                    reply.id = event["response"]["id"]
                    dropped = event["response"].get("dropped_messages", 0)
                    if dropped:
                        _drop_oldest(messages, dropped)
                        self.note(f"[{dropped} older messages were left out to fit the context]")
                    self._maybe_cancel()
                elif kind == "response.output_text.delta" and event.get("response_id") == reply.id:
                    now = time.perf_counter()
                    if reply.first_at is None:
                        reply.first_at, reply.first_tokens = now, event["tokens"]
                    reply.last_at = now
                    reply.tokens += event["tokens"]
                    reply.text.append(event["delta"])
                    if not self.args.json:
                        self.out(event["delta"])
                elif kind == "response.done" and event["response"]["id"] == reply.id:
                    self._summary(reply, event["response"])
                    return "".join(reply.text)
                elif kind == "error":
                    err = event["error"]
                    mine = event.get("event_id") == reply.event_id and reply.id is None
                    self.note(f"error: {err['code']}: {err['message']}" + (" (message not sent)" if mine else ""))
                    if mine:
                        return ""
        finally:
            self.reply = None

    def _summary(self, reply: _Reply, response: dict) -> None:
        if self.args.json:
            return
        self.out("\n")
        parts = [f"{response['usage']['output_tokens']} tokens"]
        if reply.first_at is not None:
            parts.append(f"TTFT {(reply.first_at - reply.sent_at) * 1e3:.0f} ms")
            later = reply.tokens - reply.first_tokens
            if reply.last_at and reply.last_at > reply.first_at and later > 0:
                parts.append(f"{later / (reply.last_at - reply.first_at):.1f} tok/s")
        if response["spec"]["steps"]:
            parts.append(f"τ {response['spec']['tau']:.2f}")
        status = reply_status(response)
        if status:
            parts.append(status)
        self.note("[" + " · ".join(parts) + "]")

    async def run(self) -> int:
        receiver = asyncio.ensure_future(self.receive())
        event = await self.next_event()
        if event is None:
            return 130
        if event.get("type") == "error":
            raise ValueError(f"the server refused the session: {event['error']['message']}")
        session = event["session"]
        self.note(f"connected to {session['model']} (drafter {session['drafter'] or 'none'}); "
                  "Ctrl-C stops a reply, Ctrl-D or Ctrl-C at the prompt quits")
        if self.args.drafter is not None:
            await self.send({"type": "session.update", "event_id": "chat-drafter", "session": {"drafter": self.args.drafter}})
            while (event := await self.next_event()) is not None:
                if event.get("event_id") == "chat-drafter":
                    if event["type"] == "error":
                        raise ValueError(event["error"]["message"])
                    break
        messages = [{"role": "system", "content": self.args.system}] if self.args.system else []
        lines = _stdin_lines(asyncio.get_running_loop())
        tty = sys.stdin.isatty()
        while not self.quit.is_set():
            if tty and not self.args.json:
                self.out("> ")
            getter = asyncio.ensure_future(lines.get())
            quitter = asyncio.ensure_future(self.quit.wait())
            await asyncio.wait([getter, quitter], return_when=asyncio.FIRST_COMPLETED)
            quitter.cancel()
            if not getter.done():
                getter.cancel()
                break
            line = getter.result()
            if line is None:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            text = await self.ask(messages)
            if text is None:
                break
            if text:
                messages.append({"role": "assistant", "content": text})
            else:  # refused (an error) or an empty reply: the turn leaves no trace in the conversation
                messages.pop()
        if tty and not self.args.json:
            self.out("\n")  # quitting at the "> " prompt (Ctrl-D, Ctrl-C) leaves the shell a fresh line
        receiver.cancel()
        await self.ws.close()
        return 130 if self.interrupted else 0


def reply_status(response: dict) -> str:
    """How a finished reply ended, in words ("" when it completed): the page says the same."""
    status = response["status"]
    if status == "cancelled":
        return "stopped"
    if status == "failed":
        return "failed: " + response.get("error", {}).get("message", "unknown error")
    if status == "incomplete":
        return f"cut at {response['usage']['output_tokens']} tokens"
    return ""


def _drop_oldest(messages: list[dict], count: int) -> None:
    """Remove the ``count`` oldest non-system messages, as the server left them out."""
    keep, dropped = [], 0
    for m in messages:
        if dropped < count and m["role"] not in ("system", "developer"):
            dropped += 1
            continue
        keep.append(m)
    messages[:] = keep


async def _main(args) -> int:
    ws = await open_connection(args.url, args.api_key)
    client = ChatClient(ws, args)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, client.on_sigint)
    try:
        return await client.run()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await ws.close()


def run_chat(args) -> int:
    return asyncio.run(_main(args))
