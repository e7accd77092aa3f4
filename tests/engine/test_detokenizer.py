"""Incremental detokenization is UTF-8 safe, matches a full decode, and never streams a stop string."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.detokenizer import IncrementalDetokenizer
from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


TEXTS = ["def f(x):\n    return x + 1\n", "Ünïcödé ✓ 日本語 and emoji 🚀🚀 done", "plain ascii"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode_and_are_valid_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[1, 2])
    deltas = []
    for tok in ids:
        detok.add(tok)
        deltas.append(detok.take_delta(final=False))
    detok.flush()
    deltas.append(detok.take_delta(final=True))
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    # Multi-byte characters split across byte-level tokens are held back, not emitted half-way.
    if any(ord(c) > 127 for c in text):
        assert any(d == "" for d in deltas)


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    text = "for i in range(10):\n    print(i)\nEND more text after"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[], stop=("END",))
    streamed = ""
    for tok in ids:
        stopped = detok.add(tok)
        streamed += detok.take_delta(final=stopped)
        if stopped:
            break
    assert stopped
    assert streamed == detok.text == "for i in range(10):\n    print(i)\n"
    assert "E" not in streamed[-3:]


def test_engine_stop_strings_and_stream_equals_generate(llama_dir):
    llm = LLM(llama_dir, drafter="ngram", speculation="static")
    free = llm.generate(["def f(x):"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 4
    stop = free.text[3:5]
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=40, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]
    streamed = "".join(llm.stream("def f(x):", SamplingParams(max_tokens=40, temperature=0, stop=[stop], ignore_eos=True)))
    assert streamed == out.text
    streamed_free = "".join(llm.stream("def f(x):", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    assert streamed_free == free.text


class _DecodeOnly:
    """A tokenizer with `decode` but no fast backend: the two-decode path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_decoder_and_two_decode_path_agree(tokenizer, text):
    ids = tokenizer.encode(text)
    out = []
    for tok in (tokenizer, _DecodeOnly(tokenizer)):
        detok = IncrementalDetokenizer(tok, prompt_ids=[3, 4, 5])
        deltas = []
        for t in ids:
            detok.add(t)
            deltas.append(detok.take_delta(final=False))
        detok.flush()
        deltas.append(detok.take_delta(final=True))
        out.append(deltas)
    assert "".join(out[0]) == "".join(out[1]) == text
