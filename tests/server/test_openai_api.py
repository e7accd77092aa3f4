"""The OpenAI-compatible HTTP API with the real `openai` client against a real server on loopback:
streaming and whole chat completions and completions, greedy parity with LLM.generate, usage, errors
as the client's exception types with our messages, disconnects freeing KV, and the raw SSE wire format."""

from __future__ import annotations

import http.client
import json
import threading

import openai
import pytest

from specserve import SamplingParams
from specserve.server.prompts import messages_to_text

from server_utils import greedy_text, kv_blocks, wait_until

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


def client_for(srv, **kwargs) -> openai.OpenAI:
    kwargs.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=srv.openai_base_url, max_retries=0, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


def chat_reference(llm, messages, max_tokens: int) -> str:
    text, _ = messages_to_text(llm.tokenizer, messages)
    return greedy_text(llm, text, max_tokens, ignore_eos=True)


def test_streamed_chat_equals_generate_with_usage_and_spec(server, client, reference_llm):
    stream = client.chat.completions.create(model=server.server.model_name, messages=MESSAGES, max_tokens=32,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_reference(reference_llm, MESSAGES, 32)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 32
    prompt, _ = messages_to_text(reference_llm.tokenizer, MESSAGES)
    assert usage.prompt_tokens == len(reference_llm.encode(prompt)) and usage.total_tokens == usage.prompt_tokens + 32
    spec = chunks[-1].model_extra["spec"]
    assert spec["steps"] >= 1 and spec["tau"] >= 1.0
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_whole_chat_completion(server, client, reference_llm):
    resp = client.chat.completions.create(model=server.server.model_name, messages=MESSAGES, max_completion_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content == chat_reference(reference_llm, MESSAGES, 24)
    assert resp.usage.completion_tokens == 24 and resp.model_extra["spec"]["tau"] >= 1.0


def test_completions_text_and_token_ids(server, client, reference_llm):
    resp = client.completions.create(model=server.server.model_name, prompt="def f(x):", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.choices[0].text == greedy_text(reference_llm, "def f(x):", 20, True)
    assert resp.usage.prompt_tokens == len(reference_llm.encode("def f(x):"))
    ids = reference_llm.encode("class Point:")
    chunks = list(client.completions.create(model=server.server.model_name, prompt=ids, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    expected = reference_llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and "spec" in chunks[-1].model_extra


def test_omitted_max_tokens_is_the_rest_of_the_context(server, client):
    ids = [5 + i % 250 for i in range(500)]  # 12 of 512 positions left
    resp = client.completions.create(model=server.server.model_name, prompt=ids, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 12 and resp.choices[0].finish_reason == "length"


def test_eight_concurrent_streams_are_each_exact(server, reference_llm):
    prompts = ["def f(x):", "class Point:", "for i in range(10):", "import os"] * 2
    results, errors = {}, []

    def one(i: int) -> None:
        try:
            stream = client_for(server).completions.create(model=server.server.model_name, prompt=prompts[i],
                                                           max_tokens=24, temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True})
            results[i] = "".join(c.choices[0].text for c in stream)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i, prompt in enumerate(prompts):
        assert results[i] == greedy_text(reference_llm, prompt, 24, ignore_eos=True), prompt


# ---- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param, needle", [
    ({"temperature": -1}, "temperature", "temperature must be"),
    ({"top_p": 2}, "top_p", "top_p must be"),
    ({"n": 17}, "n", "n must be"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be"),
    ({"max_tokens": 600}, "max_tokens", "together"),
    ({"stop": [""]}, "stop", "stop takes"),
    ({"messages": []}, "messages", "1..1024"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "role must be"),
    ({"messages": [{"role": "user", "content": "x " * 2000}]}, "messages", "context window is 512"),
    ({"extra_body": {"temprature": 0.5}}, "temprature", "Unrecognized request argument"),
    ({"extra_body": {"drafter": "eagle"}}, "drafter", "not loaded"),
    ({"extra_body": {"stream_pacing": "fast"}}, "stream_pacing", "smooth"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions", "not supported"),  # penalties, logprobs: served now
    ({"extra_body": {"prediction": {"type": "content", "content": "x"}}}, "prediction", "not supported"),
])
def test_bad_requests_raise_bad_request_error_with_our_message(server, client, kwargs, param, needle):
    args = {"model": server.server.model_name, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    err = info.value
    assert err.status_code == 400 and err.param == param and needle in err.message, (err.param, err.message)
    assert err.body["type"] == "invalid_request_error" and err.code


def test_context_error_names_both_numbers(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.server.model_name, prompt="def f(x):", max_tokens=600)
    assert info.value.code == "context_length_exceeded"
    assert "max_tokens is 600" in info.value.message and "context window is 512" in info.value.message


def test_unknown_model_is_not_found(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found" and server.server.model_name in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert client.models.retrieve(server.server.model_name).id == server.server.model_name
    assert [m.id for m in client.models.list()] == [server.server.model_name]


def test_api_key_and_origin(make_server):
    srv = make_server(api_key="s3cret", allowed_origins=("http://localhost:3000",))
    with pytest.raises(openai.AuthenticationError) as info:
        client_for(srv, api_key="wrong").models.list()
    assert info.value.code == "invalid_api_key"
    good = client_for(srv, api_key="s3cret")
    assert good.completions.create(model=srv.server.model_name, prompt="x", max_tokens=2).usage.completion_tokens <= 2
    with pytest.raises(openai.PermissionDeniedError):
        client_for(srv, api_key="s3cret", default_headers={"Origin": "http://evil.example"}).models.list()
    # An allowed browser app: a preflight, then readable answers (CORS headers).
    status, headers, _ = raw_request(srv.port, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert status == 204 and headers["access-control-allow-origin"] == "http://localhost:3000"
    status, headers, _ = raw_request(srv.port, "GET", "/v1/models", headers={
        "Origin": "http://localhost:3000", "Authorization": "Bearer s3cret"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"


def test_busy_server_answers_429(make_server, noeos_dir):
    srv = make_server(model_dir=noeos_dir, max_queued=0, llm_kwargs={"max_num_seqs": 1})
    c = client_for(srv)
    stream = c.completions.create(model=srv.server.model_name, prompt="def f(x):", max_tokens=1500, stream=True)
    next(iter(stream))  # running: the one batch slot is taken
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model=srv.server.model_name, prompt="x", max_tokens=2)
    assert info.value.code == "server_busy"
    stream.close()
    assert wait_until(lambda: srv.server.in_flight == 0)
    assert c.completions.create(model=srv.server.model_name, prompt="x", max_tokens=2).usage.completion_tokens <= 2


def test_engine_refusal_is_a_400(make_server):
    srv = make_server(llm_kwargs={"kv_cache_tokens": 64})  # smaller than one request's reservation
    with pytest.raises(openai.BadRequestError) as info:
        client_for(srv).completions.create(model=srv.server.model_name, prompt="def f(x):", max_tokens=100)
    assert info.value.code == "request_rejected" and "KV" in info.value.message


def test_disconnect_mid_stream_frees_kv_within_a_step(make_server, noeos_dir):
    srv = make_server(model_dir=noeos_dir)
    free, total = kv_blocks(srv)
    stream = client_for(srv).chat.completions.create(model=srv.server.model_name, messages=[{"role": "user", "content": "go"}], max_tokens=1800,
                                                     stream=True)
    pieces = iter(stream)
    for _ in range(5):
        next(pieces)
    assert kv_blocks(srv)[0] < total
    steps_before = srv.server.worker.steps
    stream.close()  # the client hangs up
    assert wait_until(lambda: kv_blocks(srv)[0] == total and srv.server.in_flight == 0, timeout=10)
    # the engine noticed within a step or two of the hang-up, not at the end of 1,800 tokens
    assert srv.server.worker.steps - steps_before < 50


def test_a_client_gone_before_the_stream_starts_is_not_a_server_error(server, caplog):
    """A streaming request sent with the end of the connection right behind it (found by `bench soak`): the
    stream's headers cannot be written, which was logged as an unhandled server error with a traceback."""
    import socket

    body = json.dumps({"prompt": "def f(x):", "max_tokens": 8, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with caplog.at_level("ERROR"):
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(request)
                sock.shutdown(socket.SHUT_WR)  # request and end of stream arrive together
                while sock.recv(65536):
                    pass
        assert wait_until(lambda: server.server.in_flight == 0 and kv_blocks(server)[0] == kv_blocks(server)[1])
    assert [r for r in caplog.records if r.levelno >= 40] == []
    assert raw_request(server.port, "POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4})[0] == 200


# ---- the wire format, as curl sees it ------------------------------------------------------------


def raw_request(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload


def test_sse_wire_format(server):
    status, headers, payload = raw_request(server.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line for line in payload.decode().split("\n\n") if line.strip()]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_error_shape_and_routes(server):
    status, _, payload = raw_request(server.port, "POST", "/v1/chat/completions", None)
    body = json.loads(payload)
    assert status == 400 and body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"
    status, _, payload = raw_request(server.port, "GET", "/v1/nope")
    assert status == 404 and json.loads(payload)["error"]["code"] == "not_found"
    status, _, payload = raw_request(server.port, "GET", "/v1/chat/completions")
    assert status == 405 and json.loads(payload)["error"]["code"] == "method_not_allowed"
    big = {"messages": [{"role": "user", "content": "x" * (70 * 1024)}]}  # the test server's limit is 64 KiB
    status, _, payload = raw_request(server.port, "POST", "/v1/chat/completions", big)
    assert status == 413 and json.loads(payload)["error"]["code"] == "message_too_large"


def test_a_bad_http_request_leaves_a_websocket_stream_untouched(server, reference_llm):
    from wsclient import Conn

    with Conn(server.ws_url) as c:
        rid = c.create(input="import os", max_output_tokens=60, temperature=0, ignore_eos=True)
        for _ in range(5):
            assert raw_request(server.port, "POST", "/v1/completions", {"prompt": 5})[0] == 400
        c.wait_done(rid)
    assert c.text(rid) == greedy_text(reference_llm, "import os", 60, ignore_eos=True)
