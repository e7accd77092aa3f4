"""`specserve train default-drafter` on the default model, and what `drafter="auto"` then builds.

The picker's own rule is tested on recorded figures in tests/training/test_bundle.py (the tiny model); here the
eval is replaced by a table too (no default model in the tests), and the end-to-end check runs a tiny GGUF file
placed where the default model's file lives."""

from __future__ import annotations

import json

import pytest

from specserve import default_model_drafters
from specserve.bundle_paths import default_drafter, default_drafter_options
from specserve.drafters.suffix import SuffixDrafter
from specserve.loading.default_model import SHA256, default_model_file


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    out = tmp_path / "shipped"
    monkeypatch.setattr(default_model_drafters, "drafters_dir", lambda: out)
    return out


def test_a_suffix_drafter_learns_across_requests_only_with_its_shared_index():
    assert SuffixDrafter.learns_across_requests_with({}) and SuffixDrafter.learns_across_requests_with({"shared_tokens": 8})
    assert not SuffixDrafter.learns_across_requests_with({"shared_tokens": 0})
    assert SuffixDrafter(None).learns_across_requests and not SuffixDrafter(None, shared_tokens=0).learns_across_requests


def test_the_default_models_default_is_measured_on_chat_and_recorded_with_its_options(tmp_path, shipped, monkeypatch):
    import specserve.evals.suite as suite
    from specserve.evals.default_drafter import DEFAULT_CANDIDATES, PER_REQUEST_SUFFIX, pick_default_drafter, table_markdown
    from specserve.loading import default_model

    monkeypatch.setattr(default_model, "default_model_path", lambda fetch=True: tmp_path / "model.gguf")
    # The fastest two learn across requests (their trees would depend on other users' requests): not eligible.
    figures = {"ngram": (1.10, 1.3), PER_REQUEST_SUFFIX: (1.33, 1.6), "suffix": (1.36, 1.7), "lookahead": (0.95, 1.0),
               "hybrid:ngram+suffix": (1.40, 1.7)}
    seen = []

    def fake_eval(cfg):
        seen.append(cfg)
        return {"drafters": {n: {"speedup": s, "tau": t, "tokens_per_s": 50 * s, "identical_fraction": 1.0}
                             for n, (s, t) in figures.items()},
                "settings": {"num_prompts": 8}, "plain": {"tokens_per_s": 50.0}, "machine": {}}

    monkeypatch.setattr(suite, "run_eval", fake_eval)
    record = pick_default_drafter(DEFAULT_CANDIDATES["default"], str(tmp_path / "run"), model="default")
    cfg, sampled = seen
    assert cfg.dataset == "builtin:heldout-chat" and cfg.model == str(tmp_path / "model.gguf") and cfg.temperature == 0
    # The eligible greedy leaders again at temperature 1 (the fake gives the same figures, all above the floor but
    # lookahead's): the choice stands.
    assert sampled.temperature == 1.0 and sampled.drafters == [PER_REQUEST_SUFFIX, "ngram", "lookahead"]
    assert record["candidates"]["ngram"]["sampled_speedup"] == 1.10 and "sampled_speedup" not in record["candidates"]["suffix"]
    assert sorted(cfg.drafters) == sorted(figures)  # no drafter ships in this test's folder: the heads do not run
    assert record["not_run"] == ["eagle", "hybrid:suffix+eagle", "hybrid:suffix+medusa", "hybrid:suffix+medusa#per-request",
                                 "medusa"]
    assert cfg.drafter_options == {PER_REQUEST_SUFFIX: {"shared_tokens": 0}}
    assert record["not_eligible"] == ["hybrid:ngram+suffix", "suffix"]
    assert record["default_drafter"] == "suffix" and record["default_drafter_options"] == {"shared_tokens": 0}
    manifest = json.loads((shipped / "MANIFEST.json").read_text())
    assert manifest["target"]["sha256"] == SHA256 and manifest["drafters"] == {}
    assert manifest["default_drafter_eval"]["candidates"][PER_REQUEST_SUFFIX]["speedup"] == 1.33
    assert default_drafter(default_model_file()) == "suffix"
    assert default_drafter_options(default_model_file()) == {"shared_tokens": 0}
    assert f"`{PER_REQUEST_SUFFIX}` **(default)**" in table_markdown(record)
    assert default_drafter(tmp_path / "another.gguf") is None and default_drafter_options(tmp_path / "another.gguf") == {}


def test_a_default_that_slows_sampled_decoding_is_passed_over(tmp_path, shipped, monkeypatch):
    """The greedy leader runs 0.96x plain at temperature 1 (below the 0.97 floor): the next leader above the floor is
    chosen; with every leader below it, the greedy rule alone decides."""
    import specserve.evals.suite as suite
    from specserve.evals.default_drafter import PER_REQUEST_SUFFIX, pick_default_drafter, table_markdown
    from specserve.loading import default_model

    monkeypatch.setattr(default_model, "default_model_path", lambda fetch=True: tmp_path / "model.gguf")
    greedy = {"ngram": (1.10, 1.3), "lookahead": (1.05, 1.2), PER_REQUEST_SUFFIX: (1.36, 2.4)}
    for at_one, expected in (({"ngram": 1.02, "lookahead": 0.99, PER_REQUEST_SUFFIX: 0.96}, "ngram"),
                             ({"ngram": 0.90, "lookahead": 0.95, PER_REQUEST_SUFFIX: 0.96}, "suffix")):
        def fake_eval(cfg):
            speed = {n: (at_one[n] if cfg.temperature else s, t) for n, (s, t) in greedy.items() if n in cfg.drafters}
            return {"drafters": {n: {"speedup": s, "tau": t, "tokens_per_s": 50 * s, "identical_fraction": 1.0}
                                 for n, (s, t) in speed.items()},
                    "settings": {"num_prompts": 8}, "plain": {"tokens_per_s": 50.0}, "machine": {}}

        monkeypatch.setattr(suite, "run_eval", fake_eval)
        record = pick_default_drafter({"ngram": {}, "lookahead": {}, PER_REQUEST_SUFFIX: {"shared_tokens": 0}},
                                      str(tmp_path / "run"), model="default")
        assert record["default_drafter"] == expected
        assert record["candidates"][PER_REQUEST_SUFFIX]["sampled_speedup"] == 0.96
        assert f"| 1.36 | 2.40 | 68 | 0.96 |" in table_markdown(record)


def test_auto_on_the_default_models_file_builds_the_recorded_drafter_with_its_options(tmp_path, shipped, monkeypatch,
                                                                                        llama_dir):
    from loading.gguf_writer import write_gguf

    from specserve import LLM, SamplingParams

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = default_model_file()  # a tiny model where the default model's file lives
    path.parent.mkdir(parents=True)
    write_gguf(llama_dir, path, "F32")
    shipped.mkdir()
    record = default_model_drafters.empty_manifest() | {"default_drafter": "suffix",
                                                          "default_drafter_options": {"shared_tokens": 0}}
    (shipped / "MANIFEST.json").write_text(json.dumps(record))
    llm = LLM(str(path), drafter="auto", threads=1)
    assert llm.drafter_spec == "suffix"
    assert llm.engine.drafter.shared_tokens == 0 and not llm.engine.drafter.learns_across_requests
    mine = LLM(str(path), drafter="auto", drafter_options={"shared_tokens": 64}, threads=1)  # the caller's option wins
    assert mine.engine.drafter.shared_tokens == 64
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(path), drafter=None, threads=1)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    assert llm.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids
    record["default_drafter"] = "medusa"  # not shipped: auto falls back, and the options with it
    (shipped / "MANIFEST.json").write_text(json.dumps(record))
    assert default_drafter(path) == default_model_drafters.FALLBACK_DRAFTER and default_drafter_options(path) == {}
