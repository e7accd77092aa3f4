"""`specserve bench soak` in its CI form: 8 clients (4 of them hostile) for a short run against a real server
on loopback with the embedded model. Every invariant must hold: one terminal event per response, greedy
answers equal to their solo references, seeded answers reproduced (static speculation), every hostile
input answered with its documented error, no KV blocks, responses or engine requests left once idle, and
the engine thread alive throughout. The latency and memory goals are only reported here: a 20-second
run on a shared CI machine says little about either."""

from __future__ import annotations

import json

from specserve.cli import main
from specserve.evals.soak_scripts import GOOD, HOSTILE


def test_short_soak_keeps_every_invariant(tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--clients", "8", "--duration", "20", "--seed", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert rc == 0, printed
    assert figures["ok"] and not any(figures["invariants"].values()), figures["invariants"]
    assert figures["violations"] == {} and figures["examples"] == [], figures["examples"]
    # The warm-up ran every action once; the phases ran many, and the checks were not vacuous.
    assert set(figures["warmup"]["kinds"]) == set(GOOD) | set(HOSTILE)
    assert sum(figures["kinds"].values()) > 20, figures["kinds"]
    assert figures["checks"].get("greedy", 0) > 10 and figures["checks"].get("seeded", 0) > 0, figures["checks"]
    assert figures["memory"]["requests"] > 20
    for phase in ("quiet", "hostile"):
        assert figures["latency"][phase]["ttft_ms"]["n"] > 0 and figures["latency"][phase]["itl_ms"]["n"] > 0
    for idle in figures["idle"].values():
        assert idle["kv_blocks_used"] == 0 and idle["kv_blocks_used_gauge"] == 0 and idle["engine_requests"] == 0
        assert idle["responses_in_flight"] == 0 and idle["connections"] == 0 and idle["engine_alive_gauge"] == 1
    assert "soak: PASS" in printed and "leaked KV blocks when idle" in printed and "p99 TTFT hostile / quiet" in printed


def test_soak_bad_input_is_one_line(capsys):
    assert main(["bench", "soak", "--clients", "0"]) == 2
    assert "--clients" in capsys.readouterr().err
    assert main(["bench", "soak", "--hostile-share", "1.5"]) == 2
    assert "--hostile-share" in capsys.readouterr().err
