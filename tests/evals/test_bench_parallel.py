"""`specserve bench parallel` on tiny models: both sections run end to end, and bad input is refused."""

from __future__ import annotations

import json

import pytest

from specserve.cli import main


def test_bench_parallel_tp_and_replicas(llama_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["bench", "parallel", "--model", str(llama_dir), "--replicas-model", str(llama_dir), "--batch-sizes", "1,2",
               "--new-tokens", "4", "--repeats", "1", "--replicas", "1,2", "--concurrency", "2", "--requests", "2",
               "--max-output-tokens", "8", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TP=2" in printed and "replicas 2" in printed
    figures = json.loads(out.read_text())
    for row in figures["tensor_parallel"]["by_batch"].values():
        assert row["tp_greedy_equals_one_device"] is True
        assert all(r["tokens_per_s"] > 0 for r in row.values() if isinstance(r, dict))
        assert 0 < row["torch layers, TP=2"]["collective_share"] < 1
    rows = figures["replicas"]["by_replicas"]
    assert [r["replicas"] for r in rows] == [1, 2] and all(r["aggregate_tokens_per_s"] > 0 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--sections", "gpu"], "--sections takes tp and/or replicas"),
    (["--replicas", "0"], "--replicas must be integers >= 1"),
    (["--batch-sizes", "a"], "--batch-sizes expects comma-separated integers"),
])
def test_bench_parallel_bad_input(argv, message, capsys):
    assert main(["bench", "parallel", *argv]) == 2
    assert message in capsys.readouterr().err
