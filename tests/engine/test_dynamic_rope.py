"""Dynamic NTK rope ("dynamic"): matches transformers below and above the original context, runs past it.

transformers rescales the rotary base from the longest position of each forward. Decoding one token at
a time — what its `generate` does after a prompt — rotates position p with the base of length p + 1,
which is the rule specserve uses for every forward (chunked prefill and draft trees included, so
speculation stays lossless). The references below are therefore transformers' full forward while the
sequence is within the original context, and transformers' token-by-token decoding past it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specserve import LLM, SamplingParams
from specserve.config import load_config
from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel
from specserve.rope import RotaryTable
from specserve.step_batch import StepBatchBuilder
from tiny_models import build_model

ORIGINAL = 32  # max_position_embeddings: the original context
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}


@pytest.fixture(scope="module")
def dynamic_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("dynamic"), "llama", init_std=0.2, tokenizer=False, vocab_size=97,
                       max_positions=ORIGINAL, rope_scaling=DYNAMIC, rope_theta=10000.0)


def _forward_all(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Our logits for every position of ``ids`` [len, vocab], fed ``chunk`` tokens per forward."""
    allocator = BlockAllocator(64, 8)
    allocator.allocate("s", len(ids))
    cache = model.new_cache(allocator)
    rows = []
    for start in range(0, len(ids), chunk):
        builder = StepBatchBuilder(allocator)
        builder.add("s", start, np.asarray(ids[start:start + chunk], dtype=np.int64), logits="all")
        rows.append(model.forward(builder.build(), cache).logits)
    return torch.cat(rows)


def _hf_token_by_token(hf, ids: list[int], prompt: int) -> torch.Tensor:
    """transformers: one forward over the first ``prompt`` tokens, then one token at a time with its cache."""
    with torch.no_grad():
        out = hf(torch.tensor([ids[:prompt]]), use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for t in range(prompt, len(ids)):
            out = hf(torch.tensor([[ids[t]]]), past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(rows)


def test_tables_are_transformers_frequencies_per_position(dynamic_dir):
    cfg = load_config(dynamic_dir)
    table = RotaryTable(cfg, torch.device("cpu"), torch.float32)
    table.cover(3 * ORIGINAL)
    for p in (0, ORIGINAL - 1, ORIGINAL, ORIGINAL + 5, 3 * ORIGINAL - 1):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg.hf_config, torch.device("cpu"), seq_len=torch.tensor(p + 1))
        torch.testing.assert_close(table.cos[p, : inv_freq.numel()], torch.cos(p * inv_freq), atol=1e-6, rtol=1e-6)


def test_the_kernels_numpy_tables_follow_the_tables_as_they_grow(dynamic_dir):
    """`arrays_for_batch` (what the compiled kernels read) hands out views of the same tables, made again when
    a batch reaches past them: a position's rotation never depends on when its table was made."""
    table = RotaryTable(load_config(dynamic_dir), torch.device("cpu"), torch.float32)
    first = table.num_positions
    cos, sin = table.arrays_for_batch(10)
    assert table.arrays_for_batch(first)[0] is cos  # covered already: the same views, nothing made
    np.testing.assert_array_equal(cos, table.cos.numpy())
    np.testing.assert_array_equal(sin, table.sin.numpy())
    grown_cos, grown_sin = table.arrays_for_batch(first + 1)
    assert grown_cos.shape[0] == table.num_positions > first
    np.testing.assert_array_equal(grown_cos, table.cos.numpy())
    np.testing.assert_array_equal(grown_sin, table.sin.numpy())
    np.testing.assert_array_equal(grown_cos[:first], cos)  # the positions already made are unchanged
    fresh = RotaryTable(load_config(dynamic_dir), torch.device("cpu"), torch.float32)
    fresh.cover(table.num_positions)  # made in one go: the same values as grown
    np.testing.assert_array_equal(fresh.cos.numpy(), grown_cos)


@pytest.mark.parametrize("executor", ["kernels", "torch"])
def test_logits_match_transformers_below_and_above_the_original_context(dynamic_dir, executor):
    hf = AutoModelForCausalLM.from_pretrained(str(dynamic_dir), dtype=torch.float32).eval()
    ours = LlamaModel.from_pretrained(dynamic_dir, torch.device("cpu"), torch.float32, cpu_kernels=executor == "kernels")
    ids = torch.randint(0, 97, (3 * ORIGINAL,), generator=torch.Generator().manual_seed(0)).tolist()
    below = ids[: ORIGINAL - 4]
    with torch.no_grad():
        ref_below = hf(torch.tensor([below])).logits[0]
    torch.testing.assert_close(_forward_all(ours, below, 64), ref_below, atol=2e-4, rtol=1e-4)
    ref = _hf_token_by_token(hf, ids, ORIGINAL - 4)
    for chunk in (len(ids), 7, 1):  # prefill at once, chunked, token by token: the same rotation
        torch.testing.assert_close(_forward_all(ours, ids, chunk), ref, atol=2e-4, rtol=1e-4)


def test_runs_past_the_original_context_and_speculation_stays_lossless(dynamic_dir):
    prompt = [5, 6, 7, 8, 9, 10] * 8  # 48 tokens, past the original 32 from the start
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain = LLM(dynamic_dir, device="cpu", drafter=None)
    assert plain.engine.config.max_model_len == ORIGINAL * 4  # the context its factor was chosen for
    spec = LLM(dynamic_dir, device="cpu", drafter="ngram", speculation="static")
    a = plain.generate([prompt], params)[0]
    b = spec.generate([prompt], params)[0]
    assert len(a.token_ids) == 60 and a.token_ids == b.token_ids
    assert b.spec.num_drafted > 0
    hf = AutoModelForCausalLM.from_pretrained(str(dynamic_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt[:ORIGINAL]]), max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert ref.shape[1] == ORIGINAL + 1  # transformers itself runs it; our reference is its token-by-token rule
    long = LLM(dynamic_dir, device="cpu", drafter=None, max_model_len=ORIGINAL * 16)
    assert len(long.generate([prompt], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))[0].token_ids) == 300


def test_fixed_rope_targets_still_refuse_contexts_past_their_positions(tmp_path):
    model_dir = build_model(tmp_path / "m", "llama", tokenizer=False, vocab_size=64, max_positions=ORIGINAL)
    with pytest.raises(ValueError, match="max_model_len must be in"):
        LLM(model_dir, device="cpu", drafter=None, max_model_len=ORIGINAL + 1)
