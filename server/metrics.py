"""Prometheus metrics (``GET /metrics``) through prometheus-client, one registry per server.

Counted as requests finish (both APIs): requests by api and status, prompt and generated tokens,
TTFT (receipt → first token), inter-token latency (each engine delivery's gap shared by the tokens it
carries), speculation per drafter: draft tokens proposed and accepted, verify steps, τ per request, and
prefix caching: prompt tokens looked up and served from the cache. Read at scrape time: queue depth,
running sequences, KV blocks used and free, cached and evictable (the engine thread's snapshot after its
latest step), the prefix cache's hit rate, open connections and responses in flight.

Statuses: ``completed`` (stopped by EOS or a stop string), ``length`` (max tokens or the context
end), ``cancelled`` (by the client, or it went away), ``failed`` (the engine refused or failed it, or
the client read too slowly) and ``rejected`` (refused before reaching the engine: bad input, busy).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)

STATUSES = ("completed", "length", "cancelled", "failed", "rejected")

# The *_created series (a timestamp per counter) only double the scrape; vLLM leaves them out too.
disable_created_metrics()

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics", "TokenClock"]


class ServerMetrics:
    def __init__(self, server) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specserve_requests", "Finished requests by API and status", ["api", "status"], registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of requests that reached the engine", ["api"], registry=r)
        self.generated_tokens = Counter("specserve_generation_tokens", "Output tokens generated", ["api"], registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Receipt of a request to its first token",
                              ["api"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specserve_inter_token_latency_seconds",
                             "Time between engine deliveries of a response, per token delivered", ["api"],
                             buckets=ITL_BUCKETS, registry=r)
        self.drafted = Counter("specserve_spec_draft_tokens", "Draft tokens proposed for verification", ["drafter"], registry=r)
        self.accepted = Counter("specserve_spec_accepted_tokens", "Draft tokens the target accepted", ["drafter"], registry=r)
        self.verify_steps = Counter("specserve_spec_verify_steps", "Verify steps (each emits accepted + 1 tokens)",
                                    ["drafter"], registry=r)
        self.tau = Histogram("specserve_spec_tau", "Tokens per verify step of each finished request (τ, bonus included)",
                             ["drafter"], buckets=TAU_BUCKETS, registry=r)
        self.prefix_queried = Counter("specserve_prefix_cache_queried_tokens",
                                      "Prompt tokens looked up in the prefix cache (of requests that reached the engine)",
                                      registry=r)
        self.prefix_hit = Counter("specserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  registry=r)
        self.prefix_totals = [0, 0]  # queried, hit: the hit-rate gauge's inputs
        r.register(_LoadCollector(server))

    def finished(self, api: str, status: str, summary=None, drafter: str | None = None) -> None:
        """A request ended (``summary``: the engine's Summary, None when it never reached the engine)."""
        self.requests.labels(api, status).inc()
        if summary is None or summary.reason == "rejected":
            return
        self.prompt_tokens.labels(api).inc(summary.input_tokens)
        self.generated_tokens.labels(api).inc(summary.output_tokens)
        self.prefix_queried.inc(summary.input_tokens)
        self.prefix_hit.inc(summary.cached_tokens)
        self.prefix_totals[0] += summary.input_tokens
        self.prefix_totals[1] += summary.cached_tokens
        ttft_ms = (summary.timing or {}).get("ttft_ms")
        if ttft_ms is not None:
            self.ttft.labels(api).observe(ttft_ms / 1e3)
        steps = (summary.spec or {}).get("steps", 0)
        if steps:
            label = drafter or "none"
            self.drafted.labels(label).inc(summary.drafted)
            self.accepted.labels(label).inc(summary.accepted)
            self.verify_steps.labels(label).inc(steps)
            self.tau.labels(label).observe(summary.spec["tau"])

    def token_clock(self, api: str) -> TokenClock:
        return TokenClock(self.itl.labels(api))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenClock:
    """One response's inter-token latency: each delivery's gap since the previous one, once per token."""

    __slots__ = ("histogram", "last")

    def __init__(self, histogram) -> None:
        self.histogram = histogram
        self.last: float | None = None

    def tokens(self, now: float, n: int) -> None:
        if n <= 0:
            return
        if self.last is not None:
            per_token = (now - self.last) / n
            for _ in range(n):
                self.histogram.observe(per_token)
        self.last = now


class _LoadCollector:
    """Gauges read at scrape time from the server and the engine thread's latest snapshot."""

    def __init__(self, server) -> None:
        self.server = server

    def describe(self):
        return []  # nothing to check at registration: collect() reads live objects

    def collect(self):
        server = self.server
        worker = server.worker
        load = worker.load if worker is not None else None
        yield _gauge("specserve_queue_depth", "Requests waiting for a batch slot", load.waiting if load else 0)
        yield _gauge("specserve_running_sequences", "Sequences in the running batch", load.running if load else 0)
        yield _gauge("specserve_kv_blocks_used", "KV cache blocks in use", load.kv_blocks_used if load else 0)
        yield _gauge("specserve_kv_blocks_free", "KV cache blocks free (evictable cached blocks included)",
                     load.kv_blocks_free if load else 0)
        yield _gauge("specserve_kv_blocks_cached", "KV cache blocks the prefix cache holds", load.kv_blocks_cached if load else 0)
        yield _gauge("specserve_kv_blocks_evictable", "Cached KV blocks no request holds (free when space is needed)",
                     load.kv_blocks_evictable if load else 0)
        queried, hit = server.metrics.prefix_totals
        yield _gauge("specserve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens",
                     hit / queried if queried else 0.0)
        yield _gauge("specserve_responses_in_flight", "Responses accepted and not yet finished (both APIs)", server.in_flight)
        yield _gauge("specserve_websocket_connections", "Open websocket connections", server.connections)
        yield _gauge("specserve_engine_alive", "1 while the engine thread runs", int(worker is not None and worker.alive))
        replicas = getattr(worker, "replicas", None)
        if replicas is not None:
            yield _gauge("specserve_replicas_alive", "Engine replicas serving", sum(r.alive for r in replicas))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
