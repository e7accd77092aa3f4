"""llama.cpp as a peer: converter discovery and its errors, the subprocess conversion and its cache
(against a stand-in converter, so CI checks them without llama.cpp), the skip line when llama.cpp is
not available, and — when llama-cpp-python and $LLAMA_CPP_SOURCE are there — the real thing on a tiny
model: conversion, greedy agreement with our decoding, `bench decode --peer` and `eval --peers`."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from specserve.cli import main
from specserve.evals import llamacpp_peer as lp
from specserve.evals.suite import EvalConfig, run_eval

REAL_SOURCE = os.environ.get(lp.ENV_SOURCE)
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or not REAL_SOURCE,
    reason=f"needs llama-cpp-python and ${lp.ENV_SOURCE} (a llama.cpp source tree)",
)

# A stand-in for llama.cpp's converter with the same entry points: a model class whose
# get_vocab_base_pre refuses unknown tokenizers, and main() reading the converter's arguments. It
# writes what it was asked and what the pre-tokenizer came out as, and counts its runs.
FAKE_CONVERTER = '''
import argparse, os
from pathlib import Path

class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized")

def main():
    p = argparse.ArgumentParser()
    p.add_argument("model"); p.add_argument("--outfile"); p.add_argument("--outtype")
    a = p.parse_args()
    if os.environ.get("FAKE_CONVERTER_FAIL"):
        raise RuntimeError("Model MysteryForCausalLM is not supported")
    runs = Path(__file__).parent / "runs.txt"
    runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
    Path(a.outfile).write_text(f"{a.outtype} {TextModel().get_vocab_base_pre(None)} {sorted(os.listdir(a.model))}")

if __name__ == "__main__":
    main()
'''


def fake_tree(root: Path, converter: str = FAKE_CONVERTER) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / lp.CONVERTER).write_text(converter)
    (root / "gguf-py" / "gguf").mkdir(parents=True, exist_ok=True)
    (root / "gguf-py" / "gguf" / "__init__.py").write_text("")
    return root


def one_line(err: str, needle: str) -> str:
    lines = [ln for ln in err.splitlines() if needle in ln]
    assert len(lines) == 1, err
    return lines[0]


# -- discovery --------------------------------------------------------------------------------------

def test_find_converter_in_a_tree_and_in_an_sdist(tmp_path, monkeypatch):
    monkeypatch.delenv(lp.ENV_SOURCE, raising=False)
    tree = fake_tree(tmp_path / "llama.cpp")
    assert lp.find_converter(str(tree)) == tree.resolve()
    sdist = tmp_path / "llama_cpp_python-0.3.36"
    vendored = fake_tree(sdist / "vendor" / "llama.cpp")
    assert lp.find_converter(str(sdist)) == vendored.resolve()
    monkeypatch.setenv(lp.ENV_SOURCE, str(sdist))
    assert lp.find_converter(None) == vendored.resolve()
    assert lp.find_converter(str(tree)) == tree.resolve()  # the option wins over the environment


def test_no_converter_given_is_a_skip_reason_naming_what_to_pass(monkeypatch):
    monkeypatch.delenv(lp.ENV_SOURCE, raising=False)
    with pytest.raises(lp.PeerUnavailable) as exc:
        lp.find_converter(None)
    assert "--llama-cpp-source" in str(exc.value) and lp.ENV_SOURCE in str(exc.value)
    assert "pip download --no-binary :all: --no-deps llama-cpp-python" in str(exc.value)


@pytest.mark.parametrize("layout, message", [
    ("missing", "is not a directory"),
    ("empty", "holds no convert_hf_to_gguf.py"),
    ("no-gguf-py", "no gguf-py/gguf package"),
])
def test_bad_converter_source_is_bad_input(tmp_path, monkeypatch, layout, message):
    monkeypatch.delenv(lp.ENV_SOURCE, raising=False)
    src = tmp_path / "src"
    if layout != "missing":
        src.mkdir()
    if layout == "no-gguf-py":
        (src / lp.CONVERTER).write_text("")
    with pytest.raises(ValueError, match=message):
        lp.find_converter(str(src))
    monkeypatch.setenv(lp.ENV_SOURCE, str(src))  # the same from the environment, which the message names
    with pytest.raises(ValueError, match=rf"\${lp.ENV_SOURCE} .*{message}"):
        lp.find_converter(None)


def test_missing_llama_cpp_python_is_a_skip_reason(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(lp.PeerUnavailable, match=r'pip install -e "\.\[llamacpp\]"'):
        lp.require_llama_cpp()
    monkeypatch.delenv(lp.ENV_SOURCE, raising=False)
    reason = lp.locate(None)  # both missing: one reason naming both, so the user fixes them in one go
    assert isinstance(reason, lp.PeerUnavailable) and "llamacpp" in str(reason) and "--llama-cpp-source" in str(reason)
    with pytest.raises(ValueError, match="not a directory"):  # a bad path given is bad input, whatever else is missing
        lp.locate("/nonexistent")
    # No model named and no $SPECSERVE_MODEL: the default model runs, a GGUF file, which needs no converter.
    monkeypatch.delenv("SPECSERVE_MODEL", raising=False)
    reason = lp.locate(None)
    assert isinstance(reason, lp.PeerUnavailable) and "llamacpp" in str(reason) and "--llama-cpp-source" not in str(reason)


# -- conversion through a stand-in converter ----------------------------------------------------------

def test_convert_runs_the_converter_once_with_the_pre_tokenizer_fallback(llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("FAKE_CONVERTER_FAIL", raising=False)
    tree = fake_tree(tmp_path / "tree")
    cache = tmp_path / "cache"
    out = lp.convert(llama_dir, tree, "f16", cache)
    outtype, pre, files = out.read_text().split(" ", 2)
    assert (outtype, pre) == ("f16", "gpt-2") and "tokenizer.json" in files and out.name == "model-f16.gguf"
    assert out.parent.parent == cache and lp.convert(llama_dir, tree, "f16", cache) == out
    assert (tree / "runs.txt").read_text() == "x"  # the second call was served from the cache
    assert [p.name for p in out.parent.iterdir()] == ["model-f16.gguf"]  # no partial files left behind

    # a new converter version, or other checkpoint content, is a new cache entry
    (tree / lp.CONVERTER).write_text(FAKE_CONVERTER + "\n# v2\n")
    assert lp.convert(llama_dir, tree, "f16", cache).parent != out.parent
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in llama_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "generation_config.json").write_text('{"eos_token_id": 1}')
    assert lp.checkpoint_hash(copy) != lp.checkpoint_hash(llama_dir)


def test_a_checkpoint_without_tokenizer_gets_a_stand_in(tmp_path, small_vocab_dir):
    from tiny_models import build_model

    tree = fake_tree(tmp_path / "tree")
    bare = build_model(tmp_path / "bare", "llama", vocab_size=400, tokenizer=False)
    files = lp.convert(bare, tree, "f32", tmp_path / "cache").read_text().split(" ", 2)[2]
    assert "tokenizer.json" in files and "model.safetensors" in files
    assert not (bare / "tokenizer.json").exists()  # staged next to the cache, the checkpoint is untouched
    with pytest.raises(ValueError, match="no tokenizer.*too small"):
        lp.convert(small_vocab_dir, tree, "f32", tmp_path / "cache")


def test_converter_failure_is_one_line_with_its_last_error(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CONVERTER_FAIL", "1")
    with pytest.raises(ValueError, match="converter failed on .*MysteryForCausalLM is not supported") as exc:
        lp.convert(llama_dir, fake_tree(tmp_path / "tree"), "f32", tmp_path / "cache")
    assert "\n" not in str(exc.value)
    old = fake_tree(tmp_path / "old", "def main():\n    pass\n")
    with pytest.raises(ValueError, match="unsupported converter version"):
        lp.convert(llama_dir, old, "f32", tmp_path / "cache")


# -- the skip path in the benchmarks --------------------------------------------------------------

def test_bench_decode_skips_the_peer_with_one_line_and_runs_the_rest(llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(lp.ENV_SOURCE, raising=False)
    out = tmp_path / "d.json"
    rc = main(["bench", "decode", "--model", str(llama_dir), "--prompt-tokens", "8", "--new-tokens", "8", "--repeats", "1",
               "--skip-transformers", "--peer", "llama.cpp", "--json", str(out)])
    assert rc == 0
    line = one_line(capsys.readouterr().err, "llama.cpp")
    assert line.startswith("llama.cpp peer skipped:") and "--llama-cpp-source" in line
    res = json.loads(out.read_text())
    assert "--llama-cpp-source" in res["llama_cpp"]["skipped"]
    assert res["plain_decode"]["specserve_tokens_per_s"]["median"] > 0 and res["ngram_repeated_prompt"]["speedup"] > 0


def test_bench_decode_bad_converter_source_exits_2(llama_dir, tmp_path, capsys):
    rc = main(["bench", "decode", "--model", str(llama_dir), "--peer", "llama.cpp", "--llama-cpp-source", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "holds no convert_hf_to_gguf.py" in err


def test_eval_skips_the_peer_and_measures_the_others(llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(lp.ENV_SOURCE, raising=False)
    cfg = EvalConfig(drafters=["ngram"], dataset="builtin:heldout-code", max_prompts=1, out=str(tmp_path / "out"),
                     model=str(llama_dir), max_tokens=4, repeats=1, device="cpu", peers=["llama.cpp"], progress=False)
    res = run_eval(cfg)
    assert one_line(capsys.readouterr().err, "llama.cpp").startswith("llama.cpp peer skipped:")
    assert res["peers"] == {} and "llama.cpp" in res["skipped_peers"] and res["status"] == "complete"
    assert res["progress"]["measurements"] == res["progress"]["planned"] == 2  # plain and ngram
    assert res["drafters"]["ngram"]["tokens_per_s"] > 0


# -- the real thing -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@needs_llama_cpp
def test_llama_cpp_greedy_matches_ours_where_the_argmax_is_clear(llama_dir, gguf_cache):
    """f32 against f32: the first greedy token after each prompt is ours wherever the top-2 logit gap
    leaves no room for arithmetic differences (a wrong conversion — rope layout, norms — breaks this)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specserve import LLM, SamplingParams

    peer = lp.load(llama_dir, lp.find_converter(None), dtype="float32", threads=1, n_ctx=128, cache_dir=gguf_cache)
    assert peer.gguf_type == "f32" and peer.gguf.is_file()
    ours = LLM(llama_dir, drafter=None, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    gen = torch.Generator().manual_seed(3)
    clear = 0
    for _ in range(12):
        prompt = torch.randint(0, ours.model.config.vocab_size, (int(torch.randint(4, 40, (1,), generator=gen)),),
                               generator=gen).tolist()
        with torch.inference_mode():
            top2 = hf(torch.tensor([prompt])).logits[0, -1].topk(2).values
        mine = ours.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
        theirs = peer.generate(prompt, 8)
        assert len(theirs) == 8
        if top2[0] - top2[1] > 1e-2:
            clear += 1
            assert theirs[0] == mine[0], prompt
    assert clear >= 6  # the check above really ran


@needs_llama_cpp
@pytest.mark.parametrize("args, gguf_type, dtype", [
    ([], "f32", "float32"), (["--dtype", "bfloat16"], "f16", "bfloat16"),
    (["--quantization", "int8"], "q8_0", "float32"), (["--quantization", "int4"], "q4_0", "float32"),
])
def test_bench_decode_with_llama_cpp(llama_dir, gguf_cache, tmp_path, capsys, args, gguf_type, dtype):
    out = tmp_path / "d.json"
    rc = main(["bench", "decode", "--model", str(llama_dir), "--prompt-tokens", "16", "--new-tokens", "16", "--repeats", "2",
               "--skip-transformers", "--threads", "1", "--peer", "llama.cpp", "--llama-cpp-cache", str(gguf_cache),
               "--json", str(out), *args])
    assert rc == 0, capsys.readouterr().err
    peer = json.loads(out.read_text())["llama_cpp"]
    assert peer["gguf_type"] == gguf_type and peer["threads"] == 1
    assert peer["specserve_dtype"] == dtype
    assert peer["tokens_per_s"]["runs"] == 2 and peer["tokens_per_s"]["median"] > 0
    assert peer["specserve_over_llama_cpp"] == pytest.approx(
        peer["specserve_tokens_per_s"]["median"] / peer["tokens_per_s"]["median"])
    assert 0 <= peer["greedy_agreement"] <= 1
    assert peer["greedy_tokens_match"] == (peer["first_divergence"] is None)


@needs_llama_cpp
def test_eval_with_llama_cpp_peer(llama_dir, gguf_cache, tmp_path):
    cfg = EvalConfig(drafters=["ngram"], dataset="builtin:heldout-code", max_prompts=2, out=str(tmp_path / "out"),
                     model=str(llama_dir), max_tokens=8, repeats=1, device="cpu", peers=["transformers", "llama.cpp"],
                     llama_cpp_cache=str(gguf_cache), progress=False)
    res = run_eval(cfg)
    assert list(res["peers"]) == ["transformers", "llama.cpp"] and res["skipped_peers"] == {}
    assert res["peers"]["llama.cpp"]["tokens_per_s"] > 0 and res["peers"]["llama.cpp"]["prompts_done"] == 2
    assert res["versions"]["llama_cpp_python"]
