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


def test_bench_verify_floor_columns_follow_their_definition(llama_dir, tmp_path, capsys):
    from specserve import LLM
    from specserve.evals.bench_verify import forward_floor
    from specserve.evals.roofline import PeakRates

    out = tmp_path / "v.json"
    rc = main(["bench", "verify", "--model", str(llama_dir), "--sizes", "3,15", "--prefix-tokens", "16", "--repeats",
               "2", "--device", "cpu", "--quantization", "int4", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "roofline:" in printed and "effic." in printed and "int4 products" in printed
    result = json.loads(out.read_text())
    limits = result["roofline"]
    assert limits["bandwidth_gb_s"] > 0 and min(limits["peak_gmac_s"].values()) > 0
    for row in result["sizes"]:
        assert row["efficiency"] == pytest.approx(row["floor_ms"] / row["ms"])
    # The floor: weights streamed once, or each product's multiply-adds at its arithmetic's rate, the longer.
    kernels = LLM(str(llama_dir), drafter=None, device="cpu", quantization="int4").model.kernels
    rates = PeakRates(float32=1e9, int8=2e9, int4=4e9)
    macs = sum(p.out_features * p.in_features for p in kernels.products())
    assert {p.storage for p in kernels.products()} == {"int4"}
    for rows in (1, 4, 16):
        assert forward_floor(kernels, rows, 1e9, rates) == pytest.approx(max(kernels.bytes_read_per_token() / 1e9,
                                                                             rows * macs / 4e9))


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
    (["verify", "--shape", "tree", "--peer", "llama.cpp"], "times chains only"),
    (["batch", "--batch-sizes", "0,2"], "--batch-sizes must be integers >= 1"),
    (["batch", "--max-tokens", "1"], "--max-tokens must be >= 2"),
])
def test_bench_bad_input(llama_dir, capsys, args, message):
    rc = main(["bench", *args, "--model", str(llama_dir), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_bench_quantization(llama_dir, tmp_path, capsys):
    out = tmp_path / "q.json"
    rc = main(["bench", "quantization", "--model", str(llama_dir), "--prompts", "2", "--max-tokens", "4",
               "--json", str(out)])
    assert rc == 0
    assert "argmax agrees on" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = result["settings"]["prompt_rows"]
    assert result["settings"]["prompts"] == 2 and rows > 2
    gap = result["logits_relative_gap"]
    # int8 moves every row's logits a little (never 0, never wholesale), and the argmax mostly survives.
    assert 0 < gap["median"] <= gap["p95"] <= gap["max"] < 0.5
    assert 0.5 <= result["argmax_agreement"] <= 1 and result["argmax_agreement"] * rows == round(result["argmax_agreement"] * rows)
    assert 0 <= result["greedy_identical"] <= 2 and 0 <= result["greedy_mean_common_prefix"] <= 4
    assert result["model"]["quantized_bytes_per_token"] < 0.6 * result["model"]["float_bytes_per_token"]
    rc = main(["bench", "quantization", "--model", str(llama_dir), "--prompts", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--prompts must be >= 1" in err
