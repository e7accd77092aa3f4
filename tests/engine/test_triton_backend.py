"""Whole models and the engine on the ``triton`` attention backend (Triton's interpreter without CUDA).

- Forwards on random StepBatches of every kind match the sdpa backend's (atol/rtol 1e-4 on logits and
  written K/V: the CPU kernels' tolerance against the torch layers, test_attention_kernel.py), with GQA,
  biases, Qwen3's q/k norms and sliding windows.
- End to end: greedy speculative output equals plain greedy output with the target, a draft model and an
  EAGLE-3 head all on the triton backend (the drafters take the target's backend), and equals the sdpa
  backend's output.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import scripted_drafter  # noqa: F401  (registers "scripted")
from random_step_batches import random_batch
from specserve import LLM, SamplingParams
from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MODELS = {  # arch, build_model keyword arguments
    "llama-gqa2-bias": ("llama", dict(hidden_size=64, heads=4, kv_heads=2, attention_bias=True)),
    "mistral-window5": ("mistral", dict(hidden_size=64, heads=4, kv_heads=2, sliding_window=5)),
    "qwen3-qk-norm": ("qwen3", dict(hidden_size=64, heads=4, kv_heads=2, head_dim=32)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_triton_forward_matches_sdpa_on_random_step_batches(name, tmp_path):
    from tiny_models import build_model

    arch, extra = MODELS[name]
    path = build_model(tmp_path, arch, vocab_size=61, tokenizer=False, init_std=0.2, layers=2, **extra)
    models = [LlamaModel.from_pretrained(path, torch.device(DEVICE), torch.float32, attention=a, cpu_kernels=False)
              for a in ("triton", "sdpa")]
    for seed in range(2):
        rng = np.random.default_rng(200 + seed)
        allocator = BlockAllocator(96 // 4 * 6, 4)
        batch = random_batch(rng, allocator, 6)
        batch = dataclasses.replace(batch, logit_rows=np.arange(batch.num_tokens, dtype=np.int64))
        caches = [m.new_cache(allocator) for m in models]
        gen = torch.Generator().manual_seed(seed)
        for part in ("k", "v"):
            values = torch.randn(getattr(caches[0], part).shape, generator=gen)
            for cache in caches:
                getattr(cache, part).copy_(values)
        out = [m.forward(batch, c).logits for m, c in zip(models, caches)]
        torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=1e-4, msg=lambda m: f"{name} seed={seed}: {m}")
        slots = torch.from_numpy(batch.slot_mapping).to(DEVICE)
        for part in ("k", "v"):
            torch.testing.assert_close(getattr(caches[0], part)[:, slots], getattr(caches[1], part)[:, slots],
                                       atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def sdpa_reference(small_vocab_dir):
    llm = LLM(small_vocab_dir, device=DEVICE, attention="sdpa", drafter=None, dtype="float32")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_plain_decoding_on_triton_equals_sdpa(small_vocab_dir, sdpa_reference):
    llm = LLM(small_vocab_dir, device=DEVICE, attention="triton", drafter=None, dtype="float32")
    assert llm.model.backend.name == "triton" and llm.model.kernels is None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == sdpa_reference


def test_greedy_speculative_equals_plain_on_triton_with_scripted_trees(small_vocab_dir, sdpa_reference):
    refs = [p + r for p, r in zip(PROMPTS, sdpa_reference)]
    llm = LLM(small_vocab_dir, device=DEVICE, attention="triton", dtype="float32", speculation="static",
              drafter="scripted", drafter_options={"mode": "mixed", "references": refs, "max_budget": 8})
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == sdpa_reference
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0


def test_draft_model_and_eagle_head_run_on_the_targets_triton_backend(small_vocab_dir, near_draft_dir, sdpa_reference,
                                                                       tmp_path):
    from specserve.drafters.eagle_checkpoint import new_head_config, save_head
    from specserve.drafters.eagle_head import EagleHead

    target = LlamaModel.from_pretrained(small_vocab_dir, torch.device("cpu"), torch.float32, cpu_kernels=False)
    head = EagleHead(new_head_config(small_vocab_dir, "eagle3"), target.embed, target.lm_head)
    head_dir = save_head(head, tmp_path / "eagle3", torch.float32)
    # Half the reference's tokens (a greedy prefix of it): each drafter forward is a few interpreted Triton
    # launches, and 12 tokens already take every drafter through several draft-verify rounds.
    tokens = GREEDY.max_tokens // 2
    params = dataclasses.replace(GREEDY, max_tokens=tokens)
    for spec in (f"draft:{near_draft_dir}", f"eagle:{head_dir}"):
        llm = LLM(small_vocab_dir, device=DEVICE, attention="triton", dtype="float32", speculation="static", drafter=spec)
        drafter = llm.engine.drafter
        backend = drafter.model.backend if hasattr(drafter, "model") else drafter.head.backend
        assert backend.name == "triton", spec
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [r[:tokens] for r in sdpa_reference], spec
        assert all(o.spec.num_drafted > 0 for o in outs), spec
