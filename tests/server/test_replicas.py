"""Data-parallel replicas behind one server (`specserve serve --replicas N`): real child processes.

Routing (least loaded, websocket sessions sticky) is unit-tested on stand-in replicas; the server tests
run two real engines (the server's own and one child process) on loopback: greedy answers equal one
engine's, requests spread over both, and a child killed mid-stream fails only its own requests while
the other replica's streams finish and /health reports the dead one.
"""

from __future__ import annotations

import json
import urllib.request

from server_utils import greedy_text, wait_until
from wsclient import Conn

from specserve.server.replicas import ReplicaPool


class _Standin:
    def __init__(self) -> None:
        self.alive = True
        self.submitted: list[str] = []

    def submit(self, rid, *args) -> None:
        self.submitted.append(rid)


def _pool(n: int) -> ReplicaPool:
    pool = ReplicaPool.__new__(ReplicaPool)
    ReplicaPool.__init__(pool, _Standin(), {}, 1, None)
    pool.replicas = [_Standin() for _ in range(n)]
    pool.served = [0] * n
    return pool


def test_requests_go_to_the_least_loaded_replica_and_sessions_stay_put():
    pool = _pool(3)
    for i in range(6):  # in flight: spread round the replicas
        pool.submit(f"r{i}", [1], None, False, 0.0, lambda u: None, None, f"conn:10.0.0.{i}:5000")
    assert [len(r.submitted) for r in pool.replicas] == [2, 2, 2]
    pool.submit("s1", [1], None, False, 0.0, lambda u: None, None, "sess_a")  # a session's first request
    home = next(r for r in pool.replicas if "s1" in r.submitted)
    for i in range(3):  # more load elsewhere does not move the session...
        pool.submit(f"x{i}", [1], None, False, 0.0, lambda u: None, None, "conn:10.0.0.1:5001")
    pool.submit("s2", [1], None, False, 0.0, lambda u: None, None, "sess_a")
    assert "s2" in home.submitted
    home.alive = False  # ...its replica dying does
    pool.submit("s3", [1], None, False, 0.0, lambda u: None, None, "sess_a")
    assert "s3" not in home.submitted and any("s3" in r.submitted for r in pool.replicas if r.alive)


def test_requests_that_finish_before_the_next_arrives_still_spread():
    """Nothing in flight at each arrival (short requests, one after another): ties go to the replica that has
    served fewest, not always to replica 0."""
    pool = _pool(3)
    for i in range(6):
        pool.submit(f"r{i}", [1], None, False, 0.0, lambda u: None, None, f"conn:10.0.0.{i}:5000")
        pool._owner.clear()  # r{i} finished before the next request arrived
    assert [r.submitted for r in pool.replicas] == [["r0", "r3"], ["r1", "r4"], ["r2", "r5"]]


def test_a_prompt_goes_where_its_prefix_went_load_permitting():
    """Prefix caching: prompts that start alike (a system prompt) follow the first one's replica, whose cache
    holds their blocks — until that replica is PREFIX_AFFINITY_SLACK requests busier than the least loaded."""
    from specserve.server.replicas import PREFIX_AFFINITY_SLACK, PREFIX_AFFINITY_TOKENS

    pool = _pool(3)
    system = list(range(PREFIX_AFFINITY_TOKENS))
    sink = lambda u: None  # noqa: E731
    pool.submit("p0", system + [1], None, False, 0.0, sink, None, "conn:a")
    home = next(r for r in pool.replicas if "p0" in r.submitted)
    for i in range(1, PREFIX_AFFINITY_SLACK + 1):  # the same first tokens follow p0 while home is not too busy
        pool.submit(f"p{i}", system + [i, i], None, False, 0.0, sink, None, f"conn:{i}")
    assert all(f"p{i}" in home.submitted for i in range(PREFIX_AFFINITY_SLACK + 1))
    pool.submit("busy", system + [9], None, False, 0.0, sink, None, "conn:z")  # home is too far ahead now
    assert "busy" not in home.submitted
    pool.submit("short", [5, 6], None, False, 0.0, sink, None, "conn:y")
    assert "short" not in home.submitted


def _health(srv) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(srv.http_url + "health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_two_replicas_answer_like_one_engine_and_share_the_load(make_server, reference_llm):
    srv = make_server(replicas=2)
    prompts = ["def f(x):", "class A:", "import os\n", "for i in range(3):"]
    conns = [Conn(srv.ws_url) for _ in prompts]
    try:
        rids = [c.create(input=p, max_output_tokens=16, temperature=0, ignore_eos=True) for c, p in zip(conns, prompts)]
        for c, rid, p in zip(conns, rids, prompts):
            assert c.wait_done(rid)["status"] == "incomplete"
            assert c.text(rid) == greedy_text(reference_llm, p, 16, ignore_eos=True)
    finally:
        for c in conns:
            c.close()
    status, body = _health(srv)
    assert status == 200 and body["status"] == "ok"
    assert [r["alive"] for r in body["replicas"]] == [True, True]
    assert all(r["served"] >= 1 for r in body["replicas"]), body  # both engines took requests
    assert body["replicas"][1]["pid"] != body["replicas"][0]["pid"]


def test_a_killed_replica_fails_only_its_requests_and_health_reports_it(make_server, noeos_dir):
    srv = make_server(replicas=2, model_dir=noeos_dir, llm_kwargs={"drafter": None})
    pool = srv.server.worker
    conns = [Conn(srv.ws_url) for _ in range(4)]
    try:
        rids = [c.create(input=[5, 6, 7], max_output_tokens=300, temperature=0) for c in conns]
        for c, rid in zip(conns, rids):
            c.wait_delta(rid)
        on_child = [pool._owner.get(rid) is pool.replicas[1] for rid in rids]
        assert sum(on_child) == 2, on_child
        pool.replicas[1].process.kill()
        for c, rid, child in zip(conns, rids, on_child):
            done = c.wait_done(rid)
            if child:
                assert done["status"] == "failed" and done["error"]["code"] == "internal_error", done
            else:
                assert done["status"] == "incomplete", done  # ran to max_output_tokens on replica 0
        status, body = _health(srv)
        assert status == 200 and body["status"].startswith("degraded")
        assert [r["alive"] for r in body["replicas"]] == [True, False]
        rid = conns[0].create(input=[5, 6, 7], max_output_tokens=8, temperature=0)  # still served, by replica 0
        assert conns[0].wait_done(rid)["status"] == "incomplete"
    finally:
        for c in conns:
            c.close()
    free, total = wait_until(lambda: (lambda f: f if f[0] == f[1] else None)(
        srv.engine_call(lambda e: (e.cache.allocator.num_free_blocks, e.cache.allocator.num_blocks))))
    assert free == total  # replica 0 freed the KV of the requests it finished
