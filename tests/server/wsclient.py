"""A small synchronous test client for the specserve websocket protocol (real sockets, no mocks).

Events are filed as they arrive: deltas and dones by response id, everything else in `other`, so
several responses on one socket can be awaited in any order.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict

from websockets.sync.client import connect


class Conn:
    def __init__(self, url: str, **kwargs) -> None:
        kwargs.setdefault("open_timeout", 10)
        kwargs.setdefault("max_size", None)
        self.ws = connect(url, **kwargs).__enter__()  # closed by close()
        self.log: list[dict] = []
        self.deltas: dict[str, list[dict]] = defaultdict(list)
        self.done: dict[str, dict] = {}
        self.other: list[dict] = []
        self._ids = itertools.count()
        first = self.pump()
        self.other.remove(first)
        self.first = first
        self.session = first.get("session")

    def close(self) -> None:
        self.ws.close()

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, event) -> None:
        self.ws.send(event if isinstance(event, (str, bytes)) else json.dumps(event))

    def pump(self, timeout: float = 30.0) -> dict:
        """Read one event and file it."""
        event = json.loads(self.ws.recv(timeout))
        self.log.append(event)
        kind = event.get("type")
        if kind == "response.output_text.delta":
            self.deltas[event["response_id"]].append(event)
        elif kind == "response.done":
            self.done[event["response"]["id"]] = event["response"]
        else:
            self.other.append(event)
        return event

    def wait_other(self, match, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.other:
                if match(event):
                    self.other.remove(event)
                    return event
            self.pump(max(0.01, deadline - time.monotonic()))

    def request(self, event: dict, timeout: float = 30.0) -> dict:
        """Send an event with a fresh event_id; return the reply that echoes it (created/updated/error)."""
        event_id = f"t{next(self._ids)}"
        self.send({**event, "event_id": event_id})
        return self.wait_other(lambda e: e.get("event_id") == event_id, timeout)

    def create(self, **response) -> str:
        reply = self.request({"type": "response.create", "response": response})
        assert reply["type"] == "response.created", reply
        return reply["response"]["id"]

    def expect_error(self, frame, timeout: float = 30.0) -> dict:
        self.send(frame)
        event = self.wait_other(lambda e: e["type"] in ("error", "response.created", "session.updated"), timeout)
        assert event["type"] == "error", event
        return event

    def wait_done(self, rid: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while rid not in self.done:
            self.pump(max(0.01, deadline - time.monotonic()))
        return self.done[rid]

    def wait_delta(self, rid: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.deltas[rid] and rid not in self.done:
            self.pump(max(0.01, deadline - time.monotonic()))

    def text(self, rid: str) -> str:
        return "".join(d["delta"] for d in self.deltas[rid])
