"""Structured output through every way into a real server on loopback: the websocket's ``text.format``,
the OpenAI API's ``response_format`` and vLLM's ``guided_*`` / ``structured_outputs`` (the real openai
client). The tiny random model writes gibberish, but gibberish that satisfies the constraint; anything
invalid is ``invalid_grammar`` (a 400 over HTTP) and the server goes on serving."""

from __future__ import annotations

import json
import re

import openai
import pytest

from server_utils import greedy_text, kv_blocks, wait_until
from wsclient import Conn

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}
REGEX = "[a-z]{3}-[0-9]{2}"
LARK = 'start: "x" NUM ("," NUM)?\nNUM: /[0-9]{1,3}/'
LARK_MATCHES = re.compile(r"x[0-9]{1,3}(,[0-9]{1,3})?")
CHOICES = ["red", "green", "blue"]


def check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"a", "b"}, text
    assert isinstance(obj["a"], int) and not isinstance(obj["a"], bool) and 0 <= obj["a"] <= 999, text
    assert isinstance(obj["b"], bool), text


# (text.format, check of the output)
WS_FORMATS = [
    ({"type": "json_schema", "name": "ab", "schema": SCHEMA, "strict": True}, check_schema),
    ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
    ({"type": "grammar", "syntax": "regex", "definition": REGEX}, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    ({"type": "grammar", "syntax": "lark", "definition": LARK}, lambda text: LARK_MATCHES.fullmatch(text) or pytest.fail(text)),
    ({"type": "choice", "choices": CHOICES}, lambda text: text in CHOICES or pytest.fail(text)),
]


# ---- websocket --------------------------------------------------------------------------------------


def test_websocket_text_format_constrains_each_response(server, reference_llm):
    """Every format, greedy and sampled (a socket each), all at once beside a plain response: each output
    satisfies its own constraint and completes; the plain one is untouched."""
    with Conn(server.ws_url) as greedy, Conn(server.ws_url) as sampled:
        plain = greedy.create(input="import os", max_output_tokens=40, temperature=0, ignore_eos=True)
        rids = []
        for c, temperature in ((greedy, 0), (sampled, 1.0)):
            for fmt, check in WS_FORMATS:
                rid = c.create(input="hello", max_output_tokens=64, temperature=temperature, seed=7, text={"format": fmt})
                rids.append((c, rid, fmt, check))
        for c, rid, fmt, check in rids:
            done = c.wait_done(rid)
            assert done["status"] == "completed", (fmt, done, c.text(rid))
            check(c.text(rid))
            assert sum(d["tokens"] for d in c.deltas[rid]) == done["usage"]["output_tokens"]
        greedy.wait_done(plain)
    assert greedy.text(plain) == greedy_text(reference_llm, "import os", 40, ignore_eos=True)


def test_websocket_text_format_with_messages_and_flexible_whitespace(server):
    with Conn(server.ws_url) as c:
        rid = c.create(messages=[{"role": "user", "content": "give me a and b"}], max_output_tokens=64, temperature=0,
                       text={"format": {"type": "json_schema", "schema": SCHEMA}})
        assert c.wait_done(rid)["status"] == "completed"
        check_schema(c.text(rid))
        # Flexible whitespace: a random model may spend its tokens on whitespace, so it may not finish; what
        # it wrote is whitespace-tolerant JSON so far, and a finished one is valid.
        rid = c.create(input="hello", max_output_tokens=64, temperature=0, json_whitespace="flexible",
                       text={"format": {"type": "json_schema", "schema": SCHEMA}})
        done = c.wait_done(rid)
        assert done["status"] in ("completed", "incomplete")
        if done["status"] == "completed":
            check_schema(c.text(rid))
        # {"type": "text"} (or no text at all) is no constraint.
        rid = c.create(input="import os", max_output_tokens=8, temperature=0, ignore_eos=True, text={"format": {"type": "text"}})
        assert c.wait_done(rid)["status"] == "incomplete" and c.wait_done(rid)["usage"]["output_tokens"] == 8


def test_websocket_cut_by_max_output_tokens_is_incomplete(server):
    with Conn(server.ws_url) as c:
        rid = c.create(input="hello", max_output_tokens=3, temperature=0, text={"format": {"type": "json_schema", "schema": SCHEMA}})
        done = c.wait_done(rid)
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert c.text(rid).startswith("{") and done["usage"]["output_tokens"] == 3


def test_websocket_invalid_format_is_invalid_grammar_and_the_session_goes_on(server):
    bad = [
        ({"format": {"type": "json_schema", "schema": {"type": "nope"}}}, "response.text.format.schema", "json_schema"),
        ({"format": {"type": "grammar", "definition": "start: foo"}}, "response.text.format.definition", "grammar"),
        ({"format": {"type": "grammar", "syntax": "regex", "definition": "(("}}, "response.text.format.definition", "regex"),
        ({"format": {"type": "xml"}}, "response.text.format.type", "json_schema"),
    ]
    with Conn(server.ws_url) as c:
        running = c.create(input="import os", max_output_tokens=60, temperature=0, ignore_eos=True)
        for text, param, needle in bad:
            reply = c.request({"type": "response.create", "response": {"input": "x", "text": text}})
            assert reply["type"] == "error", reply
            err = reply["error"]
            assert err["code"] == "invalid_grammar" and err["type"] == "invalid_request_error", err
            assert err["param"] == param and needle in err["message"] and "\n" not in err["message"], err
        rid = c.create(input="hello", max_output_tokens=64, text={"format": {"type": "choice", "choices": CHOICES}})
        assert c.wait_done(rid)["status"] == "completed" and c.text(rid) in CHOICES
        assert c.wait_done(running)["status"] == "incomplete"
    assert wait_until(lambda: server.server.in_flight == 0)


def test_engine_refusal_of_a_constraint_names_the_field(make_server, small_vocab_dir):
    """A model without a tokenizer cannot follow a grammar: the engine refuses the request, and both APIs
    say so with the field that asked for it (tokenizer_unavailable); the next request is served."""
    srv = make_server(model_dir=small_vocab_dir)
    with Conn(srv.ws_url) as c:
        c.send({"type": "response.create", "event_id": "g",
                "response": {"input": [1, 2, 3], "max_output_tokens": 4, "text": {"format": {"type": "json_object"}}}})
        err = c.wait_other(lambda e: e["type"] == "error")
        assert err["error"]["code"] == "tokenizer_unavailable" and err["error"]["param"] == "response.text.format"
        assert err["event_id"] == "g"
        rid = c.create(input=[1, 2, 3], max_output_tokens=4, ignore_eos=True)
        assert c.wait_done(rid)["usage"]["output_tokens"] == 4
    client = openai.OpenAI(base_url=srv.openai_base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=srv.server.model_name, prompt=[1, 2, 3], max_tokens=4,
                                  extra_body={"guided_regex": "[0-9]+"})
    assert info.value.code == "tokenizer_unavailable" and info.value.param == "guided_regex"
    assert client.completions.create(model=srv.server.model_name, prompt=[1, 2, 3], max_tokens=2).usage.completion_tokens <= 2
    assert wait_until(lambda: kv_blocks(srv)[0] == kv_blocks(srv)[1] and srv.server.in_flight == 0)


# ---- the OpenAI-compatible HTTP API -----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=60)


def test_chat_response_format_json_schema_whole_and_streamed(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "give me a and b"}]
    resp = client.chat.completions.create(model=server.server.model_name, messages=messages, max_tokens=64,
                                          temperature=0, response_format=fmt)
    assert resp.choices[0].finish_reason == "stop"
    check_schema(resp.choices[0].message.content)
    stream = client.chat.completions.create(model=server.server.model_name, messages=messages, max_tokens=64,
                                            temperature=0, response_format=fmt, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content  # greedy: the same output either way
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("extra, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_json": SCHEMA}, lambda t: check_schema(t) or True),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: check_schema(t) or True),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"guided_grammar": LARK}, lambda t: LARK_MATCHES.fullmatch(t)),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"response_format": {"type": "text"}, "guided_choice": CHOICES}, lambda t: t in CHOICES),
], ids=["json_object", "guided_json", "guided_json_text", "guided_regex", "guided_choice", "guided_grammar",
        "structured_outputs", "text_and_choice"])
def test_http_constraints(server, client, chat, extra, check):
    for temperature in (0, 1.0):
        if chat:
            resp = client.chat.completions.create(model=server.server.model_name, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=64, temperature=temperature, seed=3, extra_body=extra)
            text = resp.choices[0].message.content
        else:
            resp = client.completions.create(model=server.server.model_name, prompt="hi", max_tokens=64,
                                             temperature=temperature, seed=3, extra_body=extra)
            text = resp.choices[0].text
        assert resp.choices[0].finish_reason == "stop", (extra, text)
        assert check(text), (extra, text)


def test_http_streamed_completion_cut_short_is_length(server, client):
    stream = client.completions.create(model=server.server.model_name, prompt="hi", max_tokens=2, stream=True,
                                       extra_body={"guided_json": SCHEMA})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("{")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


@pytest.mark.parametrize("extra, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "invalid json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"guided_json": "{"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(("}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
])
def test_http_invalid_constraint_is_a_400_and_the_server_goes_on(server, client, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.server.model_name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, extra_body=extra)
    err = info.value
    assert err.status_code == 400 and err.code == "invalid_grammar" and err.param == param, (err.param, err.message)
    assert needle in err.message and err.body["type"] == "invalid_request_error"
    resp = client.completions.create(model=server.server.model_name, prompt="hi", max_tokens=64,
                                     extra_body={"guided_choice": CHOICES})
    assert resp.choices[0].text in CHOICES


def test_http_json_whitespace_must_be_known(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.server.model_name, prompt="hi", max_tokens=8,
                                  extra_body={"guided_json": SCHEMA, "json_whitespace": "wide"})
    assert info.value.code == "invalid_value" and info.value.param == "json_whitespace"
