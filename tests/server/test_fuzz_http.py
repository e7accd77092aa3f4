"""Hostile input at the HTTP door (issue 19): hypothesis posts arbitrary bytes, arbitrary JSON and
plausible-but-wrong chat/completion bodies (wrong types, huge and non-finite numbers, unknown fields,
nested garbage, invalid sampling values, invalid constraints) to the OpenAI-compatible API of one real
server on loopback, over raw http.client.

Every answer is a 2xx or a 4xx with OpenAI's error shape and a documented code — never a 5xx and never a
dropped connection — and no error message shows a traceback or a server file path. Afterwards the engine
is alive, KV is back and a greedy request still equals plain decoding."""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from specserve.server import ERROR_CODES

from server_utils import greedy_text, kv_blocks, wait_until
from test_fuzz_websocket import assert_clean, formats, huge, json_values, non_finite

PATHS = ("/v1/chat/completions", "/v1/completions")


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()  # a stream is read to its end: every chunk, then [DONE]
    finally:
        conn.close()


def check_answer(status: int, body: bytes, sent, record=event) -> None:
    assert status < 500, (status, body, sent)
    if status >= 400:
        err = json.loads(body)["error"]
        record(f"{status} {err['code']} {err.get('param')}")
        assert err["code"] in ERROR_CODES and err["type"] == ERROR_CODES[err["code"]], err
        assert isinstance(err["message"], str) and err["message"]
        assert_clean(err["message"], sent)
        return
    record(str(status))
    assert status == 200, (status, body)
    if body.startswith(b"data:"):  # a stream: it ends with [DONE]; an error inside it is clean too
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
        for line in body.split(b"\n"):
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    assert chunk["error"]["code"] != "internal_error", chunk
                    assert_clean(chunk["error"]["message"], sent)
    else:
        json.loads(body)


# ---- strategies ---------------------------------------------------------------------------------

# A valid body, then up to two fields overwritten with anything (or with a known-bad value): most bodies
# are wrong in one place only, so every field's validation, the grammar compiler and the engine get reached.
valid = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 40), "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "ignore_eos": st.booleans(), "model": st.none(), "n": st.just(1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "user": st.text(max_size=5), "drafter": st.sampled_from(["ngram", "none"]), "stream_pacing": st.sampled_from(["smooth", "none"]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | formats.map(lambda f: {"type": "json_schema", "json_schema": {"name": "x", "schema": f}}),
    "guided_regex": st.sampled_from(["[0-9]+", "(a|aa)*b", "[", "a{2,1}", "x{0,100000}"]),
    "guided_grammar": st.sampled_from(['start: "a"', "start: start", "start: /[a-/", "start: a\na: a"]),
    "guided_choice": st.lists(st.text(max_size=4), max_size=3),
    "presence_penalty": st.just(0), "logit_bias": st.just({}), "logprobs": st.just(False),
}
bad_values = st.one_of(json_values, huge, st.sampled_from([-1, 0, 2**31, "", [], {}, None, True, "x" * 5000]))
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": st.text(min_size=1, max_size=20) | st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": st.text(max_size=10)}), min_size=1, max_size=2)}), min_size=1, max_size=3)
prompts = st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 299), min_size=1, max_size=4)
# max_tokens is always there: an omitted one means the rest of the context, ~500 tokens per example.
short = {"max_tokens": st.integers(1, 3)}


def spoiled(required: dict, optional: dict):
    keys = sorted({*required, *optional, "unknown_field", "max_completion_tokens", "echo", "suffix"})
    return st.builds(lambda body, spoil: {**body, **spoil}, st.fixed_dictionaries(required, optional=optional),
                     st.dictionaries(st.sampled_from(keys), bad_values, max_size=2))


chat_bodies = spoiled({"messages": messages, **short}, valid)
completion_bodies = spoiled({"prompt": prompts, **short}, valid)


def with_non_finite(body: dict, token: str) -> bytes:
    return (json.dumps(body)[:-1] + f', "temperature": {token}}}').encode()


requests = st.one_of(
    st.tuples(st.just(PATHS[0]), chat_bodies.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just(PATHS[0]), chat_bodies.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just(PATHS[1]), completion_bodies.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just(PATHS[1]), completion_bodies.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.sampled_from(PATHS), st.builds(with_non_finite, chat_bodies | completion_bodies, non_finite)),
    st.tuples(st.sampled_from(PATHS), json_values.map(lambda v: json.dumps(v).encode())),
    st.tuples(st.sampled_from(PATHS), st.binary(max_size=60)),
    st.tuples(st.sampled_from(PATHS), st.integers(1, 3000).map(lambda n: ("[" * n + "]" * n).encode())),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(request=requests)
@example(request=(PATHS[1], b'{"prompt": "x", "top_p": NaN}'))
@example(request=(PATHS[1], b'{"prompt": "x", "temperature": 1e400}'))
@example(request=(PATHS[0], b'\xff\xfe{"messages": []}'))
@example(request=(PATHS[1], ("[" * 3000 + "]" * 3000).encode()))
@example(request=(PATHS[1], json.dumps({"prompt": [2**40]}).encode()))
@example(request=(PATHS[1], json.dumps({"prompt": "x", "max_tokens": 2, "guided_grammar": "start: start"}).encode()))
@example(request=(PATHS[0], json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True,
                                        "guided_grammar": "start: start"}).encode()))
@example(request=(PATHS[0], json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
                                        "guided_grammar": 'start: "a"{99999}'}).encode()))
@example(request=(PATHS[1], json.dumps({"prompt": "x", "max_tokens": 3, "guided_grammar": 'start: "a"{99999}'}).encode()))
def test_every_fuzzed_body_gets_a_clean_answer(server, request):
    path, body = request
    status, answer = post(server.port, path, body)
    check_answer(status, answer, body)


@pytest.mark.parametrize("path", PATHS)
def test_an_oversized_body_is_413(server, path):
    body = json.dumps({"prompt": "a" * (64 * 1024 + 10)}).encode()
    status, answer = post(server.port, path, body)
    assert status == 413 and json.loads(answer)["error"]["code"] == "message_too_large"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_any_content_type_is_read_as_json_or_refused_cleanly(server, content_type):
    status, answer = post(server.port, PATHS[1], b"prompt=x", {"Content-Type": content_type})
    check_answer(status, answer, b"", record=lambda _: None)
    assert status == 400


def test_the_server_still_serves_after_the_fuzzing(server, reference_llm):
    assert wait_until(lambda: kv_blocks(server)[0] == kv_blocks(server)[1], timeout=30)
    body = json.dumps({"prompt": "def f(x):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}).encode()
    status, answer = post(server.port, PATHS[1], body)
    assert status == 200, answer
    assert json.loads(answer)["choices"][0]["text"] == greedy_text(reference_llm, "def f(x):", 12, ignore_eos=True)
