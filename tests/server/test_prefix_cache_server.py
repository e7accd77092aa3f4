"""Prefix caching seen from clients: the real `openai` client gets `usage.prompt_tokens_details.cached_tokens`
on a repeated prefix (and the same greedy text as without the cache), a websocket session's
`usage.input_tokens_details.cached_tokens` counts its earlier turns, /metrics counts hits, and the request
log line carries the cached tokens."""

from __future__ import annotations

import logging
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families
from wsclient import Conn

from specserve import LLM, SamplingParams
from specserve.server.prompts import messages_to_text

SYSTEM = ("You are a careful assistant for a small software team. Answer in one short sentence, cite the file "
          "you mean, never invent an API, and say so when you do not know. ") * 2


def _metrics(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.http_url.rstrip("/") + "/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
        return {s.name: s.value for f in families for s in f.samples if not s.labels}


def test_openai_client_sees_cached_tokens_and_metrics_count_hits(make_server, llama_dir, caplog):
    srv = make_server(llm_kwargs={"drafter": "ngram"})
    client = openai.OpenAI(base_url=srv.openai_base_url, api_key="unused", max_retries=0, timeout=60)
    plain = LLM(llama_dir, drafter=None, enable_prefix_caching=False)
    caplog.set_level(logging.INFO, logger="specserve.requests")
    cached = []
    for question in ("Where is the scheduler?", "Who frees the KV blocks?"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        out = client.chat.completions.create(model=srv.server.model_name, messages=messages, max_tokens=12,
                                             temperature=0, extra_body={"ignore_eos": True})
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        assert 0 <= cached[-1] < out.usage.prompt_tokens
        text, _ = messages_to_text(plain.tokenizer, messages)
        expected = plain.generate([text], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
        assert out.choices[0].message.content == expected  # lossless through the server
    assert cached[0] == 0 and cached[1] >= 32  # the system prompt's full blocks (16 tokens each)
    lines = [r.request for r in caplog.records if hasattr(r, "request")]
    assert [line["cached_tokens"] for line in lines[-2:]] == cached

    with Conn(srv.ws_url) as c:  # a session's next turn starts with its earlier turn: no client change
        first = c.create(input=SYSTEM + "First question?", max_output_tokens=8, temperature=0, ignore_eos=True)
        c.wait_done(first)
        second = c.create(input=SYSTEM + "First question?" + c.text(first) + " And then?", max_output_tokens=8,
                          temperature=0, ignore_eos=True)
        usage = c.wait_done(second)["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 32

    m = _metrics(srv)
    hit, queried = m["specserve_prefix_cache_hit_tokens_total"], m["specserve_prefix_cache_queried_tokens_total"]
    assert hit >= cached[1] + usage["input_tokens_details"]["cached_tokens"] and queried > hit
    assert abs(m["specserve_prefix_cache_hit_rate"] - hit / queried) < 1e-9
    assert m["specserve_kv_blocks_cached"] > 0 and m["specserve_kv_blocks_evictable"] > 0
