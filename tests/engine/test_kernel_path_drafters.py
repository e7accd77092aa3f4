"""Greedy speculative == plain greedy for EVERY drafter on the CPU kernel path (issue 13), under
hypothesis-chosen tree shapes, weight storage (float32, bfloat16), kernel threads (1, 2), batch sizes
and prefill chunking.

The kernels make a verify row compute exactly what plain decoding computes for the same token at the
same position (tests/compute_kernels/test_batch_invariance.py), so this holds bit for bit by construction,
whatever each drafter proposes — including its own forwards on the same kernels (draft model, EAGLE
heads, Medusa heads). The drafters' artifacts are random (acceptance is partial: accepted paths, KV
moves and rejected siblings all happen); the reference is plain decoding with the same storage.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scripted_drafter  # noqa: F401  (registers "scripted")
from adaptive_policy import IntermittentBudget, cutting_policy, install
import specserve.drafters.eagle  # noqa: F401  (registers "eagle")
import specserve.drafters.medusa  # noqa: F401  (registers "medusa")
from specserve import LLM, SamplingParams
from specserve.drafters.eagle_checkpoint import new_head_config, save_head
from specserve.drafters.eagle_head import EagleHead
from specserve.drafters.medusa_heads import MedusaHeads, save_heads
from specserve.kernels import set_threads
from specserve.kernels import threads as kernel_threads
from specserve.model import LlamaModel
from tiny_models import build_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7, 1, 7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
STORAGES = ("float32", "bfloat16")
DRAFTERS = ("scripted", "ngram", "draft", "eagle1", "eagle3", "medusa-static", "medusa-dynamic")
EAGLE3_IDS = [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 15]


def _randomise(module: torch.nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def _build_artifacts(target_dir, tmp_path_factory, draft_arch: str = "llama") -> dict:
    """Drafter paths for a 16-token, 64-wide target: a random draft model of `draft_arch`, random
    EAGLE-1/3 heads, random Medusa heads."""
    out = {"draft": build_model(tmp_path_factory.mktemp("draft"), draft_arch, vocab_size=16, tokenizer=False,
                                hidden_size=32, layers=1, heads=2, kv_heads=1, seed=3, init_std=0.3)}
    target = LlamaModel.from_pretrained(target_dir, torch.device("cpu"), torch.float32)
    for mode in ("eagle1", "eagle3"):
        cfg = new_head_config(target_dir, mode, len(EAGLE3_IDS) if mode == "eagle3" else None)
        head = EagleHead(cfg, target.embed, target.lm_head)
        _randomise(head, 1, 0.1)
        if mode == "eagle3":
            head.draft_to_target.copy_(torch.tensor(EAGLE3_IDS))
        out[mode] = save_head(head, tmp_path_factory.mktemp(mode), torch.float32)
    medusa = MedusaHeads(64, 16, 3, 1, "own")
    _randomise(medusa, 2, 0.4)
    out["medusa"] = tmp_path_factory.mktemp("medusa")
    save_heads(medusa, out["medusa"], target_dir)
    return out


def _references(target_dir) -> dict[str, list[list[int]]]:
    """Plain greedy output of every prompt, per weight storage (bf16 weights give other logits)."""
    return {s: [o.token_ids for o in LLM(target_dir, device="cpu", dtype=s, drafter=None).generate(PROMPTS, GREEDY)]
            for s in STORAGES}


@pytest.fixture(scope="module")
def artifacts(small_vocab_dir, tmp_path_factory):
    return _build_artifacts(small_vocab_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def references(small_vocab_dir):
    return _references(small_vocab_dir)


@pytest.fixture
def restore_threads():
    saved, saved_torch = kernel_threads._threads, torch.get_num_threads()
    yield
    set_threads(saved)
    torch.set_num_threads(saved_torch)
    kernel_threads.apply_threads()


def _spec(drafter: str, artifacts, references, storage, depth, topk, max_budget):
    if drafter == "scripted":
        refs = [p + r for p, r in zip(PROMPTS, references[storage])]
        return "scripted", dict(mode="mixed", seed=depth * 7 + topk, references=refs, max_budget=max_budget)
    if drafter == "ngram":
        return "ngram", dict(max_ngram=1 + depth % 4, branching=topk, depth=depth, max_budget=max_budget)
    if drafter == "draft":
        return f"draft:{artifacts['draft']}", dict(depth=depth, topk=topk, width=topk, max_budget=max_budget)
    if drafter.startswith("eagle"):
        return f"eagle:{artifacts[drafter]}", dict(depth=depth, topk=topk, max_budget=max_budget)
    tree = drafter.split("-")[1]
    return f"medusa:{artifacts['medusa']}", dict(tree=tree, depth=min(depth, 3), max_budget=max_budget,
                                                  **({"topk": topk} if tree == "dynamic" else {}))


def _runs_on_kernels(llm: LLM, drafter: str) -> bool:
    d = llm.engine.drafter
    own = {"draft": lambda: d.model.kernels, "eagle1": lambda: d.head.kernels, "eagle3": lambda: d.head.kernels,
           "medusa-static": lambda: d.kernels, "medusa-dynamic": lambda: d.kernels}.get(drafter, lambda: True)
    return llm.model.kernels is not None and own() is not None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drafter=st.sampled_from(DRAFTERS), storage=st.sampled_from(STORAGES), threads=st.sampled_from([1, 2]),
       depth=st.integers(1, 4), topk=st.integers(1, 3), max_budget=st.integers(1, 12), batch=st.sampled_from([1, 2, 4]),
       max_prefill_tokens=st.sampled_from([3, 256]), policy=st.sampled_from(["static", "cutting", "intermittent"]),
       seed=st.integers(0, 2**31 - 1))
def test_every_drafter_is_lossless_greedy_on_the_kernel_path(small_vocab_dir, artifacts, references, restore_threads,
                                                            drafter, storage, threads, depth, topk, max_budget, batch,
                                                            max_prefill_tokens, policy, seed):
    """policy: static (whole trees every step), cutting (the adaptive policy cuts trees), intermittent
    (requests drop to budget 0 and resume at random: target features queue up between drafts)."""
    threads = min(threads, kernel_threads.max_threads())
    spec, options = _spec(drafter, artifacts, references, storage, depth, topk, max_budget)
    llm = LLM(small_vocab_dir, drafter=spec, drafter_options=options, device="cpu", dtype=storage, threads=threads,
              max_prefill_tokens=max_prefill_tokens, speculation="static")
    if policy == "cutting":
        install(llm, cutting_policy(llm.engine.drafter.max_budget, depth, row_cost=0.2, batch=batch))
    elif policy == "intermittent":
        install(llm, IntermittentBudget(llm.engine.drafter.max_budget, depth, seed))
    assert _runs_on_kernels(llm, drafter)
    outs = llm.generate(PROMPTS[:batch], GREEDY)
    assert [o.token_ids for o in outs] == references[storage][:batch], (drafter, storage, threads, options)
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_gets_drafts_accepted(small_vocab_dir, artifacts, references, drafter):
    # The equality above means something only if drafts are accepted: each drafter, default-ish shape.
    spec, options = _spec(drafter, artifacts, references, "float32", 3, 2, 8)
    llm = LLM(small_vocab_dir, drafter=spec, drafter_options=options, device="cpu", speculation="static")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == references["float32"]
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0


# ---- a Qwen3 target ---------------------------------------------------------------------------------

QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A 16-token Qwen3 target: per-head q/k norms before rotary, head_dim 32 (hidden / heads is 16), YaRN."""
    return build_model(tmp_path_factory.mktemp("qwen3"), "qwen3", vocab_size=16, tokenizer=False, init_std=0.3,
                       head_dim=32, max_positions=64, rope_scaling=QWEN3_YARN)


@pytest.fixture(scope="module")
def qwen3_artifacts(qwen3_dir, tmp_path_factory):
    # The draft model is a Qwen3 too (its own q/k norms); EAGLE heads are Llama-style layers shaped
    # like the target's (head_dim 32, YaRN), as public EAGLE-3 heads for Qwen3 are.
    return _build_artifacts(qwen3_dir, tmp_path_factory, draft_arch="qwen3")


@pytest.fixture(scope="module")
def qwen3_references(qwen3_dir):
    return _references(qwen3_dir)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_is_lossless_greedy_with_a_qwen3_target(qwen3_dir, qwen3_artifacts, qwen3_references, drafter,
                                                              storage):
    spec, options = _spec(drafter, qwen3_artifacts, qwen3_references, storage, 3, 2, 8)
    llm = LLM(qwen3_dir, drafter=spec, drafter_options=options, device="cpu", dtype=storage, max_prefill_tokens=5,
              speculation="static")
    assert _runs_on_kernels(llm, drafter)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == qwen3_references[storage]
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0  # the equality is not vacuous
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_blocks
