"""Bad input: every malformed frame gets one `error` naming the problem; the session and every other
response carry on. Hand-picked cases, then hypothesis-fuzzed frames on one long-lived connection."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

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


# ---- fuzzing ------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def mostly(valid, invalid=json_values):
    """Valid values four times in five, so fuzzed events reach deep into validation and the engine."""
    return st.one_of(valid, valid, valid, valid, invalid)


sampling_values = {
    "max_output_tokens": mostly(st.integers(-1, 4)),
    "temperature": mostly(st.floats(-0.5, 2, allow_nan=False) | st.floats(0, 1e-3)),
    "top_p": mostly(st.floats(-0.2, 1.2, allow_nan=False) | st.floats(0, 1e-5)),
    "top_k": mostly(st.integers(-2, 50)),
    "min_p": mostly(st.floats(-0.2, 1.2, allow_nan=False)),
    "seed": mostly(st.none() | st.integers(-2, 2**64)),
    "stop": mostly(st.text(min_size=1, max_size=3) | st.lists(st.text(max_size=3), max_size=3)),
    "ignore_eos": mostly(st.booleans()),
}
messages = mostly(st.lists(
    st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "system", "assistant", "robot"])),
                           "content": mostly(st.text(max_size=30))}),
    min_size=1, max_size=3,
))
text_formats = st.one_of(
    st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.fixed_dictionaries({"type": st.just("json_schema")}, optional={
        "schema": mostly(st.sampled_from([{}, {"type": "integer"}, {"type": "array", "items": {"type": "boolean"}}])),
        "name": mostly(st.text(max_size=5)), "strict": mostly(st.booleans())}),
    st.fixed_dictionaries({"type": st.just("grammar")}, optional={
        "syntax": mostly(st.sampled_from(["lark", "regex"])),
        "definition": mostly(st.sampled_from(["[0-9]+", "a|b", 'start: "x"+', "()"]) | st.text(max_size=8))}),
    st.fixed_dictionaries({"type": st.just("choice")}, optional={"choices": mostly(st.lists(st.text(max_size=4), max_size=3))}),
)
response_objects = st.fixed_dictionaries({}, optional={
    "metadata": mostly(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)),
    "text": mostly(st.fixed_dictionaries({}, optional={"format": mostly(text_formats)})),
    "json_whitespace": mostly(st.sampled_from(["compact", "flexible"])),
    **sampling_values,
})
create_events = st.builds(
    lambda prompt, response, top: {"type": "response.create", **top, "response": {**prompt, **response}},
    st.one_of(
        st.fixed_dictionaries({"input": mostly(st.text(min_size=1, max_size=40) | st.lists(st.integers(-2, 301), min_size=1, max_size=8))}),
        st.fixed_dictionaries({"messages": messages}),
        st.fixed_dictionaries({}, optional={"input": json_values, "messages": json_values}),
    ),
    response_objects,
    st.fixed_dictionaries({}, optional={"event_id": mostly(st.text(min_size=1, max_size=10))}),
)
cancel_events = st.fixed_dictionaries({"type": st.just("response.cancel")},
                                      optional={"response_id": mostly(st.text(max_size=10)),
                                                "event_id": mostly(st.text(min_size=1, max_size=10))})
update_events = st.fixed_dictionaries({"type": st.just("session.update"), "session": mostly(st.fixed_dictionaries({}, optional={
    "drafter": mostly(st.sampled_from(["ngram", "none", "eagle"]) | st.none()),
    "defaults": mostly(st.fixed_dictionaries({}, optional=sampling_values)),
}))})
any_events = st.fixed_dictionaries({"type": mostly(st.sampled_from(["response.create", "response.cancel", "session.update", "x"]))},
                                   optional={"event_id": json_values, "response": json_values, "session": json_values,
                                             "response_id": json_values})
frames = st.one_of(
    st.text(max_size=120),
    json_values.map(json.dumps),
    st.binary(max_size=40),
    any_events.map(json.dumps),
    create_events.map(json.dumps),
    create_events.map(json.dumps),
    cancel_events.map(json.dumps),
    update_events.map(json.dumps),
)

RESET = {"drafter": "ngram", "defaults": {"max_output_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                          "min_p": 0.0, "seed": None, "stop": [], "ignore_eos": False}}


@pytest.fixture(scope="module")
def fuzz_conn(server):
    c = Conn(server.ws_url)
    yield c
    c.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=frames)
def test_fuzzed_frames_get_exactly_one_well_formed_reply(fuzz_conn, frame):
    c = fuzz_conn
    c.send(frame)
    sync = c.request({"type": "session.update", "session": RESET})  # every reply to `frame` comes before this one
    assert sync["type"] == "session.updated"
    replies = list(c.other)
    c.other.clear()
    assert len(replies) == 1, (frame, replies)
    reply = replies[0]
    event(reply["type"] if reply["type"] != "error" else f"error {reply['error']['code']} {reply['error'].get('param')}")
    assert reply["type"] in ("error", "response.created", "session.updated"), reply
    if reply["type"] == "error":
        err = reply["error"]
        assert err["code"] in ERROR_CODES and err["type"] == ERROR_CODES[err["code"]]
        assert isinstance(err["message"], str) and err["message"]
    elif reply["type"] == "response.created":
        done = c.wait_done(reply["response"]["id"])
        assert done["status"] in ("completed", "incomplete"), done
    for logged in c.log:
        assert logged["type"] in ("error", "response.created", "session.updated", "response.output_text.delta",
                                 "response.done", "session.created")
    c.log.clear()
