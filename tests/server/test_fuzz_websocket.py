"""Hostile input at the websocket door (issue 19): hypothesis throws arbitrary JSON, plausible-but-wrong
events (wrong types, huge and non-finite numbers, unknown fields, nested garbage, invalid sampling values,
invalid and pathological constraints), binary and oversized frames at one real server on loopback.

Every frame gets exactly one reply before the next sync; an error carries a documented code and a message
with no traceback and no server file path; afterwards the engine is alive and a greedy request still
equals plain decoding. (test_bad_input.py checks each hand-picked case's exact code and param; this is
the one fuzz test of the websocket door.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed

import specserve
from specserve.server import ERROR_CODES

from server_utils import greedy_text, kv_blocks, wait_until
from wsclient import Conn

# What a client-facing message must never show: the server's own layout.
REPO_ROOT = str(Path(specserve.__file__).resolve().parent.parent)
LEAKS = ("Traceback", 'File "', REPO_ROOT, "site-packages", ".py\"", ".py:", ".py'")


def assert_clean(message: str, sent) -> None:
    """No traceback, no server path; a substring the client itself sent may be echoed back."""
    sent = sent.decode("utf-8", "replace") if isinstance(sent, bytes) else str(sent)
    for leak in LEAKS:
        assert leak not in message or leak in sent, (leak, message)


# ---- strategies ---------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-(2**200), 2**200)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=16)
# Bare NaN/Infinity are not JSON; the server reads them as invalid_json rather than crashing on them.
non_finite = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400"])


def wrong(valid):
    """Valid values four times in five (so later fields and the engine get reached), anything the rest."""
    return st.one_of(valid, valid, valid, valid, json_values)


regexes = (st.sampled_from(["(a|aa)*b", "a{0,100000}", "(((((a*)*)*)*)*)", "[\\d\\w]{1,999}", "(?P<x>a)(?P=x)",
                            "\\", "[", "a{2,1}", "(?<=a)b", "\\p{L}+"]) | st.text(max_size=30)
           | st.just(3000).map(lambda n: "x" * n))  # (mapped, not a literal: hypothesis reprs its strategies)
grammars = (st.sampled_from(['start: "a"', "start: start", "start: a\na: b\nb: a", "start: /[a-/", "%import x",
                             'start: "a"{99999}']) | st.text(max_size=40)
            | st.just(2000).map(lambda n: "start: " + " | ".join(f'"{i}"' for i in range(n))))
schemas = st.sampled_from([{}, {"type": "integer"}, {"type": "array", "items": {"type": "boolean"}},
                           {"type": "object", "properties": {"a": {"$ref": "#"}}}, {"$ref": "#/nope"},
                           {"type": "string", "pattern": "("}, {"type": "integer", "minimum": 5, "maximum": 1},
                           {"enum": []}, {"type": "array", "minItems": 10**9}, {"anyOf": []}, {"not": {}},
                           {"type": "string", "format": "bogus"}, {"properties": 5}]) | json_values
formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.fixed_dictionaries({"type": st.just("json_schema"), "schema": schemas}, optional={"strict": wrong(st.booleans())}),
    st.fixed_dictionaries({"type": st.just("grammar"), "definition": wrong(grammars)},
                          optional={"syntax": wrong(st.sampled_from(["lark", "regex"]))}),
    st.fixed_dictionaries({"type": st.just("grammar"), "syntax": st.just("regex"), "definition": regexes}),
    st.fixed_dictionaries({"type": st.just("choice"), "choices": wrong(st.lists(st.text(max_size=6), max_size=4))}),
    json_values,
)
huge = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324, -0.0])
sampling = {
    "max_output_tokens": wrong(st.integers(1, 3) | huge),
    "temperature": wrong(st.floats(0, 2) | huge), "top_p": wrong(st.floats(0, 1) | huge),
    "top_k": wrong(st.integers(0, 40) | huge), "min_p": wrong(st.floats(0, 1) | huge),
    "seed": wrong(st.integers(0, 2**64) | huge), "stop": wrong(st.lists(st.text(max_size=3), max_size=3)),
    "ignore_eos": wrong(st.booleans()),
    "metadata": wrong(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)),
}
response_objects = st.fixed_dictionaries(
    {"input": wrong(st.text(min_size=1, max_size=20) | st.lists(st.integers(-5, 2**40), min_size=1, max_size=5))},
    optional={**sampling, "text": wrong(st.fixed_dictionaries({"format": formats})),
              "json_whitespace": wrong(st.sampled_from(["compact", "flexible"]))})
# The chat form of a prompt: messages, some with roles or contents that are wrong.
messages = wrong(st.lists(st.fixed_dictionaries({"role": wrong(st.sampled_from(["user", "system", "assistant", "robot"])),
                                                 "content": wrong(st.text(max_size=30))}), min_size=1, max_size=3))
chat_objects = st.fixed_dictionaries({"messages": messages},
                                     optional={**sampling, "text": wrong(st.fixed_dictionaries({"format": formats}))})
# A plain prompt and a short reply with a constraint: what reaches the grammar compiler and the engine.
constrained = st.builds(lambda fmt: {"type": "response.create", "response": {"input": "x", "max_output_tokens": 3,
                                                                            "text": {"format": fmt}}}, formats)
events = st.one_of(
    st.builds(lambda r, top: {"type": "response.create", **top, "response": r}, response_objects,
              st.fixed_dictionaries({}, optional={"event_id": wrong(st.text(min_size=1, max_size=8)),
                                                  "extra": json_values})),
    st.builds(lambda r: {"type": "response.create", "response": r}, chat_objects),
    constrained,
    constrained,
    st.fixed_dictionaries({"type": st.just("session.update"), "session": wrong(st.fixed_dictionaries({}, optional={
        "drafter": wrong(st.sampled_from(["ngram", "none", "eagle"]) | st.none()),
        "defaults": wrong(st.fixed_dictionaries({}, optional=sampling))}))}),
    st.fixed_dictionaries({"type": st.just("response.cancel")},
                          optional={"response_id": wrong(st.text(max_size=10)), "event_id": json_values}),
    st.fixed_dictionaries({"type": json_values}, optional={"response": json_values, "session": json_values}),
)


def with_non_finite(event: dict, token: str) -> str:
    """The event's JSON with one bare non-finite number spliced in (Python's json.dumps would write NaN)."""
    return json.dumps(event)[:-1] + f', "x": {token}}}'


frames = st.one_of(
    json_values.map(json.dumps),
    events.map(json.dumps),
    events.map(json.dumps),
    events.map(json.dumps),
    st.builds(with_non_finite, events, non_finite),
    st.integers(1, 400).map(lambda n: "[" * n + "]" * n),  # deep nesting, within and past the parser's limit
    st.integers(1, 400).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.text(max_size=60),
    st.binary(max_size=60),
)

RESET = {"drafter": "ngram", "defaults": {"max_output_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                          "min_p": 0.0, "seed": None, "stop": [], "ignore_eos": False}}


@pytest.fixture(scope="module")
def conn(server):
    c = Conn(server.ws_url)
    yield c
    c.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(frame=frames)
@example(frame='{"type": "response.create", "response": {"input": "x", "temperature": 1e400}}')
@example(frame='{"type": "response.create", "response": {"input": "x", "seed": 18446744073709551616}}')
@example(frame=json.dumps({"type": "response.create", "response": {"input": "x", "max_output_tokens": 1e308}}))
@example(frame=json.dumps({"type": "response.create", "response": {"input": [2**40]}}))
@example(frame="[" * 400 + "]" * 400)
@example(frame=b"\xff\xfe\x00garbage")
# found by this fuzzer: a grammar that compiles but allows nothing failed mid-engine as an internal_error
@example(frame=json.dumps({"type": "response.create", "response": {"input": "x", "max_output_tokens": 3,
                                                                  "text": {"format": {"type": "grammar", "definition": "start: start"}}}}))
# found by this fuzzer: a grammar whose matcher gives up after one token was an internal_error with a state dump
@example(frame=json.dumps({"type": "response.create", "response": {"input": "x", "max_output_tokens": 3,
                                                                  "text": {"format": {"type": "grammar", "definition": 'start: "a"{99999}'}}}}))
def test_every_fuzzed_frame_gets_one_clean_reply(conn, frame):
    c = conn
    c.send(frame)
    sync = c.request({"type": "session.update", "session": RESET})  # replies to `frame` come before this...
    assert sync["type"] == "session.updated", sync
    if not c.other and '"format"' in frame:  # ...except a constrained response's: compiled off the loop
        c.pump()
    replies = list(c.other)
    c.other.clear()
    assert replies, frame
    reply = replies[0]
    event(reply["type"] if reply["type"] != "error" else f"error {reply['error']['code']}")
    assert reply["type"] in ("error", "response.created", "session.updated"), reply
    if reply["type"] == "error":
        err = reply["error"]
        assert err["code"] in ERROR_CODES and err["type"] == ERROR_CODES[err["code"]], err
        assert err["code"] != "internal_error", (frame, err)  # a client mistake is never the server's fault
        assert isinstance(err["message"], str) and err["message"]
        assert_clean(err["message"], frame)
    if reply["type"] == "response.created":
        done = c.wait_done(reply["response"]["id"])
        assert done["status"] in ("completed", "incomplete", "failed"), (frame, done)
        if done["status"] == "failed":
            # The constraint's fault, never the server's: refused by the engine (it does not compile;
            # then one error event too) or its matcher gave up part-way (no error event).
            err = done["error"]
            assert err["code"] in ("invalid_grammar", "request_rejected"), (frame, err)
            assert_clean(err["message"], frame)
            c.request({"type": "session.update", "session": {}})  # the refusal's error event comes before this
            refusal = replies[1:] + [e for e in c.other if e["type"] == "error"]
            c.other.clear()
            assert [e["error"] for e in refusal] in ([err], []), (frame, refusal)
            replies = replies[:1]
    assert len(replies) == 1, (frame, replies)
    for logged in c.log:
        assert logged["type"] in ("error", "response.created", "session.updated", "response.output_text.delta",
                                  "response.done", "session.created")
    c.log.clear()


def test_the_server_still_serves_after_the_fuzzing(server, conn, reference_llm):
    """Runs after the fuzz test in this module: the engine is alive, KV is back, answers are still exact."""
    assert wait_until(lambda: kv_blocks(server)[0] == kv_blocks(server)[1], timeout=30)
    with Conn(server.ws_url) as c:
        rid = c.create(input="def f(x):", max_output_tokens=12, temperature=0, ignore_eos=True)
        assert c.wait_done(rid)["status"] == "incomplete"
        assert c.text(rid) == greedy_text(reference_llm, "def f(x):", 12, ignore_eos=True)


@pytest.mark.parametrize("size", [64 * 1024 + 1, 100_000, 120_000])
def test_an_oversized_frame_is_message_too_large_and_the_session_goes_on(server, size):
    with Conn(server.ws_url) as c:
        frame = json.dumps({"type": "response.create", "response": {"input": "a"}})
        c.send(frame[:-2] + " " * (size - len(frame)) + "}}")
        err = c.wait_other(lambda e: e["type"] == "error")["error"]
        assert err["code"] == "message_too_large" and err["type"] == ERROR_CODES["message_too_large"]
        assert_clean(err["message"], "")
        assert c.request({"type": "session.update", "session": {}})["type"] == "session.updated"


def test_a_text_frame_that_is_not_utf8_closes_with_1007(server):
    """The websocket protocol itself (RFC 6455 §8.1) closes on invalid UTF-8 in a text frame with 1007;
    the library does that before the server sees the frame. The server goes on serving others."""
    c = Conn(server.ws_url)
    c.ws.send(b'{"type": "\xff\xfe"}', text=True)
    with pytest.raises(ConnectionClosed) as info:
        c.pump(10)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1007
    with Conn(server.ws_url) as other:
        assert other.request({"type": "session.update", "session": {}})["type"] == "session.updated"


def test_non_finite_numbers_never_reach_the_engine(conn):
    """Python's json.loads accepts bare NaN and Infinity; the server's parser must not pass them on."""
    for token in ("NaN", "Infinity", "-Infinity"):
        err = conn.expect_error('{"type": "response.create", "response": {"input": "x", "top_p": ' + token + '}}')
        assert err["error"]["code"] == "invalid_json"
