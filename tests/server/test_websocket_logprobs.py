"""Websocket log-probabilities (`logprobs` / `top_logprobs` in response.create) against a real server on
loopback through a real websocket client: every delta carries one entry per token it streams, in OpenAI
chat's `logprobs.content` shape, equal to transformers' float32 log_softmax of the same checkpoint, under
speculation that accepts several tokens a step and plainly; bad values are error events naming the field
and the session keeps serving."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import scripted_drafter  # noqa: F401  (registers "scripted")
from specserve import SamplingParams
from wsclient import Conn

PROMPT = "def fibonacci(n):"
N = 24


@pytest.fixture(scope="module")
def hf(llama_dir):
    return AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("drafter", ["scripted", None])
def test_websocket_logprobs_equal_transformers_one_entry_per_streamed_token(make_server, reference_llm, hf, drafter):
    tokenizer = reference_llm.tokenizer
    ids = reference_llm.encode(PROMPT)
    out = reference_llm.generate([ids], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    options = {"mode": "mixed", "seed": 1, "references": [ids + out.token_ids]} if drafter else None
    srv = make_server(llm_kwargs={"drafter": drafter, "drafter_options": options})
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out.token_ids])).logits[0].float(), -1)
    with Conn(srv.ws_url) as c:
        for top_k, fields in ((5, {"logprobs": True, "top_logprobs": 5}), (3, {"top_logprobs": 3}),
                              (0, {"logprobs": True})):
            rid = c.create(input=PROMPT, max_output_tokens=N, temperature=0, ignore_eos=True, **fields)
            done = c.wait_done(rid)
            deltas = c.deltas[rid]
            assert tokenizer.decode(out.token_ids).startswith(c.text(rid))  # (a split UTF-8 tail may be held)
            for d in deltas:  # each delta: exactly one entry per token it carries
                assert len(d["logprobs"]) == d["tokens"]
            entries = [e for d in deltas for e in d["logprobs"]]
            assert len(entries) == N == done["usage"]["output_tokens"]
            if drafter:
                assert any(d["tokens"] > 1 for d in deltas)  # several tokens accepted in one step
            for i, (e, token) in enumerate(zip(entries, out.token_ids)):
                row = ref[len(ids) - 1 + i]
                text = tokenizer.decode([token])
                assert e["token"] == text and e["bytes"] == list(text.encode("utf-8"))
                assert e["logprob"] == pytest.approx(float(row[token]), abs=2e-3)
                top = row.topk(top_k) if top_k else None
                assert len(e["top_logprobs"]) == top_k
                if top_k:
                    assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=2e-3)
                    assert [t["token"] for t in e["top_logprobs"]] == [tokenizer.decode([t]) for t in top.indices.tolist()]
                    assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])
        # Without the fields, deltas carry no logprobs key at all.
        rid = c.create(input=PROMPT, max_output_tokens=4, temperature=0)
        c.wait_done(rid)
        assert all("logprobs" not in d for d in c.deltas[rid])


@pytest.mark.parametrize("fields, code, param", [
    ({"top_logprobs": 21}, "invalid_value", "response.top_logprobs"),
    ({"top_logprobs": -1}, "invalid_value", "response.top_logprobs"),
    ({"top_logprobs": 2.5}, "invalid_type", "response.top_logprobs"),
    ({"top_logprobs": True}, "invalid_type", "response.top_logprobs"),
    ({"logprobs": 3}, "invalid_type", "response.logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "invalid_value", "response.top_logprobs"),
])
def test_bad_logprobs_are_errors_naming_the_field_and_the_session_goes_on(server, reference_llm, fields, code, param):
    with Conn(server.ws_url) as c:
        err = c.expect_error({"type": "response.create", "response": {"input": PROMPT, "max_output_tokens": 4, **fields}})
        assert err["error"]["code"] == code and err["error"]["param"] == param, err
        rid = c.create(input=PROMPT, max_output_tokens=4, temperature=0, top_logprobs=1)
        c.wait_done(rid)
        assert sum(len(d["logprobs"]) for d in c.deltas[rid]) == c.done[rid]["usage"]["output_tokens"]


def test_logprobs_turn_smooth_pacing_off_and_are_not_a_session_default(server):
    with Conn(server.ws_url) as c:
        rid = c.create(input=PROMPT, max_output_tokens=12, temperature=0, ignore_eos=True, stream_pacing="smooth",
                       logprobs=True)
        done = c.wait_done(rid)
        assert sum(len(d["logprobs"]) for d in c.deltas[rid]) == done["usage"]["output_tokens"] == 12
        err = c.expect_error({"type": "session.update", "session": {"defaults": {"top_logprobs": 2}}})
        assert err["error"]["code"] == "unknown_field"
