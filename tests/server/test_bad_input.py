"""Bad input: every malformed frame gets one `error` naming the problem; the session and every other
response carry on. Hand-picked cases, then hypothesis-fuzzed frames on one long-lived connection."""

from __future__ import annotations


import pytest

from specserve.server import ERROR_CODES

from server_utils import greedy_text
from wsclient import Conn


def create(**response) -> dict:
    return {"type": "response.create", "event_id": "bad", "response": {"input": "x", **response}}


def without_input(**response) -> dict:
    return {"type": "response.create", "event_id": "bad", "response": response}


# (frame, expected code, expected param or None)
CASES = [
    ("not json", "invalid_json", None),
    ('{"type": "response.create", "response": {"input": "x", "temperature": NaN}}', "invalid_json", None),
    ("[" * 50_000, "invalid_json", None),
    ("[1, 2]", "invalid_event", None),
    ('"hello"', "invalid_event", None),
    ({}, "missing_field", "type"),
    ({"type": 5}, "invalid_type", "type"),
    ({"type": "response.nope", "event_id": "bad"}, "unknown_event_type", "type"),
    ({"type": "response.create", "event_id": "bad"}, "missing_field", "response"),
    ({"type": "response.create", "event_id": "bad", "response": []}, "invalid_type", "response"),
    ({"type": "response.create", "event_id": "bad", "response": {}, "extra": 1}, "unknown_field", "extra"),
    (without_input(), "missing_field", "response.input"),
    (create(messages=[{"role": "user", "content": "x"}]), "invalid_value", "response.input"),
    (create(input=""), "invalid_value", "response.input"),
    (create(input=5), "invalid_type", "response.input"),
    (create(input=[1, "a"]), "invalid_type", "response.input"),
    (create(input=[1, True]), "invalid_type", "response.input"),
    (create(input=[99999]), "invalid_value", "response.input"),
    (without_input(messages=[]), "invalid_value", "response.messages"),
    (without_input(messages=["hi"]), "invalid_type", "response.messages[0]"),
    (without_input(messages=[{"role": "robot", "content": "x"}]), "invalid_value", "response.messages[0].role"),
    (without_input(messages=[{"role": "user"}]), "missing_field", "response.messages[0].content"),
    (without_input(messages=[{"role": "user", "content": 1}]), "invalid_type", "response.messages[0].content"),
    (without_input(messages=[{"role": "user", "content": "x", "name": "n"}]), "unknown_field", "response.messages[0].name"),
    (create(max_output_tokens=0), "invalid_value", "response.max_output_tokens"),
    (create(max_output_tokens=512), "invalid_value", "response.max_output_tokens"),
    (create(max_output_tokens=10**30), "invalid_value", "response.max_output_tokens"),
    (create(max_output_tokens=1.5), "invalid_type", "response.max_output_tokens"),
    (create(max_output_tokens=True), "invalid_type", "response.max_output_tokens"),
    (create(max_output_tokens="5"), "invalid_type", "response.max_output_tokens"),
    (create(temperature=-0.1), "invalid_value", "response.temperature"),
    (create(temperature="hot"), "invalid_type", "response.temperature"),
    (create(temperature=2e-308), "invalid_value", "response.temperature"),  # found by the fuzzer: NaN in sampling
    ('{"type": "response.create", "response": {"input": "x", "temperature": 1e400}}', "invalid_value", "response.temperature"),
    (create(top_p=0), "invalid_value", "response.top_p"),
    (create(top_p=1.5), "invalid_value", "response.top_p"),
    (create(top_p=2e-308), "invalid_value", "response.top_p"),  # found by the fuzzer: underflows fp32, NaN
    (create(top_k=2**70), "invalid_value", "response.top_k"),
    (create(top_k=-1), "invalid_value", "response.top_k"),
    (create(top_k=2.5), "invalid_type", "response.top_k"),
    (create(min_p=2), "invalid_value", "response.min_p"),
    (create(seed=-1), "invalid_value", "response.seed"),
    (create(seed="x"), "invalid_type", "response.seed"),
    (create(stop=[""]), "invalid_value", "response.stop"),
    (create(stop=["s"] * 17), "invalid_value", "response.stop"),
    (create(stop=[1]), "invalid_type", "response.stop"),
    (create(ignore_eos="yes"), "invalid_type", "response.ignore_eos"),
    (create(metadata=[]), "invalid_type", "response.metadata"),
    (create(metadata={"k": 1}), "invalid_value", "response.metadata"),
    (create(metadata={str(i): "v" for i in range(17)}), "invalid_value", "response.metadata"),
    (create(temprature=0.5), "unknown_field", "response.temprature"),
    ({"type": "response.create", "event_id": 5, "response": {"input": "x"}}, "invalid_type", "event_id"),
    ({"type": "response.create", "event_id": "e" * 200, "response": {"input": "x"}}, "invalid_value", "event_id"),
    ({"type": "response.cancel", "event_id": "bad"}, "missing_field", "response_id"),
    ({"type": "response.cancel", "event_id": "bad", "response_id": 5}, "invalid_type", "response_id"),
    ({"type": "response.cancel", "event_id": "bad", "response_id": "resp_nope"}, "response_not_found", "response_id"),
    ({"type": "session.update", "event_id": "bad"}, "missing_field", "session"),
    ({"type": "session.update", "event_id": "bad", "session": {"drafter": 5}}, "invalid_type", "session.drafter"),
    ({"type": "session.update", "event_id": "bad", "session": {"drafter": "medusa"}}, "drafter_unavailable", "session.drafter"),
    ({"type": "session.update", "event_id": "bad", "session": {"defaults": {"temperature": -1}}}, "invalid_value",
     "session.defaults.temperature"),
    ({"type": "session.update", "event_id": "bad", "session": {"defaults": {"input": "x"}}}, "unknown_field",
     "session.defaults.input"),
    ('{"type": "response.create", "response": {"input": "' + "a" * 70_000 + '"}}', "message_too_large", None),
    (create(input="a " * 20_000), "context_length_exceeded", "response.input"),
    (create(input=[7] * 512), "context_length_exceeded", "response.input"),
    (b'{"type": "session.update", "session": {}}', "binary_not_supported", None),
    # structured output: anything wrong in text is invalid_grammar, naming the field
    (create(text="json"), "invalid_grammar", "response.text"),
    (create(text={"fmt": {}}), "invalid_grammar", "response.text.fmt"),
    (create(text={"format": {"type": "yaml"}}), "invalid_grammar", "response.text.format.type"),
    (create(text={"format": {"type": "json_schema"}}), "invalid_grammar", "response.text.format.schema"),
    (create(text={"format": {"type": "json_schema", "schema": "{}"}}), "invalid_grammar", "response.text.format.schema"),
    (create(text={"format": {"type": "json_schema", "schema": {"type": "nope"}}}), "invalid_grammar",
     "response.text.format.schema"),
    (create(text={"format": {"type": "json_schema", "schema": {}, "strict": "yes"}}), "invalid_grammar",
     "response.text.format.strict"),
    (create(text={"format": {"type": "json_object", "schema": {}}}), "invalid_grammar", "response.text.format.schema"),
    (create(text={"format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}), "invalid_grammar",
     "response.text.format.syntax"),
    (create(text={"format": {"type": "grammar", "definition": ""}}), "invalid_grammar", "response.text.format.definition"),
    (create(text={"format": {"type": "grammar", "definition": "start: nope"}}), "invalid_grammar",
     "response.text.format.definition"),
    (create(text={"format": {"type": "grammar", "syntax": "regex", "definition": "[a-"}}), "invalid_grammar",
     "response.text.format.definition"),
    (create(text={"format": {"type": "choice", "choices": ["a", ""]}}), "invalid_grammar", "response.text.format.choices"),
    (create(json_whitespace="wide"), "invalid_value", "response.json_whitespace"),
    ({"type": "session.update", "event_id": "bad", "session": {"defaults": {"text": {}}}}, "unknown_field",
     "session.defaults.text"),
]


def check_error(event: dict, code: str, param: str | None, frame) -> None:
    assert event["type"] == "error", (frame, event)
    err = event["error"]
    assert err["code"] == code, (frame, err)
    assert err["type"] == ERROR_CODES[code]
    assert isinstance(err["message"], str) and err["message"]
    assert err.get("param") == param, (frame, err)
    if isinstance(frame, dict) and frame.get("event_id") == "bad":
        assert event["event_id"] == "bad"


@pytest.fixture(scope="module")
def conn(server):
    c = Conn(server.ws_url)
    yield c
    c.close()


@pytest.mark.parametrize("frame, code, param", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_bad_frame_gets_one_error_and_the_session_goes_on(conn, frame, code, param):
    check_error(conn.expect_error(frame), code, param, frame)
    assert conn.request({"type": "session.update", "session": {}})["type"] == "session.updated"


def test_bad_frames_leave_a_running_response_untouched(server, reference_llm):
    with Conn(server.ws_url) as c:
        rid = c.create(input="import os", max_output_tokens=120, temperature=0, ignore_eos=True)
        for frame, code, param in CASES:
            check_error(c.expect_error(frame), code, param, frame)
        done = c.wait_done(rid)
    assert done["status"] == "incomplete"
    assert c.text(rid) == greedy_text(reference_llm, "import os", 120, ignore_eos=True)


def test_past_twice_the_frame_limit_the_library_closes_with_1009(server):
    from websockets.exceptions import ConnectionClosed

    c = Conn(server.ws_url)
    c.send("x" * (2 * 64 * 1024 + 10))
    with pytest.raises(ConnectionClosed) as info:
        c.pump(10)
    assert info.value.rcvd.code == 1009


# Fuzzing of the same door: test_fuzz_websocket.py.
