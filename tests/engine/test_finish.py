"""Finish reasons: EOS ("stop", even when a draft accepts tokens past it), max_tokens ("length")."""

from __future__ import annotations

import json
import shutil

import scripted_drafter  # noqa: F401
from specserve import LLM, SamplingParams

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_eos_stops_generation_mid_accepted_run(small_vocab_dir, tmp_path):
    free = LLM(small_vocab_dir).generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    # Make the 6th greedy token the EOS token of a copy of the model.
    eos = free.token_ids[5]
    first = free.token_ids.index(eos)
    model = tmp_path / "m"
    shutil.copytree(small_vocab_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    # An all-right drafter accepts tokens past the EOS within one step: they must be cut.
    llm = LLM(model, drafter="scripted", drafter_options={"mode": "all_right", "references": [PROMPT + free.token_ids], "max_budget": 8}, speculation="static")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]
    ignored = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"
    alloc = llm.engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


def test_max_tokens_is_exact_with_speculation(small_vocab_dir):
    free = LLM(small_vocab_dir).generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    llm = LLM(small_vocab_dir, drafter="scripted", drafter_options={"mode": "all_right", "references": [PROMPT + free.token_ids], "max_budget": 8}, speculation="static")
    for n in (1, 2, 7, 9, 10):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        assert out.token_ids == free.token_ids[:n] and out.finish_reason == "length"
