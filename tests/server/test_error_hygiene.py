"""Client-facing errors show no traceback and no server file path (issue 19): every error event and HTTP
error body is made from a ProtocolError, whose message passes through client_safe."""

from __future__ import annotations

import pytest

from specserve.server import ProtocolError
from specserve.server.openai_protocol import error_body
from specserve.server.protocol import client_safe, error_event

TRACEBACK = ('the engine failed: Traceback (most recent call last):\n  File "/work/main/specserve/engine.py", line 531, '
             'in step\n    r.error = x\nRuntimeError: boom')


@pytest.mark.parametrize("message, expected", [
    (TRACEBACK, "the engine failed:"),
    ('bad  File "/srv/app/x.py", line 4, in f', "bad"),
    ("error in /work/main/.venv/lib/python3.11/site-packages/torch/nn/functional.py:123 while x",
     "error in <internal> while x"),
    ("cannot open (/opt/venv/lib/python3.11/site-packages/llguidance)", "cannot open (<internal>)"),
    ("regex [a- failed at src/lib.rs:12: bad", "regex [a- failed at <internal>: bad"),
    ("C:\\srv\\app\\x.py failed", "<internal> failed"),
    (TRACEBACK.split(":", 1)[1], "the request failed"),  # nothing left: still a message
])
def test_client_safe_strips_tracebacks_and_paths(message, expected):
    assert client_safe(message) == expected


@pytest.mark.parametrize("message", [
    "no route POST /v1/chat/completions", "top_p must be in (0, 1], got 1.5", "a.py is a name, 3/4 a fraction",
    "invalid regex: unclosed character class at position 2",
])
def test_ordinary_messages_are_left_alone(message):
    assert client_safe(message) == message


def test_both_doors_get_the_clean_message():
    err = ProtocolError("internal_error", TRACEBACK)
    assert error_event(err)["error"]["message"] == "the engine failed:"
    assert error_body(err)["error"]["message"] == "the engine failed:" and str(err) == "the engine failed:"
