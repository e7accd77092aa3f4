"""The ``draft`` drafter: lossless like every drafter (greedy equality, sampled distribution), tree
structure and draft probabilities, budgets, options, KV growth and release.

Draft models here are random-weight Llamas sharing the target's vocabulary (fast); the trained
draft model is exercised end to end in tests/training.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specserve.drafters import DraftRequest, TargetInfo, create_drafter
from specserve.drafters.draft_model import DraftModelDrafter
from standalone_kv import ensure_kv
from tiny_models import build_model
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target
from specserve.model import LlamaModel

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
SHAPES = {
    "chain": dict(depth=4),
    "topk-tree": dict(depth=3, topk=3),
    "wide-tree": dict(depth=4, topk=2, width=2),
    "capped-tree": dict(depth=5, topk=2, width=3, max_budget=7),
}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A 1-layer random Llama over the 16-token vocabulary of `small_vocab_dir` (a different model: q != p)."""
    return build_model(tmp_path_factory.mktemp("draft16"), "llama", vocab_size=16, tokenizer=False, hidden_size=32,
                       layers=1, heads=2, kv_heads=1, seed=3, init_std=0.3)


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    outs = LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs]


def target_info(model_dir, vocab=16) -> TargetInfo:
    return TargetInfo(vocab_size=vocab, hidden_size=64, num_layers=2, device=torch.device("cpu"), dtype=torch.float32,
                      model_dir=str(model_dir))


# ---- losslessness: greedy ----------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_equals_plain(small_vocab_dir, draft_dir, reference, shape, batch):
    llm = LLM(small_vocab_dir, drafter=f"draft:{draft_dir}", drafter_options=SHAPES[shape], device="cpu", speculation="static")
    outs = llm.generate(PROMPTS[:batch], GREEDY)
    for ref, out in zip(reference, outs):
        assert out.token_ids == ref
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0  # the drafts were used
    alloc = llm.engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks
    drafter = llm.engine.drafter
    assert not drafter._state and drafter.cache.allocator is alloc  # the drafter's KV shares the engine's blocks


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(1, 5), topk=st.integers(1, 3), width=st.integers(1, 3), max_budget=st.integers(1, 20),
       batch=st.sampled_from([1, 2, 4]), temperature=st.sampled_from([0.0, 0.0, 0.9]))
def test_any_tree_shape_is_lossless_greedy_and_well_formed(small_vocab_dir, draft_dir, reference, depth, topk, width,
                                                          max_budget, batch, temperature):
    options = dict(depth=depth, topk=topk, width=width, max_budget=max_budget)
    llm = LLM(small_vocab_dir, drafter=f"draft:{draft_dir}", drafter_options=options, device="cpu", speculation="static")
    if temperature == 0.0:
        outs = llm.generate(PROMPTS[:batch], GREEDY)
        assert [o.token_ids for o in outs] == reference[:batch]
    drafter = llm.engine.drafter
    contexts = [p + r[:5] for p, r in zip(PROMPTS[:batch], reference)]
    for tree, budget in zip(_propose(drafter, contexts, [max_budget] * batch, temperature), [max_budget] * batch):
        assert tree.num_nodes <= min(budget, drafter.max_budget)
        assert tree.max_depth <= depth
        for row in range(tree.num_nodes + 1):
            kids = tree.children(row)
            assert len(kids) <= topk and len({int(tree.tokens[k]) for k in kids}) == len(kids)
        assert (not tree.has_q) == (temperature == 0.0)


def test_greedy_equals_plain_with_text_prompts(llama_dir, tmp_path):
    draft = build_model(tmp_path / "draft", "llama", hidden_size=32, layers=1, heads=2, kv_heads=1, seed=5, init_std=0.2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = ["def f(x):\n    return x + 1\n" * 2, "class Point:", "for i in range(10):"]
    plain = LLM(llama_dir, device="cpu").generate(prompts, params)
    spec = LLM(llama_dir, drafter=f"draft:{draft}", drafter_options={"depth": 3, "topk": 2}, device="cpu", speculation="static")
    spec = spec.generate(prompts, params)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]


def test_self_draft_is_always_accepted(small_vocab_dir):
    """The target as its own draft: q == p, so greedy and T=1 chains are accepted in full."""
    for params in (GREEDY, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True, seed=4)):
        llm = LLM(small_vocab_dir, drafter=f"draft:{small_vocab_dir}", drafter_options={"depth": 4}, device="cpu", speculation="static")
        out = llm.generate([PROMPTS[0]], params)[0]
        assert out.spec.accepted_per_position == [6, 6, 6, 5]  # 29 tokens after prefill: 5 full steps, then 4
        assert out.spec.num_steps == 6


# ---- losslessness: sampling ----------------------------------------------------------------------

N = 1500
PROMPT = [3, 1, 4, 1, 5]
SAMPLING_CASES = {
    "chain-T1": (dict(depth=3), dict(temperature=1.0)),
    "topk-tree-T0.8-topk": (dict(depth=3, topk=3), dict(temperature=0.8, top_k=6)),
    "wide-tree-T1.2-topp-minp": (dict(depth=3, topk=2, width=2), dict(temperature=1.2, top_p=0.9, min_p=0.02)),
    "near-draft-fan-T0.7": (dict(depth=2, topk=4), dict(temperature=0.7)),  # q close to p: siblings matter
}


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampled_tokens_follow_target_distribution(small_vocab_dir, draft_dir, case, request):
    options, sampling = SAMPLING_CASES[case]
    draft = request.getfixturevalue("near_draft_dir") if case.startswith("near-draft") else draft_dir
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, **sampling) for seed in range(N)]
    llm = LLM(small_vocab_dir, drafter=f"draft:{draft}", drafter_options=options, device="cpu", max_num_seqs=N, speculation="static")
    outs = llm.generate([PROMPT] * N, params)
    assert_follows_target(outs, small_vocab_dir, PROMPT, params[0])
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > N // 20  # drafts were accepted


# ---- trees and draft probabilities ---------------------------------------------------------------


def _propose(drafter, contexts, budgets, temperature):
    requests = [DraftRequest(f"r{i}", np.asarray(c, dtype=np.int64), temperature) for i, c in enumerate(contexts)]
    ensure_kv(drafter, [r.request_id for r in requests])
    return drafter.propose(requests, budgets)


def test_tree_probs_are_what_each_node_was_drawn_from(small_vocab_dir, draft_dir):
    drafter = DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir), depth=3, topk=3, width=2)
    (tree,) = _propose(drafter, [PROMPT], [drafter.max_budget], temperature=0.7)
    assert tree.num_nodes == drafter.max_budget == 3 * (1 + 2 * 2)
    assert tree.has_q
    probs = tree.q_dense(16)
    torch.testing.assert_close(probs.sum(-1), torch.ones(tree.num_nodes))
    # Depth-1 siblings: the first is drawn from q = softmax(draft logits / T), later ones from q minus
    # the earlier siblings, renormalised.
    hf = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        q = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1] / 0.7, -1)
    roots = tree.children(0)
    assert len(roots) == 3
    for j, node in enumerate(roots):
        expected = q.clone()
        expected[tree.tokens[roots[:j]]] = 0
        torch.testing.assert_close(probs[node], expected / expected.sum(), atol=1e-5, rtol=1e-4)
    for row in range(tree.num_nodes + 1):  # siblings are distinct and each had positive probability
        kids = tree.children(row)
        assert len({int(tree.tokens[k]) for k in kids}) == len(kids)
        for k in kids:
            assert float(probs[k, tree.tokens[k]]) > 0
    assert tree.max_depth == 3


def test_greedy_trees_take_the_draft_top_k(small_vocab_dir, draft_dir):
    drafter = DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir), depth=2, topk=3)
    (tree,) = _propose(drafter, [PROMPT], [10], temperature=0.0)
    hf = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1]
    assert not tree.has_q
    assert tree.tokens[tree.children(0)].tolist() == logits.topk(3).indices.tolist()
    best = tree.children(0)[0]
    with torch.no_grad():
        logits2 = hf(torch.tensor([PROMPT + [int(tree.tokens[best])]])).logits[0, -1]
    assert tree.tokens[tree.children(best + 1)].tolist() == logits2.topk(3).indices.tolist()


def test_mixed_greedy_and_sampled_requests_in_one_batch(small_vocab_dir, draft_dir):
    drafter = DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir), depth=3, topk=2)
    requests = [DraftRequest(f"m{i}", np.asarray(PROMPT, dtype=np.int64), t) for i, t in enumerate((0.0, 0.8, 0.0, 1.3))]
    ensure_kv(drafter, [r.request_id for r in requests])
    trees = drafter.propose(requests, [6, 6, 6, 6])
    assert [not t.has_q for t in trees] == [True, False, True, False]
    assert trees[0].tokens.tolist() == trees[2].tokens.tolist()  # greedy drafts are deterministic
    (alone,) = _propose(DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir), depth=3, topk=2), [PROMPT], [6], 0.0)
    assert alone.tokens.tolist() == trees[0].tokens.tolist()  # and independent of the batch


def test_budgets_cap_trees_to_their_best_nodes(small_vocab_dir, draft_dir):
    drafter = DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir), depth=4, topk=3)
    trees = _propose(drafter, [PROMPT, PROMPT[:2], PROMPT[:3], [5]], [0, 1, 4, 100], temperature=0.0)
    assert [t.num_nodes for t in trees] == [0, 1, 4, drafter.max_budget]
    assert trees[3].max_depth == 4 and drafter.max_budget == 12
    # A budget keeps the most probable nodes (cumulative draft log-probability): the same request with
    # a bigger budget keeps a superset of its smaller tree's token paths.
    small, big = _propose(drafter, [PROMPT[:3]], [3], 0.0)[0], _propose(drafter, [PROMPT[:3]], [6], 0.0)[0]
    paths = lambda t: {tuple(t.tokens[t.path_to(n)].tolist()) for n in range(t.num_nodes)}  # noqa: E731
    assert paths(small) < paths(big)


def test_requests_past_the_draft_models_trained_length_get_whole_trees(small_vocab_dir, draft_dir):
    """max_position_embeddings is how long the draft model was trained, not a limit: its rotary table
    grows, and whether such drafts pay is the adaptive policy's call, not a silent cut-off."""
    drafter = DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir), depth=4)
    long_context = [1] * (drafter.model.config.max_position_embeddings + 8)
    trees = _propose(drafter, [long_context + [2], long_context, PROMPT], [4, 4, 4], temperature=0.0)
    assert [t.num_nodes for t in trees] == [4, 4, 4]


def test_incremental_catch_up_matches_fresh_drafts(small_vocab_dir, draft_dir):
    """A drafter that has cached a request's prefix drafts what a fresh drafter drafts for the full context."""
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    warm = DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir), depth=3, topk=2, width=2)
    for end in (4, 5, 9, len(context)):  # grows like a request: accepted tokens + a new root each step
        (tree,) = _propose(warm, [context[:end]], [8], temperature=0.0)
    cold = DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir), depth=3, topk=2, width=2)
    (fresh,) = _propose(cold, [context], [8], temperature=0.0)
    assert tree.tokens.tolist() == fresh.tokens.tolist() and tree.parents.tolist() == fresh.parents.tolist()


# ---- KV, options, registry -----------------------------------------------------------------------


def test_release_drops_state(small_vocab_dir, draft_dir):
    drafter = DraftModelDrafter(target_info(small_vocab_dir), str(draft_dir))
    _propose(drafter, [PROMPT, PROMPT], [4, 4], temperature=0.5)
    assert set(drafter._state) == {"r0", "r1"}
    drafter.release("r0")
    drafter.release("r1")
    drafter.release("never-seen")
    assert not drafter._state


@pytest.mark.parametrize(
    "options, message",
    [
        ({"depth": 0}, "depth"),
        ({"depth": 65}, "depth"),
        ({"topk": 0}, "topk"),
        ({"width": -1}, "width"),
        ({"max_budget": 0}, "max_budget"),
        ({"depth": "3"}, "depth"),
        ({"topk": True}, "topk"),
        ({"branching": 2}, "unknown option"),
    ],
)
def test_bad_options(small_vocab_dir, draft_dir, options, message):
    with pytest.raises(ValueError, match=message):
        create_drafter(f"draft:{draft_dir}", target_info(small_vocab_dir), options)


def test_bad_paths_and_mismatched_models(small_vocab_dir, draft_dir, llama_dir, tmp_path):
    with pytest.raises(ValueError, match="needs a model directory"):
        create_drafter("draft", target_info(small_vocab_dir))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_drafter(f"draft:{tmp_path / 'nope'}", target_info(small_vocab_dir))
    with pytest.raises(ValueError, match="vocab_size 16 but the target has"):
        LLM(llama_dir, drafter=f"draft:{draft_dir}", device="cpu", speculation="static")
    other = build_model(tmp_path / "other", "llama", hidden_size=32, layers=1, heads=2, kv_heads=1)
    tok = (other / "tokenizer.json").read_text().replace('"def"', '"dEf"')
    (other / "tokenizer.json").write_text(tok)
    with pytest.raises(ValueError, match="different tokenizer"):
        LLM(llama_dir, drafter=f"draft:{other}", device="cpu", speculation="static")


def test_max_budget_is_capped_at_the_full_tree(small_vocab_dir, draft_dir):
    drafter = create_drafter(f"draft:{draft_dir}", target_info(small_vocab_dir), {"depth": 2, "topk": 2, "max_budget": 100})
    assert drafter.max_budget == 4 and drafter.gives_probs


def test_seeded_sampling_reproduces_across_calls(small_vocab_dir, draft_dir):
    """The engine hands the request's seed to the drafter, so one LLM instance reproduces seeded runs."""
    llm = LLM(small_vocab_dir, drafter=f"draft:{draft_dir}", drafter_options={"depth": 3, "topk": 2}, speculation="static")
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=77, ignore_eos=True)
    first = llm.generate([[3, 1, 4, 1, 5]], params)[0]
    again = llm.generate([[3, 1, 4, 1, 5]], params)[0]
    assert first.token_ids == again.token_ids


# ---- a draft vocabulary (drafters/draft_vocab.py) --------------------------------------------------

# 9 of the 16 tokens: the draft scores only these, so targets' tokens outside it are never drafted.
DRAFT_IDS = [0, 2, 3, 5, 7, 8, 11, 13, 14]


@pytest.fixture(scope="module")
def small_draft_dir(draft_dir, tmp_path_factory):
    """`draft_dir`'s model with a 9-token draft vocabulary beside it."""
    import shutil

    from specserve.drafters.draft_vocab import save_draft_vocab

    out = tmp_path_factory.mktemp("draft9") / "model"
    shutil.copytree(draft_dir, out)
    save_draft_vocab(out, torch.tensor(DRAFT_IDS))
    return out


def _restricted_draft_logits(draft_dir, context):
    """transformers' draft logits after `context`, restricted to DRAFT_IDS: float32[9]."""
    hf = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([context])).logits[0, -1, DRAFT_IDS]


@pytest.mark.parametrize("shape", ["chain", "topk-tree", "wide-tree"])
def test_a_draft_vocabulary_stays_lossless_greedy(small_vocab_dir, small_draft_dir, reference, shape):
    llm = LLM(small_vocab_dir, drafter=f"draft:{small_draft_dir}", drafter_options=SHAPES[shape], device="cpu",
              speculation="static")
    assert llm.engine.drafter.vocab == len(DRAFT_IDS)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0


def test_a_draft_vocabulary_drafts_its_tokens_by_the_restricted_distribution(small_vocab_dir, draft_dir, small_draft_dir):
    info = target_info(small_vocab_dir)
    greedy = DraftModelDrafter(info, str(small_draft_dir), depth=1, topk=3)
    (tree,) = _propose(greedy, [PROMPT], [3], temperature=0.0)
    logits = _restricted_draft_logits(draft_dir, PROMPT)
    assert tree.tokens.tolist() == [DRAFT_IDS[i] for i in logits.topk(3).indices.tolist()]
    sampled = DraftModelDrafter(info, str(small_draft_dir), depth=1, topk=1)
    (tree,) = _propose(sampled, [PROMPT], [1], temperature=0.8)
    q = torch.zeros(16)
    q[DRAFT_IDS] = torch.softmax(logits / 0.8, -1)  # the draft's q: zero outside its vocabulary
    assert int(tree.tokens[0]) in DRAFT_IDS
    torch.testing.assert_close(tree.q_dense(16)[0], q, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["chain-T1", "topk-tree-T0.8-topk"])
def test_a_draft_vocabulary_samples_the_target_distribution(small_vocab_dir, small_draft_dir, case):
    options, sampling = SAMPLING_CASES[case]
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, **sampling) for seed in range(N)]
    llm = LLM(small_vocab_dir, drafter=f"draft:{small_draft_dir}", drafter_options=options, device="cpu", max_num_seqs=N,
              speculation="static")
    outs = llm.generate([PROMPT] * N, params)
    assert_follows_target(outs, small_vocab_dir, PROMPT, params[0])
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > N // 20


@pytest.mark.parametrize("kernels", [True, False])
def test_restricted_lm_head_gives_the_full_heads_columns(draft_dir, kernels):
    from specserve.kv_cache import BlockAllocator
    from specserve.step_batch import StepBatchBuilder

    def logits(model):
        allocator = BlockAllocator(4, 4)
        allocator.allocate("s", len(PROMPT))
        builder = StepBatchBuilder(allocator)
        builder.add("s", 0, np.asarray(PROMPT), logits="all")
        return model.forward(builder.build(), model.new_cache(allocator)).logits

    full = LlamaModel.from_pretrained(draft_dir, torch.device("cpu"), torch.float32, cpu_kernels=kernels)
    small = LlamaModel.from_pretrained(draft_dir, torch.device("cpu"), torch.float32, cpu_kernels=kernels)
    small.restrict_lm_head(torch.tensor(DRAFT_IDS))
    assert (small.kernels is not None) == kernels and small.embed.shape[0] == 16
    torch.testing.assert_close(logits(small), logits(full)[:, DRAFT_IDS], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([1, 2, 2]), "distinct"),
    (torch.tensor([0, 16]), r"\[0, 16\)"),
    (torch.tensor([1.0, 2.0]), "int64"),
    (torch.zeros(0, dtype=torch.int64), "non-empty"),
])
def test_a_bad_draft_vocabulary_is_a_clear_error(small_vocab_dir, draft_dir, tmp_path, ids, message):
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "bad"
    shutil.copytree(draft_dir, out)
    save_file({"draft_to_target": ids}, str(out / "draft_vocab.safetensors"))
    with pytest.raises(ValueError, match=message) as info:
        DraftModelDrafter(target_info(small_vocab_dir), str(out))
    assert "draft_vocab.safetensors" in str(info.value)
    (out / "draft_vocab.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        DraftModelDrafter(target_info(small_vocab_dir), str(out))
