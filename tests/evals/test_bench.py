"""`specserve bench verify` and `specserve bench batch` on a tiny model: tables, JSON, bad input."""

from __future__ import annotations

import json

import pytest

from specserve.cli import main
from specserve.evals.bench_verify import tree_parents


def test_tree_shapes():
    assert tree_parents(4, "chain", 2) == [-1, 0, 1, 2]
    assert tree_parents(6, "tree", 2) == [-1, -1, 0, 0, 1, 1]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_bench_verify(llama_dir, tmp_path, capsys, shape):
    out = tmp_path / "v.json"
    rc = main(["bench", "verify", "--model", str(llama_dir), "--sizes", "1,4,8", "--shape", shape, "--prefix-tokens", "16",
               "--repeats", "2", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    assert "nodes" in capsys.readouterr().out
    rows = json.loads(out.read_text())["sizes"]
    assert [r["nodes"] for r in rows] == [0, 1, 4, 8] and rows[0]["relative"] == 1.0
    assert rows[-1]["depth"] == (8 if shape == "chain" else 3) and all(r["ms"] > 0 for r in rows)


def test_bench_batch(llama_dir, tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["bench", "batch", "--model", str(llama_dir), "--batch-sizes", "1,2", "--prompt-tokens", "8", "--max-tokens", "6",
               "--repeats", "1", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    assert "decode tok/s" in capsys.readouterr().out
    rows = json.loads(out.read_text())["batches"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["decode_tokens_per_s"] > 0 for r in rows)
    assert rows[1]["decode_tokens_per_s_per_request"] == pytest.approx(rows[1]["decode_tokens_per_s"] / 2)


@pytest.mark.parametrize("args, message", [
    (["verify", "--sizes", "1,x"], "--sizes expects comma-separated integers"),
    (["verify", "--prefix-tokens", "600"], "exceed the context window"),
    (["batch", "--batch-sizes", "0,2"], "--batch-sizes must be integers >= 1"),
    (["batch", "--max-tokens", "1"], "--max-tokens must be >= 2"),
])
def test_bench_bad_input(llama_dir, capsys, args, message):
    rc = main(["bench", *args, "--model", str(llama_dir), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err
