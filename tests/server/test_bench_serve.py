"""`specserve bench serve` runs end to end (a smoke run: its figures are not asserted, only their shape)."""

from __future__ import annotations

import json

from specserve.cli import main


def test_bench_serve_smoke(llama_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--model", str(llama_dir), "--concurrency", "1,2", "--requests", "2", "--warmup", "0",
               "--prompt-tokens", "4", "--max-output-tokens", "4", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "server overhead ms" in printed and "concurrency 2" in printed
    figures = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in figures["levels"]] == [1, 2]
    for level in figures["levels"]:
        assert level["requests"] == level["concurrency"] * 2
        assert level["ttft_ms"]["p50"] > 0 and level["aggregate_tokens_per_s"] > 0


def test_bench_serve_bad_input_is_one_line(capsys):
    assert main(["bench", "serve", "--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
