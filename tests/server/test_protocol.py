"""Protocol conformance against a real server on loopback: streaming, parity, concurrency, cancel, KV."""

from __future__ import annotations

import threading

import pytest

from specserve import SamplingParams
from specserve.server.prompts import messages_to_text

import scripted_drafter  # noqa: F401  (registers the "scripted" drafter)
from server_utils import greedy_text, kv_blocks, wait_until
from wsclient import Conn

PROMPTS = ["def f(x):", "class Point:", "for i in range(10):", "import os"]


def test_session_created_describes_the_session(server):
    with Conn(server.ws_url) as c:
        assert c.first["type"] == "session.created"
        s = c.session
        assert s["id"].startswith("sess_") and s["model"] and s["drafter"] == "ngram"
        assert s["available_drafters"] == ["ngram", "none"]
        assert s["limits"]["context_length"] == 512 and s["limits"]["max_output_tokens"] == 511
        assert s["limits"]["max_message_bytes"] == 64 * 1024
        assert s["defaults"]["max_output_tokens"] == 256


def test_greedy_stream_equals_generate(server, reference_llm):
    with Conn(server.ws_url) as c:
        rid = c.create(input="def f(x):", max_output_tokens=40, temperature=0, metadata={"user": "u1"})
        done = c.wait_done(rid)
        assert c.text(rid) == greedy_text(reference_llm, "def f(x):", 40)
        assert done["status"] in ("completed", "incomplete") and done["metadata"] == {"user": "u1"}
        usage = done["usage"]
        assert usage["input_tokens"] == len(reference_llm.encode("def f(x):"))
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        assert sum(d["tokens"] for d in c.deltas[rid]) <= usage["output_tokens"]
        assert done["spec"]["steps"] >= 1 and done["spec"]["tau"] >= 1.0
        timing = done["timing"]
        assert 0 <= timing["queue_ms"] <= timing["ttft_ms"] <= timing["e2e_ms"]
        assert 0 < timing["engine_ttft_ms"] <= timing["ttft_ms"]


def test_messages_go_through_the_prompt_template(server, reference_llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    with Conn(server.ws_url) as c:
        rid = c.create(messages=messages, max_output_tokens=24, temperature=0, ignore_eos=True)
        done = c.wait_done(rid)
    text, add_special = messages_to_text(reference_llm.tokenizer, messages)
    assert add_special and text == "system: Be brief.\nuser: hello\nassistant:"
    assert c.text(rid) == greedy_text(reference_llm, text, 24, ignore_eos=True)
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}


def test_concurrent_responses_on_one_socket_do_not_cross(server, reference_llm):
    # Long enough that the first response cannot finish while the next create waits for its reply (48 tokens
    # once did, on a loaded machine: a few tens of ms).
    tokens = 160
    with Conn(server.ws_url) as c:
        ids = [c.create(input=p, max_output_tokens=tokens, temperature=0, ignore_eos=True) for p in PROMPTS]
        for rid in ids:
            c.wait_done(rid)
        for rid, prompt in zip(ids, PROMPTS, strict=True):
            assert c.text(rid) == greedy_text(reference_llm, prompt, tokens, ignore_eos=True), prompt
            assert c.done[rid]["usage"]["output_tokens"] == tokens
        # They really ran together: deltas of several responses interleave before the first done.
        order = [e.get("response_id") or e.get("response", {}).get("id") for e in c.log
                 if e["type"] in ("response.output_text.delta", "response.done")]
        first_done = next(i for i, e in enumerate(c.log) if e["type"] == "response.done")
        streaming = {e["response_id"] for e in c.log[:first_done] if e["type"] == "response.output_text.delta"}
        assert len(streaming) > 1, order


def test_many_sockets_at_once(server, reference_llm):
    results, errors = {}, []

    def client(i: int) -> None:
        try:
            with Conn(server.ws_url) as c:
                prompts = PROMPTS[i % 4], PROMPTS[(i + 1) % 4]
                ids = [c.create(input=p, max_output_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
                results[i] = [(p, c.text(rid)) for p, rid in zip(prompts, ids, strict=True) if c.wait_done(rid)]
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for pairs in results.values():
        for prompt, text in pairs:
            assert text == greedy_text(reference_llm, prompt, 24, ignore_eos=True)
    assert len(results) == 4


def test_multi_token_deltas_when_a_step_accepts_several(make_server, llama_dir, reference_llm):
    prompt = "class Point:"
    ids = reference_llm.encode(prompt)
    free = reference_llm.generate([ids], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    srv = make_server(llm_kwargs={"drafter": "scripted", "drafter_options": {
        "mode": "all_right", "references": [ids + free.token_ids], "max_budget": 6}})
    with Conn(srv.ws_url) as c:
        rid = c.create(input=prompt, max_output_tokens=40, temperature=0, ignore_eos=True)
        done = c.wait_done(rid)
    assert c.text(rid) == free.text
    # Every verify step accepts several tokens, and they travel together. (A delta may carry even more
    # when the socket writer was not scheduled between two steps: queued deltas merge.)
    assert max(d["tokens"] for d in c.deltas[rid]) > 1
    assert sum(d["tokens"] for d in c.deltas[rid]) <= done["usage"]["output_tokens"] == 40
    assert done["spec"]["tau"] > 2 and done["spec"]["accepted_per_position"][0] > 0


def test_cancel_stops_the_response_and_frees_its_kv(server):
    with Conn(server.ws_url) as c:
        rid = c.create(input="def f(x):", max_output_tokens=500, ignore_eos=True)
        c.wait_delta(rid)
        c.send({"type": "response.cancel", "response_id": rid})
        done = c.wait_done(rid, timeout=10)
        assert done["status"] == "cancelled"
        assert done["usage"]["output_tokens"] < 500
        # the session goes on
        other = c.create(input="import os", max_output_tokens=3)
        assert c.wait_done(other)["usage"]["output_tokens"] <= 3
    free, total = kv_blocks(server)
    assert free == total


def test_cancel_of_a_queued_response(make_server):
    srv = make_server(llm_kwargs={"max_num_seqs": 1})
    with Conn(srv.ws_url) as c:
        running = c.create(input="def f(x):", max_output_tokens=300, ignore_eos=True)
        queued = c.create(input="import os", max_output_tokens=300, ignore_eos=True)
        c.send({"type": "response.cancel", "response_id": queued})
        done = c.wait_done(queued)
        assert done["status"] == "cancelled" and done["usage"]["output_tokens"] == 0
        assert done["timing"]["ttft_ms"] is None and not c.deltas[queued]
        c.send({"type": "response.cancel", "response_id": running})
        assert c.wait_done(running)["status"] == "cancelled"
    assert wait_until(lambda: kv_blocks(srv)[0] == kv_blocks(srv)[1])


def test_closing_the_socket_cancels_its_responses_and_frees_kv(server):
    c = Conn(server.ws_url)
    for p in PROMPTS[:3]:
        c.create(input=p, max_output_tokens=480, ignore_eos=True)
    c.pump()  # something is streaming
    c.close()
    assert wait_until(lambda: kv_blocks(server)[0] == kv_blocks(server)[1] and server.server.in_flight == 0)
    assert wait_until(lambda: server.server.connections == 0)


def test_session_update_switches_the_drafter_and_defaults(server, reference_llm):
    with Conn(server.ws_url) as c:
        reply = c.request({"type": "session.update", "session": {"drafter": "none", "defaults": {
            "max_output_tokens": 20, "temperature": 0, "ignore_eos": True}}})
        assert reply["type"] == "session.updated"
        assert reply["session"]["drafter"] is None and reply["session"]["defaults"]["max_output_tokens"] == 20
        rid = c.create(input="for i in range(10):")
        done = c.wait_done(rid)
        assert done["usage"]["output_tokens"] == 20 and done["spec"]["tau"] == 1.0
        assert done["spec"]["accepted_per_position"] == []
        assert c.text(rid) == greedy_text(reference_llm, "for i in range(10):", 20, ignore_eos=True)
        reply = c.request({"type": "session.update", "session": {"drafter": "ngram"}})
        assert reply["session"]["drafter"] == "ngram"
        err = c.request({"type": "session.update", "session": {"drafter": "eagle"}})
        assert err["type"] == "error" and err["error"]["code"] == "drafter_unavailable"
        assert "ngram" in err["error"]["message"] and err["error"]["param"] == "session.drafter"


def test_stop_strings_and_seeded_sampling(server, reference_llm):
    with Conn(server.ws_url) as c:
        a = c.create(input="def f(x):", max_output_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
        b = c.create(input="def f(x):", max_output_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
        c.wait_done(a), c.wait_done(b)
        assert c.text(a) == c.text(b)  # a per-request seed reproduces the sample, batched or not
        full = greedy_text(reference_llm, "def f(x):", 30, ignore_eos=True)
        stop = full[10:13]
        rid = c.create(input="def f(x):", max_output_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
        done = c.wait_done(rid)
    assert done["status"] == "completed"
    assert c.text(rid) == full[: full.index(stop)]


def test_prompt_at_the_context_end_is_incomplete_not_failed(server, reference_llm):
    prompt = [5 + i % 250 for i in range(505)]  # 505 of 512 positions
    with Conn(server.ws_url) as c:
        rid = c.create(input=prompt, max_output_tokens=100, ignore_eos=True)
        done = c.wait_done(rid)
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "context_length"}
    assert done["usage"]["output_tokens"] == 512 - 505


@pytest.mark.parametrize("path", ["/healthz"])
def test_health(server, path):
    import urllib.request

    with urllib.request.urlopen(server.http_url.rstrip("/") + path, timeout=10) as r:
        assert r.status == 200 and r.read() == b"ok\n"
