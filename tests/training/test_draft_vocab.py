"""`specserve train draft-vocab`: the N most frequent target tokens of a corpus's train split, written
beside a draft model; the drafter then drafts over them only and stays lossless."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from cli_runner import cli
from specserve.drafters.draft_vocab import load_draft_vocab
from specserve.training.corpus import build_corpus
from specserve.training.draft_vocab import write_draft_vocab
from tiny_models import build_model
from tokenizers import Tokenizer

from specserve import LLM, SamplingParams

TEXTS = {
    "alpha.py": "def add(x, y):\n    return x + y\n\n" * 30 + "class Point:\n    pass\n",
    "beta.py": "for i in range(10):\n    print(i)\n" * 25 + "import os\nos.path.join('a', 'b')\n",
    "gamma.py": "while True:\n    break\n" * 20 + "value = [x * x for x in range(5)]\n",
    "delta.py": "def f(a):\n    if a:\n        return a\n    return None\n" * 15,
}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for name, text in TEXTS.items():
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory):
    """A small draft model with the target's tokenizer (`build_model` trains the same one every time)."""
    return build_model(tmp_path_factory.mktemp("draft"), "llama", hidden_size=32, layers=1, heads=2, kv_heads=1, seed=5,
                       init_std=0.2)


def test_the_draft_vocabulary_is_the_most_frequent_train_tokens(draft_dir, corpus_dir):
    summary = write_draft_vocab(draft_dir, 40, corpus=[str(corpus_dir)], heldout_fraction=0.25)
    ids = load_draft_vocab(draft_dir, 10**9)
    # Brute force: count with the tokenizer one text at a time; ties go to the lower id.
    corpus = build_corpus([str(corpus_dir)], heldout_fraction=0.25)
    tokenizer = Tokenizer.from_file(str(draft_dir / "tokenizer.json"))
    counts = Counter(t for text in corpus.texts("train") for t in tokenizer.encode(text).ids)
    expected = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:40])
    assert ids.tolist() == expected
    covered = sum(counts[t] for t in expected) / sum(counts.values())
    assert summary["train_coverage"] == pytest.approx(covered) and summary["size"] == 40
    assert 0 < summary["heldout_coverage"] <= 1


def test_a_draft_vocabulary_from_the_cli_stays_lossless(capsys, llama_dir, draft_dir, corpus_dir):
    out = cli(capsys, "train", "draft-vocab", "--draft", str(draft_dir), "--size", "64", "--corpus", str(corpus_dir))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["size"] == 64
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = ["def add(x, y):", "for i in range(10):", "class Point:"]
    plain = LLM(llama_dir, device="cpu").generate(prompts, params)
    llm = LLM(llama_dir, drafter=f"draft:{draft_dir}", drafter_options={"depth": 3, "topk": 2}, device="cpu",
              speculation="static")
    assert llm.engine.drafter.vocab == 64
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert all(o.spec.num_drafted > 0 for o in llm.generate(prompts, params))  # it did draft


@pytest.mark.parametrize("size", ["0", "100000"])
def test_a_bad_size_is_one_line_and_exit_2(capsys, draft_dir, corpus_dir, size):
    out = cli(capsys, "train", "draft-vocab", "--draft", str(draft_dir), "--size", size, "--corpus", str(corpus_dir))
    assert out.returncode == 2 and "--size must be in [1," in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
