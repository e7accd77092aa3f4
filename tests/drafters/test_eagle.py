"""The ``eagle`` drafter: lossless like every drafter (greedy equality, sampled distribution), drafting
equals the training-time unroll, the head's cache after partial acceptance, budgets and queued
features, checkpoint formats (ours and the public EAGLE-1/2/3 layouts), errors and options.

Heads here are random (so acceptance is partial) over tiny random targets; the trained head is
exercised end to end in tests/training/test_eagle_train.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target
from transformers import AutoModelForCausalLM

import specserve.drafters.eagle  # noqa: F401  (registers "eagle")
from specserve import LLM, SamplingParams
from specserve.kv_cache import BlockAllocator
from specserve.step_batch import StepBatchBuilder
from standalone_kv import ensure_kv
from specserve.drafters import DraftRequest, TargetInfo, create_drafter
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.eagle_checkpoint import load_head, new_head_config, save_head
from specserve.drafters.eagle_head import EagleHead
from specserve.model import LlamaModel

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
DRAFT_IDS = [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 15]  # the eagle3 heads' reduced vocabulary (12 of 16)
SHAPES = {
    "chain": dict(depth=4, topk=1),
    "tree": dict(depth=3, topk=2),
    "capped-tree": dict(depth=5, topk=3, max_budget=7),
}


def target_info(model_dir) -> TargetInfo:
    model = LlamaModel.from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    cfg = model.config
    return TargetInfo(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                      device=torch.device("cpu"), dtype=torch.float32, model_dir=str(model_dir), model=model)


def random_head(target_dir, mode: str, seed: int = 0, std: float = 0.3) -> EagleHead:
    model = LlamaModel.from_pretrained(target_dir, torch.device("cpu"), torch.float32)
    cfg = new_head_config(target_dir, mode, len(DRAFT_IDS) if mode == "eagle3" else None)
    head = EagleHead(cfg, model.embed, model.lm_head)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        if mode == "eagle3":
            head.draft_to_target.copy_(torch.tensor(DRAFT_IDS))
    return head


def fit(head: EagleHead, target_dir, steps: int = 40) -> EagleHead:
    """A few optimiser steps on the target's own samples (training/eagle.py's loss), so a random head
    agrees with the target some of the time: partial acceptance, rejected siblings, both exercised."""
    from types import SimpleNamespace

    from specserve.training.eagle import _Features, eagle_loss

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 16, (24, 4), generator=gen).tolist()
    outs = LLM(target_dir, device="cpu").generate(
        prompts, [SamplingParams(max_tokens=28, temperature=1.0, seed=i, ignore_eos=True) for i in range(24)])
    seqs = torch.tensor([p + o.token_ids for p, o in zip(prompts, outs)])
    data = SimpleNamespace(tokens=seqs, lengths=torch.full((len(seqs),), seqs.shape[1]))
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    features = _Features(hf, head.cfg.feature_layers, head.mode, head.draft_to_target)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for step in range(steps):
        loss = eagle_loss(head, features(data, torch.arange(8) + 8 * (step % 3), torch.device("cpu")), 2)[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
    return head


@pytest.fixture(scope="module")
def heads(small_vocab_dir, tmp_path_factory):
    """Our-format heads for the 16-token target (random, then fitted briefly): {"eagle1": DIR, "eagle3": DIR}."""
    out = {}
    for mode in ("eagle1", "eagle3"):
        head = fit(random_head(small_vocab_dir, mode, std=0.1), small_vocab_dir)
        out[mode] = save_head(head, tmp_path_factory.mktemp(mode), torch.float32)
    return out


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    return [o.token_ids for o in LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)]


def _features(model_dir, tokens: list[int], layers) -> dict[int, torch.Tensor]:
    """The target's features of ``tokens`` (transformers numbering), like the engine hands them over."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return {layer: hs[layer][0] for layer in layers}


def _propose(drafter, requests, budgets):
    ensure_kv(drafter, [r.request_id for r in requests])
    return drafter.propose(requests, budgets)


def _request(rid, tokens, model_dir, drafter, temperature=0.0, start=0):
    """A DraftRequest for context ``tokens`` (last = root) with the features of tokens start..len-2."""
    feats = _features(model_dir, tokens[:-1], drafter.hidden_layers)
    hidden = {layer: f[start:] for layer, f in feats.items()}
    return DraftRequest(rid, np.asarray(tokens, dtype=np.int64), temperature, hidden)


# ---- losslessness: greedy ----------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mode", ["eagle1", "eagle3"])
def test_greedy_equals_plain(small_vocab_dir, heads, reference, mode, shape, batch):
    llm = LLM(small_vocab_dir, drafter=f"eagle:{heads[mode]}", drafter_options=SHAPES[shape], device="cpu", speculation="static")
    outs = llm.generate(PROMPTS[:batch], GREEDY)
    assert [o.token_ids for o in outs] == reference[:batch]
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0  # the drafts were used
    drafter = llm.engine.drafter
    assert not drafter._state and drafter.cache.allocator is llm.engine.allocator  # the head's KV shares the engine's blocks


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["eagle1", "eagle3"]), depth=st.integers(1, 5), topk=st.integers(1, 3),
       max_budget=st.integers(1, 20), batch=st.sampled_from([1, 3]))
def test_any_tree_shape_is_lossless_greedy(small_vocab_dir, heads, reference, mode, depth, topk, max_budget, batch):
    options = dict(depth=depth, topk=topk, max_budget=max_budget)
    llm = LLM(small_vocab_dir, drafter=f"eagle:{heads[mode]}", drafter_options=options, device="cpu", speculation="static")
    outs = llm.generate(PROMPTS[:batch], GREEDY)
    assert [o.token_ids for o in outs] == reference[:batch]
    for o in outs:
        assert len(o.spec.drafted_per_position) <= depth


def test_greedy_equals_plain_with_text_prompts(llama_dir, tmp_path):
    head = save_head(random_head(llama_dir, "eagle3", seed=2, std=0.1), tmp_path / "h", torch.float32)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = ["def f(x):\n    return x + 1\n" * 2, "class Point:", "for i in range(10):"]
    plain = LLM(llama_dir, device="cpu").generate(prompts, params)
    spec = LLM(llama_dir, drafter=f"eagle:{head}", drafter_options={"depth": 3, "topk": 2}, device="cpu", speculation="static").generate(prompts, params)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]


# ---- losslessness: sampling ----------------------------------------------------------------------

N = 1500
PROMPT = [3, 1, 4, 1, 5]
SAMPLING_CASES = {
    "eagle3-tree-T0.8-topk": ("eagle3", dict(depth=3, topk=3, max_budget=8), dict(temperature=0.8, top_k=6)),
    "eagle1-chain-T1.2-topp": ("eagle1", dict(depth=3, topk=1), dict(temperature=1.2, top_p=0.9)),
}


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampled_tokens_follow_target_distribution(small_vocab_dir, heads, case):
    mode, options, sampling = SAMPLING_CASES[case]
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, **sampling) for seed in range(N)]
    llm = LLM(small_vocab_dir, drafter=f"eagle:{heads[mode]}", drafter_options=options, device="cpu", max_num_seqs=N, speculation="static")
    outs = llm.generate([PROMPT] * N, params)
    assert_follows_target(outs, small_vocab_dir, PROMPT, params[0])
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > N // 20  # drafts were accepted


# ---- drafting = the head's training-time unroll ----------------------------------------------------


@pytest.mark.parametrize("mode", ["eagle1", "eagle3"])
def test_chain_drafts_follow_the_training_unroll(small_vocab_dir, heads, mode):
    """A greedy chain's depth-d token is the argmax of `EagleHead.unroll` step d-1 at position root + d - 1,
    over the context extended by the chain: drafting and training-time test see the same thing."""
    drafter = EagleDrafter(target_info(small_vocab_dir), str(heads[mode]), depth=4, topk=1)
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    (tree,) = _propose(drafter, [_request("r", context, small_vocab_dir, drafter)], [4])
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    seq = context + tree.tokens.tolist()
    feats = _features(small_vocab_dir, seq, drafter.hidden_layers)
    head = drafter.head
    with torch.no_grad():
        step0 = head.fuse([feats[layer][None, :-1] for layer in head.cfg.feature_layers])
        outs = head.unroll(torch.tensor([seq[1:]]), step0, 4)
    root = len(context) - 2
    for d in range(4):
        logits = head.logits(outs[d][0, root + d : root + d + 1])
        assert int(head.draft_to_target[logits.argmax(-1)]) == int(tree.tokens[d])


@pytest.mark.parametrize("mode", ["eagle1", "eagle3"])
def test_tree_probs_are_exact_sibling_distributions(small_vocab_dir, heads, mode):
    drafter = EagleDrafter(target_info(small_vocab_dir), str(heads[mode]), depth=3, topk=3, max_budget=100)
    context = [3, 1, 4, 1, 5]
    (tree,) = _propose(drafter, [_request("r", context, small_vocab_dir, drafter, temperature=0.7)], [100])
    assert tree.has_q
    probs = tree.q_dense(16)
    torch.testing.assert_close(probs.sum(-1), torch.ones(tree.num_nodes))
    head = drafter.head
    feats = _features(small_vocab_dir, context[:-1], drafter.hidden_layers)
    with torch.no_grad():
        out = head.unroll(torch.tensor([context[1:]]), head.fuse([feats[l][None] for l in head.cfg.feature_layers]), 1)[0]
        q_draft = torch.softmax(head.logits(out[0, -1:])[0] / 0.7, -1)
    q = torch.zeros(16)
    q[head.draft_to_target] = q_draft
    roots = tree.children(0)
    assert len(roots) == 3
    for j, node in enumerate(roots):
        expected = q.clone()
        expected[tree.tokens[roots[:j]]] = 0
        torch.testing.assert_close(probs[node], expected / expected.sum(), atol=1e-5, rtol=1e-4)
    for row in range(tree.num_nodes + 1):  # siblings are distinct, drawable, and in the draft vocabulary
        kids = tree.children(row)
        assert len({int(tree.tokens[k]) for k in kids}) == len(kids)
        for k in kids:
            assert float(probs[k, tree.tokens[k]]) > 0
    if mode == "eagle3":
        assert set(tree.tokens.tolist()) <= set(DRAFT_IDS)


def test_sampled_tree_shape_does_not_depend_on_drawn_values(small_vocab_dir, heads):
    """Different seeds draw different tokens into the same tree shape (a value-independent cut)."""
    shapes, tokens = set(), set()
    for seed in range(6):
        drafter = EagleDrafter(target_info(small_vocab_dir), str(heads["eagle3"]), depth=4, topk=2, seed=seed)
        (tree,) = _propose(drafter, [_request("r", PROMPT, small_vocab_dir, drafter, temperature=1.0)], [9])
        shapes.add(tuple(tree.parents.tolist()))
        tokens.add(tuple(tree.tokens.tolist()))
    assert len(shapes) == 1 and len(tokens) > 1


# ---- the head's cache, budgets and queued features ------------------------------------------------


@pytest.mark.parametrize("mode", ["eagle1", "eagle3"])
def test_head_cache_holds_the_accepted_path_after_partial_acceptance(small_vocab_dir, heads, mode):
    llm = LLM(small_vocab_dir, drafter=f"eagle:{heads[mode]}", drafter_options=dict(depth=3, topk=2), device="cpu", speculation="static")
    engine, drafter = llm.engine, llm.engine.drafter
    req = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(7):
        engine.step()
    counts = req.stats.accepted_length_counts  # [a] = steps that accepted a of the tree's 3 levels
    assert sum(counts[1:]) > 0 and sum(counts[:3]) > 0  # some drafts accepted, some cut short
    state = drafter._state[req.request_id]
    n = state.num_cached
    assert n > len(PROMPTS[0])
    tokens = req.token_ids.tolist()
    k_got, v_got = drafter.cache.read(req.request_id, n)
    # From scratch: the true features of tokens 0..n-1, paired with tokens 1..n, through a fresh cache.
    head = drafter.head
    feats = _features(small_vocab_dir, tokens[:n], drafter.hidden_layers)
    allocator = BlockAllocator(64, 16)
    allocator.allocate("fresh", n)
    cache = head.new_cache(allocator)
    builder = StepBatchBuilder(allocator)
    builder.add("fresh", 0, np.asarray(tokens[1 : n + 1], dtype=np.int64))
    head(torch.tensor(tokens[1 : n + 1]), head.fuse([feats[l] for l in head.cfg.feature_layers]), builder.build(), cache)
    k_ref, v_ref = cache.read("fresh", n)
    torch.testing.assert_close(k_got, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_got, v_ref, atol=1e-4, rtol=1e-4)


def test_budget_zero_requests_keep_their_features(small_vocab_dir, heads):
    """Features handed over while a request's budget is 0 are queued and fed at its next draft: the
    tree then equals a fresh drafter's over the whole context."""
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    warm = EagleDrafter(target_info(small_vocab_dir), str(heads["eagle3"]), depth=3, topk=2)
    feats = _features(small_vocab_dir, context[:-1], warm.hidden_layers)
    previous = 0
    for end, budget in ((4, 6), (5, 0), (9, 0), (len(context), 6)):
        rows = {layer: f[previous : end - 1] for layer, f in feats.items()}
        req = DraftRequest("r", np.asarray(context[:end], dtype=np.int64), 0.0, rows)
        other = DraftRequest("o", np.asarray(PROMPT, dtype=np.int64), 0.0,
                             _features(small_vocab_dir, PROMPT[:-1], warm.hidden_layers) if end == 4 else None)
        (tree, _) = _propose(warm, [req, other], [budget, 3])
        previous = end - 1
        assert tree.num_nodes == budget
    cold = EagleDrafter(target_info(small_vocab_dir), str(heads["eagle3"]), depth=3, topk=2)
    (fresh,) = _propose(cold, [_request("r", context, small_vocab_dir, cold)], [6])
    assert tree.tokens.tolist() == fresh.tokens.tolist() and tree.parents.tolist() == fresh.parents.tolist()


def test_budgets_cap_trees_and_batching_does_not_change_them(small_vocab_dir, heads):
    drafter = EagleDrafter(target_info(small_vocab_dir), str(heads["eagle1"]), depth=4, topk=3, max_budget=30)
    contexts = [PROMPT, PROMPT[:2], PROMPT[:3], [5, 2]]
    requests = [_request(f"b{i}", c, small_vocab_dir, drafter) for i, c in enumerate(contexts)]
    trees = _propose(drafter, requests, [0, 1, 4, 100])
    assert [t.num_nodes for t in trees] == [0, 1, 4, 30]
    for tree, ctx, budget in zip(trees[1:], contexts[1:], [1, 4, 100]):
        alone = EagleDrafter(target_info(small_vocab_dir), str(heads["eagle1"]), depth=4, topk=3, max_budget=30)
        (ref,) = _propose(alone, [_request("x", ctx, small_vocab_dir, alone)], [budget])
        assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()


@pytest.mark.parametrize("mode", ["eagle1", "eagle3"])
def test_requests_past_the_heads_trained_length_get_whole_trees(small_vocab_dir, heads, mode):
    """The head's max_position_embeddings is its training length, not a limit: its rotary table grows."""
    drafter = EagleDrafter(target_info(small_vocab_dir), str(heads[mode]), depth=4, topk=1)
    trained = drafter.head.mc.max_position_embeddings
    ctx = [1 + (i % 7) for i in range(trained + 40)]
    (tree,) = _propose(drafter, [_request("e", ctx, small_vocab_dir, drafter)], [4])
    assert tree.num_nodes == 4
    executor = drafter.head.kernels or drafter.head  # the compiled path keeps its own fp32 table
    assert executor.rope.num_positions >= len(ctx) + 2


def test_a_long_repetitive_context_is_drafted_past_the_heads_trained_length(tmp_path):
    """Issue 17: a published EAGLE-3 head for Llama-3 says 2048 positions; past them it used to stop
    drafting (tau 2.00 -> 1.04). The bundle's trained head, told it was trained on 64 positions, keeps
    drafting a 300-token repetitive prompt well past them — and stays lossless."""
    import shutil

    from specserve.bundle_paths import default_drafters, default_model_dir

    target, head_dir = default_model_dir(), default_drafters().get("eagle")
    if target is None or head_dir is None:
        pytest.skip("the embedded bundle is not installed")
    short = tmp_path / "eagle"
    shutil.copytree(head_dir, short)
    config = json.loads((short / "eagle_config.json").read_text())
    config["layer"]["max_position_embeddings"] = 64
    (short / "eagle_config.json").write_text(json.dumps(config))
    prompt = "def add(a, b):\n    return a + b\n\n" * 20
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    spec = LLM(target, drafter=f"eagle:{short}", speculation="static").generate([prompt], params)[0]
    plain = LLM(target, drafter=None).generate([prompt], params)[0]
    assert len(spec.prompt_token_ids) > 64 + 100
    assert spec.token_ids == plain.token_ids
    assert spec.spec.mean_accepted_length > 1.5


def test_release_drops_state(small_vocab_dir, heads):
    drafter = EagleDrafter(target_info(small_vocab_dir), str(heads["eagle3"]))
    _propose(drafter, [_request("a", PROMPT, small_vocab_dir, drafter, 0.5), _request("b", PROMPT, small_vocab_dir, drafter)], [4, 4])
    assert set(drafter._state) == {"a", "b"}
    for rid in ("a", "b", "never-seen"):
        drafter.release(rid)
    assert not drafter._state


def test_missing_features_are_an_engine_contract_error(small_vocab_dir, heads):
    drafter = EagleDrafter(target_info(small_vocab_dir), str(heads["eagle1"]))
    with pytest.raises(RuntimeError, match="features"):
        _propose(drafter, [DraftRequest("r", np.asarray(PROMPT, dtype=np.int64), 0.0, None)], [4])


# ---- checkpoint formats ------------------------------------------------------------------------------


def _proposals(head_dir, target_dir, temperature=0.0, **options):
    drafter = EagleDrafter(target_info(target_dir), str(head_dir), **options)
    reqs = [_request(f"p{i}", c, target_dir, drafter, temperature) for i, c in enumerate((PROMPT, PROMPTS[2]))]
    return [(t.tokens.tolist(), t.parents.tolist(), t.q_dense(16)) for t in _propose(drafter, reqs, [9, 9])]


def _same(a, b):
    for (ta, pa, qa), (tb, pb, qb) in zip(a, b):
        assert ta == tb and pa == pb
        if qa is not None:
            torch.testing.assert_close(qa, qb)


def _public_layer(head: EagleHead, prefix: str) -> dict:
    layer = head.layer
    q, k, v = layer.qkv.detach().split([layer.q_size, layer.kv_size, layer.kv_size])
    gate, up = layer.gate_up.detach().chunk(2)
    return {f"{prefix}self_attn.q_proj.weight": q, f"{prefix}self_attn.k_proj.weight": k,
            f"{prefix}self_attn.v_proj.weight": v, f"{prefix}self_attn.o_proj.weight": layer.o_proj.detach(),
            f"{prefix}post_attention_layernorm.weight": layer.post_attn_norm.detach(),
            f"{prefix}mlp.gate_proj.weight": gate, f"{prefix}mlp.up_proj.weight": up,
            f"{prefix}mlp.down_proj.weight": layer.down.detach()}


def _public_config(target_dir, **extra) -> dict:
    cfg = json.loads((target_dir / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "rope_theta", "rope_parameters", "vocab_size")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
            **{k: cfg[k] for k in keep if k in cfg}, **extra}


def test_our_format_round_trips(small_vocab_dir, heads, tmp_path):
    for mode in ("eagle1", "eagle3"):
        loaded = load_head(heads[mode], target_info(small_vocab_dir))
        again = save_head(loaded, tmp_path / mode, torch.float32)
        _same(_proposals(heads[mode], small_vocab_dir), _proposals(again, small_vocab_dir))
        _same(_proposals(heads[mode], small_vocab_dir, 0.9, seed=3), _proposals(again, small_vocab_dir, 0.9, seed=3))


def test_public_eagle1_layout_loads(small_vocab_dir, heads, tmp_path):
    head = load_head(heads["eagle1"], target_info(small_vocab_dir))
    state = {"fc.weight": head.fc.detach(), "fc.bias": head.fc_bias.detach(), **_public_layer(head, "layers.0."),
             "embed_tokens.weight": head.embed.clone()}
    out = tmp_path / "eagle1-public"
    out.mkdir()
    torch.save({k: v.clone() for k, v in state.items()}, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(_public_config(small_vocab_dir, bias=True)))
    _same(_proposals(heads["eagle1"], small_vocab_dir), _proposals(out, small_vocab_dir))


def test_public_eagle3_layout_loads(small_vocab_dir, heads, tmp_path):
    head = load_head(heads["eagle3"], target_info(small_vocab_dir))
    d2t = head.draft_to_target - torch.arange(len(DRAFT_IDS))  # EAGLE-3 stores target id minus draft id
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[head.draft_to_target] = True
    state = {"fc.weight": head.fc.detach(), "midlayer.input_layernorm.weight": head.input_norm.detach(),
             "midlayer.hidden_norm.weight": head.hidden_norm.detach(), **_public_layer(head, "midlayer."),
             "norm.weight": head.norm.detach(), "lm_head.weight": head.lm_head.detach(), "d2t": d2t, "t2d": t2d}
    out = tmp_path / "eagle3-public"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(_public_config(small_vocab_dir, draft_vocab_size=len(DRAFT_IDS))))
    _same(_proposals(heads["eagle3"], small_vocab_dir), _proposals(out, small_vocab_dir))
    _same(_proposals(heads["eagle3"], small_vocab_dir, 0.8), _proposals(out, small_vocab_dir, 0.8))
    bad = dict(state, t2d=torch.ones(16, dtype=torch.bool))
    save_file({k: v.contiguous() for k, v in bad.items()}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="t2d"):
        load_head(out, target_info(small_vocab_dir))


# ---- errors and options ----------------------------------------------------------------------------


def test_head_for_another_target_is_refused(small_vocab_dir, llama_dir, heads, tmp_path):
    with pytest.raises(ValueError, match="another target.*vocabulary 16"):
        LLM(llama_dir, drafter=f"eagle:{heads['eagle1']}", device="cpu", speculation="static")
    other = tmp_path / "other"
    other.mkdir()
    for name in ("eagle_head.safetensors",):
        (other / name).write_bytes((heads["eagle3"] / name).read_bytes())
    config = json.loads((heads["eagle3"] / "eagle_config.json").read_text())
    config["target"]["config_sha256"] = "0" * 64
    (other / "eagle_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="another target.*config_sha256"):
        load_head(other, target_info(small_vocab_dir))


def test_missing_and_corrupt_files_are_clear_errors(small_vocab_dir, heads, tmp_path):
    info = target_info(small_vocab_dir)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_head(tmp_path / "nope", info)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no EAGLE head"):
        load_head(tmp_path / "empty", info)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "eagle_config.json").write_text((heads["eagle1"] / "eagle_config.json").read_text())
    with pytest.raises(FileNotFoundError, match="weights are missing"):
        load_head(broken, info)
    data = (heads["eagle1"] / "eagle_head.safetensors").read_bytes()
    (broken / "eagle_head.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_head(broken, info)
    (broken / "eagle_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_head(broken, info)
    public = tmp_path / "public"
    public.mkdir()
    (public / "config.json").write_text(json.dumps(_public_config(small_vocab_dir)))
    with pytest.raises(FileNotFoundError, match="no EAGLE weights"):
        load_head(public, info)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"depth": 0}, "depth"),
        ({"depth": 33}, "depth"),
        ({"topk": 0}, "topk"),
        ({"topk": 17}, "topk"),
        ({"max_budget": 0}, "max_budget"),
        ({"depth": "3"}, "depth"),
        ({"topk": True}, "topk"),
        ({"width": 2}, "unknown option"),
    ],
)
def test_bad_options(small_vocab_dir, heads, options, message):
    with pytest.raises(ValueError, match=message):
        create_drafter(f"eagle:{heads['eagle1']}", target_info(small_vocab_dir), options)


def test_capabilities_and_defaults(small_vocab_dir, heads):
    d1 = create_drafter(f"eagle:{heads['eagle1']}", target_info(small_vocab_dir))
    d3 = create_drafter(f"eagle:{heads['eagle3']}", target_info(small_vocab_dir), {"depth": 2, "topk": 2, "max_budget": 100})
    assert d1.needs_hidden_states and d1.gives_probs and d1.hidden_layers == (2,)
    assert d3.hidden_layers == (1,) and d3.max_budget == 2 + 1 * 4
    with pytest.raises(ValueError, match="needs a head directory"):
        create_drafter("eagle", target_info(small_vocab_dir))


def test_seeded_sampling_reproduces_across_calls(small_vocab_dir, heads):
    llm = LLM(small_vocab_dir, drafter=f"eagle:{heads['eagle3']}", drafter_options={"depth": 3, "topk": 2}, speculation="static")
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=77, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].token_ids == llm.generate([PROMPT], params)[0].token_ids
