"""`specserve bench openai-features` on tiny settings: it runs, prints each goal's row with a verdict and
writes its figures (no timing assertions: the figures come from a full run, see BENCHMARKS.md)."""

from __future__ import annotations

import json

from specserve.cli import main


def test_bench_openai_features_smoke(llama_dir, tmp_path, capsys):
    out = tmp_path / "f.json"
    rc = main(["bench", "openai-features", "--model", str(llama_dir), "--drafter", "ngram", "--no-draft-model",
               "--prompts", "2", "--max-tokens", "4", "--rounds", "1", "--batch-sizes", "1,2", "--n", "2",
               "--threads", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for field in ("(a) logprobs=5 batch 1", "(a) logprobs=5 batch 2", "(b) ngram (default) speedup kept",
                  "(c) n=2 TTFT", "engine alone"):
        assert field in text, text
    r = json.loads(out.read_text())
    assert [row["batch"] for row in r["a_logprobs"]] == [1, 2]
    assert all(row["none_tokens_per_s"] > 0 and row["logprobs_tokens_per_s"] > 0 for row in r["a_logprobs"])
    assert set(r["b_penalties"]["tokens_per_s"]) == {"plain", "plain+pen", "ngram (default)", "ngram (default)+pen"}
    assert r["c_n"]["ttft_1_ms"] > 0 and r["c_n"]["ttft_n_last_ms"] >= r["c_n"]["ttft_n_first_ms"] > 0
    assert set(r["verdicts"]) == {"a batch 1", "a batch 2", "b ngram (default)", "c"}
    assert all(isinstance(v, bool) for v in r["verdicts"].values())


def test_bench_openai_features_bad_input(llama_dir, capsys):
    rc = main(["bench", "openai-features", "--model", str(llama_dir), "--top-logprobs", "21"])
    err = capsys.readouterr().err
    assert rc == 2 and "--top-logprobs must be in [0, 20]" in err
