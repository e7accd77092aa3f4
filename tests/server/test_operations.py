"""Operations: /health, /metrics parsed with prometheus-client's own parser and checked against the
requests made, and the one log line per finished request (text and JSON)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

from specserve.server.request_log import JsonFormatter

from server_utils import wait_until
from wsclient import Conn


def get(srv, path: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(srv.http_url.rstrip("/") + path, timeout=10) as r:
            return r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers["Content-Type"]


def scrape(srv) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every sample /metrics exposes."""
    status, body, content_type = get(srv, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_health_follows_the_engine_thread(make_server):
    srv = make_server()
    status, body, _ = get(srv, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    srv.server.worker.stop()  # the engine thread ends: load balancers must stop sending here
    status, body, _ = get(srv, "/health")
    assert status == 503 and "stopped" in json.loads(body)["status"]
    assert get(srv, "/healthz")[0] == 503


def test_metrics_count_the_requests_made(make_server):
    srv = make_server(llm_kwargs={"drafter": "ngram"})
    name = srv.server.model_name
    client = openai.OpenAI(base_url=srv.openai_base_url, api_key="x", max_retries=0)
    outputs = 0
    for prompt in ("def f(x):", "import os"):
        outputs += client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens
    try:
        client.completions.create(model=name, prompt="x", temperature=-1)
    except openai.BadRequestError:
        pass
    with Conn(srv.ws_url) as c:
        rid = c.create(input="class A:", max_output_tokens=8, temperature=0, ignore_eos=True)
        outputs += c.wait_done(rid)["usage"]["output_tokens"]
        c.expect_error({"type": "response.create", "response": {"input": "x", "top_p": 5}})
    assert wait_until(lambda: srv.server.in_flight == 0)
    m = scrape(srv)
    assert m[("specserve_requests_total", (("api", "openai"), ("status", "length")))] == 2
    assert m[("specserve_requests_total", (("api", "openai"), ("status", "rejected")))] == 1
    assert m[("specserve_requests_total", (("api", "websocket"), ("status", "length")))] == 1
    assert m[("specserve_requests_total", (("api", "websocket"), ("status", "rejected")))] == 1
    generated = sum(v for (n, _), v in m.items() if n == "specserve_generation_tokens_total")
    assert generated == outputs == 32
    assert m[("specserve_time_to_first_token_seconds_count", (("api", "openai"),))] == 2
    assert m[("specserve_inter_token_latency_seconds_count", (("api", "openai"),))] == 22  # every token after the first
    steps = m[("specserve_spec_verify_steps_total", (("drafter", "ngram"),))]
    drafted = m[("specserve_spec_draft_tokens_total", (("drafter", "ngram"),))]
    accepted = m[("specserve_spec_accepted_tokens_total", (("drafter", "ngram"),))]
    assert steps >= 1 and 0 <= accepted <= drafted
    assert accepted + steps == outputs - 3  # each request's first token comes from prefill, not a verify step
    assert m[("specserve_spec_tau_count", (("drafter", "ngram"),))] == 3
    # Nothing is running now: every KV block is free again.
    assert m[("specserve_kv_blocks_used", ())] == 0 and m[("specserve_kv_blocks_free", ())] > 0
    assert m[("specserve_queue_depth", ())] == 0 and m[("specserve_running_sequences", ())] == 0
    assert m[("specserve_engine_alive", ())] == 1


def test_one_log_line_per_finished_request(server, caplog):
    with caplog.at_level(logging.INFO, logger="specserve.requests"):
        client = openai.OpenAI(base_url=server.openai_base_url, api_key="x", max_retries=0)
        client.completions.create(model=server.server.model_name, prompt="def f(x):", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
        with Conn(server.ws_url) as c:
            c.wait_done(c.create(input="import os", max_output_tokens=4, ignore_eos=True))
        assert wait_until(lambda: len(caplog.records) >= 2)
    lines = [r for r in caplog.records if r.name == "specserve.requests"]
    assert len(lines) == 2
    http_line, ws_line = (r.getMessage() for r in lines)
    for needle in ("id=cmpl-", "api=openai", "client=127.0.0.1:", "status=length", "prompt_tokens=", "output_tokens=6",
                   "ttft_ms=", "tokens_per_s=", "tau="):
        assert needle in http_line, (needle, http_line)
    assert "api=websocket" in ws_line and "sess_" in ws_line and "output_tokens=4" in ws_line
    record = json.loads(JsonFormatter().format(lines[0]))
    assert record["event"] == "request" and record["api"] == "openai" and record["output_tokens"] == 6
    assert record["level"] == "info" and record["time"].endswith("Z")
