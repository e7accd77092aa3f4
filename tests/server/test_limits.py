"""Limits answer with error codes, not hangs; a slow reader fails only its own responses."""

from __future__ import annotations

import json
import socket
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from server_utils import greedy_text, kv_blocks, wait_until
from wsclient import Conn


def test_too_many_responses_on_one_connection(make_server):
    srv = make_server(max_responses_per_connection=2)
    with Conn(srv.ws_url) as c, Conn(srv.ws_url) as other:
        ids = [c.create(input="def f(x):", max_output_tokens=400, ignore_eos=True) for _ in range(2)]
        err = c.request({"type": "response.create", "response": {"input": "x", "max_output_tokens": 2}})
        assert err["type"] == "error" and err["error"]["code"] == "too_many_responses"
        assert err["error"]["type"] == "rate_limit_error" and "limit 2" in err["error"]["message"]
        # another connection is not affected
        rid = other.create(input="import os", max_output_tokens=2)
        assert other.wait_done(rid)["status"] in ("completed", "incomplete")
        for rid in ids:
            c.send({"type": "response.cancel", "response_id": rid})
        for rid in ids:
            assert c.wait_done(rid)["status"] in ("cancelled", "incomplete")
        # the slots are free again
        rid = c.create(input="x", max_output_tokens=2)
        c.wait_done(rid)


def test_server_busy_when_the_queue_is_full(make_server):
    srv = make_server(max_queued=0, llm_kwargs={"max_num_seqs": 1})
    with Conn(srv.ws_url) as a, Conn(srv.ws_url) as b:
        rid = a.create(input="def f(x):", max_output_tokens=400, ignore_eos=True)
        err = b.request({"type": "response.create", "response": {"input": "x", "max_output_tokens": 2}})
        assert err["type"] == "error" and err["error"]["code"] == "server_busy"
        a.send({"type": "response.cancel", "response_id": rid})
        a.wait_done(rid)
        assert b.wait_done(b.create(input="x", max_output_tokens=2))["usage"]["output_tokens"] <= 2


def test_too_many_connections_get_an_error_and_a_1013_close(make_server):
    srv = make_server(max_connections=1)
    with Conn(srv.ws_url) as first:
        second = Conn(srv.ws_url)
        assert second.first["type"] == "error" and second.first["error"]["code"] == "too_many_connections"
        with pytest.raises(ConnectionClosed) as info:
            second.pump(10)
        assert info.value.rcvd.code == 1013
        assert first.wait_done(first.create(input="x", max_output_tokens=2))
    assert wait_until(lambda: srv.server.connections == 0)
    with Conn(srv.ws_url) as again:  # the slot is free again
        assert again.first["type"] == "session.created"


def _stalled_socket(port: int) -> socket.socket:
    """A client socket with a tiny receive buffer, so a reader that stops reading stalls the server fast."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    return sock


def test_a_slow_reader_fails_its_own_responses_and_stalls_no_one(make_server):
    srv = make_server(max_pending_bytes=2048, send_buffer_bytes=4096, max_responses_per_connection=8)
    sock = _stalled_socket(srv.port)
    with connect(srv.ws_url, sock=sock, max_queue=1, open_timeout=10, max_size=None) as slow:
        # Top log-probabilities give each token ~300 bytes that no merging of deltas can shrink: the 8
        # replies' text alone (~12 KB once a late event loop merges their deltas) could fit in the socket's
        # buffers, and a stall would then go unnoticed (CI saw it once, every reply 'incomplete').
        for _ in range(8):
            slow.send('{"type": "response.create", "response": {"input": "def f(x):", "max_output_tokens": 480, '
                      '"ignore_eos": true, "temperature": 0, "top_logprobs": 5}}')
        # While the slow socket is not being read, another client streams normally.
        with Conn(srv.ws_url) as fast:
            t0 = time.monotonic()
            rid = fast.create(input="import os", max_output_tokens=64, ignore_eos=True)
            assert fast.wait_done(rid, timeout=20)["usage"]["output_tokens"] == 64
            assert time.monotonic() - t0 < 15
        # The slow connection's responses were failed (and their KV freed) while nobody read them.
        assert wait_until(lambda: srv.server.in_flight == 0, timeout=30)
        free, total = kv_blocks(srv)
        assert free == total
        # Reading now, the client learns why.
        statuses = []
        while len(statuses) < 8:
            event = json.loads(slow.recv(timeout=30))
            if event["type"] == "response.done":
                statuses.append((event["response"]["status"], event["response"].get("error", {}).get("code")))
    assert ("failed", "slow_consumer") in statuses, statuses
    assert all(s in (("failed", "slow_consumer"), ("incomplete", None)) for s in statuses), statuses


def test_a_long_prompt_is_tokenized_off_the_loop_and_stalls_no_one(server, reference_llm):
    """A long prompt goes to the tokenizer thread and is answered from there; a running response is untouched."""
    with Conn(server.ws_url) as c:
        rid = c.create(input="import os", max_output_tokens=200, ignore_eos=True, temperature=0)
        c.wait_delta(rid)
        long_text = "def f(x): return x + 1 " * 2_600  # 60 KB, under the test server's 64 KiB frame limit
        err = c.request({"type": "response.create", "response": {"input": long_text}})
        assert err["type"] == "error" and err["error"]["code"] == "context_length_exceeded"
        assert "tokens but the context window is 512" in err["error"]["message"]
        c.wait_done(rid)
    assert c.text(rid) == greedy_text(reference_llm, "import os", 200, ignore_eos=True)
