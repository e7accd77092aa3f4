"""The ``medusa`` drafter: lossless like every drafter (greedy equality, sampled distribution), static
tree buffers from paths, dynamic selection, budgets, checkpoints in both layouts, wrong targets.

Heads here are tiny (hidden 64, vocabulary 16): random ones that disagree with the target, and ones
fitted in a second to the target's own greedy continuations, which agree often — plain, reading the
root token's embedding as well (``root_token``), and reading each tree node's parent's too (``parent_token``).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from specserve.drafters import DraftRequest, TargetInfo, create_drafter
from specserve.drafters import medusa as _medusa  # noqa: F401  (registers "medusa")
from specserve.drafters.medusa_heads import MedusaHeads, load_heads, save_heads
from specserve.drafters.medusa_tree import DEFAULT_CHOICES, StaticTree, choices_from_accuracies
from specserve.verify import DraftTree
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target
from tiny_models import build_model
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
PROMPT = [3, 1, 4, 1, 5]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
SHAPES = {
    "static": {},
    "static-cut": {"max_budget": 4},
    "static-choices": {"choices": "[[0], [1], [0, 0], [0, 1], [2], [0, 0, 0]]"},
    "dynamic": {"tree": "dynamic"},
    "dynamic-cut": {"tree": "dynamic", "topk": 2, "max_budget": 5, "depth": 2},
}


def _random_heads(seed: int, lm_head: str = "own", num_heads: int = 3, root_token: bool = False,
                  parent_token: bool = False) -> MedusaHeads:
    heads = MedusaHeads(64, 16, num_heads, 1, lm_head, root_token=root_token, parent_token=parent_token)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.4).half().float())  # fp16-exact: saving is lossless
    return heads


def _fit_heads(target_dir, num_heads: int = 3, root_token: bool = False, parent_token: bool = False) -> MedusaHeads:
    """Heads fitted in a second to the target's greedy continuations of the test prompts (hard labels
    t + k + 2; root-token heads also read the embedding of the token at t + 1, parent-token heads k >= 1 that of
    the token at t + 1 + k): a random tiny target is chaotic, so they memorise these rather than generalise."""
    llm = LLM(target_dir, device="cpu")
    prompts = PROMPTS + [PROMPT]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    width = max(map(len, seqs))
    seqs = torch.tensor([s + s[-1:] * (width - len(s)) for s in seqs])  # padding repeats the last token
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        feats = hf.model(input_ids=seqs).last_hidden_state  # [B, T, H]
    embed = hf.model.embed_tokens.weight.detach()
    heads = MedusaHeads(64, 16, num_heads, 1, "own", root_token=root_token, parent_token=parent_token)
    heads.init_lm_heads(hf.lm_head.weight)
    torch.manual_seed(0)
    opt = torch.optim.Adam(heads.parameters(), lr=2e-2)
    for _ in range(300):
        loss = 0.0
        for k in range(num_heads):
            roots = embed[seqs[:, 1 : seqs.shape[1] - (k + 1)]] if root_token else None
            parents = embed[seqs[:, 1 + k : seqs.shape[1] - 1]] if parent_token and k else None
            logits = heads(feats[:, : -(k + 2)], heads=1, first=k, root_embed=roots, parent_embed=parents)[0]
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, 16), seqs[:, k + 2 :].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(p.half().float())
    return heads


@pytest.fixture(scope="module")
def random_dir(small_vocab_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa_random")
    save_heads(_random_heads(1), out, small_vocab_dir)
    return out


@pytest.fixture(scope="module")
def fitted_dir(small_vocab_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa_fitted")
    save_heads(_fit_heads(small_vocab_dir), out, small_vocab_dir, extra={"choices": [[0], [0, 0], [1], [0, 0, 0], [0, 1]]})
    return out


@pytest.fixture(scope="module")
def root_dir(small_vocab_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa_root")
    save_heads(_fit_heads(small_vocab_dir, root_token=True), out, small_vocab_dir,
               extra={"choices": [[0], [0, 0], [1], [0, 0, 0], [0, 1]]})
    return out


@pytest.fixture(scope="module")
def parent_dir(small_vocab_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa_parent")
    save_heads(_fit_heads(small_vocab_dir, root_token=True, parent_token=True), out, small_vocab_dir,
               extra={"choices": [[0], [0, 0], [1], [0, 0, 0], [1, 0], [0, 1], [2]]})
    return out


# A draft vocabulary leaving out 5 of the 16 tokens (some of which the target emits): those are never drafted.
DRAFT_IDS = [0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14]


def _restricted(heads: MedusaHeads, ids: list[int]) -> MedusaHeads:
    """The same heads with own LM heads kept to the rows of a draft vocabulary ``ids``."""
    out = MedusaHeads(heads.hidden_size, heads.vocab_size, heads.num_heads, heads.num_layers, "own", len(ids))
    with torch.no_grad():
        out.weight.copy_(heads.weight)
        out.bias.copy_(heads.bias)
        out.lm_heads.copy_(heads.lm_heads[:, ids])
    out.set_draft_vocab(torch.tensor(ids))
    return out


@pytest.fixture(scope="module")
def vocab_dir(small_vocab_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa_vocab")
    save_heads(_restricted(_fit_heads(small_vocab_dir), DRAFT_IDS), out, small_vocab_dir,
               extra={"choices": [[0], [0, 0], [1], [0, 0, 0], [0, 1]]})
    return out


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    outs = LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs]


def target_info(model_dir, model=None) -> TargetInfo:
    return TargetInfo(vocab_size=16, hidden_size=64, num_layers=2, device=torch.device("cpu"), dtype=torch.float32,
                      model_dir=str(model_dir), model=model)


def _requests(contexts, temperature=0.0, seed=None, hidden=True, prefix="r"):
    gen = torch.Generator().manual_seed(7)
    return [DraftRequest(f"{prefix}{i}", np.asarray(c, dtype=np.int64), temperature,
                         {2: torch.randn(len(c) - 1, 64, generator=gen)} if hidden else None, seed)
            for i, c in enumerate(contexts)]


# ---- losslessness: greedy ----------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("heads,shape", [(h, s) for h, s in itertools.product(["random", "fitted", "vocab", "root", "parent"],
                                                                           sorted(SHAPES))
                                         # parent-token heads draft static trees (dynamic ones are refused)
                                         if not (h == "parent" and SHAPES[s].get("tree") == "dynamic")])
def test_greedy_equals_plain(small_vocab_dir, reference, request, heads, shape, batch):
    path = request.getfixturevalue(f"{heads}_dir")
    llm = LLM(small_vocab_dir, drafter=f"medusa:{path}", drafter_options=SHAPES[shape], device="cpu", speculation="static")
    outs = llm.generate(PROMPTS[:batch], GREEDY)
    assert [o.token_ids for o in outs] == reference[:batch]
    accepted = sum(sum(o.spec.accepted_per_position) for o in outs)
    if heads in ("fitted", "vocab", "root", "parent"):  # agreeing heads: most steps accept something
        assert accepted >= sum(o.spec.num_steps for o in outs)
    alloc = llm.engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks
    assert not llm.engine.drafter._features and not llm.engine.drafter._generators


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.sampled_from(["static", "dynamic"]), topk=st.integers(1, 4), depth=st.integers(1, 3),
       max_budget=st.integers(1, 30), batch=st.sampled_from([1, 2, 4]), temperature=st.sampled_from([0.0, 0.0, 0.9]))
def test_any_tree_is_lossless_greedy_and_well_formed(small_vocab_dir, random_dir, reference, tree, topk, depth,
                                                    max_budget, batch, temperature):
    options = dict(tree=tree, depth=depth, max_budget=max_budget, **({"topk": topk} if tree == "dynamic" else {}))
    llm = LLM(small_vocab_dir, drafter=f"medusa:{random_dir}", drafter_options=options, device="cpu", speculation="static")
    if temperature == 0.0:
        outs = llm.generate(PROMPTS[:batch], GREEDY)
        assert [o.token_ids for o in outs] == reference[:batch]
    drafter = llm.engine.drafter
    contexts = [p + r[:5] for p, r in zip(PROMPTS[:batch], reference)]
    for t in drafter.propose(_requests(contexts, temperature), [max_budget] * batch):
        assert 1 <= t.num_nodes <= min(max_budget, drafter.max_budget)
        assert t.max_depth <= depth
        for row in range(t.num_nodes + 1):
            kids = t.children(row)
            assert len({int(t.tokens[k]) for k in kids}) == len(kids)
            if tree == "dynamic":
                assert len(kids) <= topk
        assert (not t.has_q) == (temperature == 0.0)


# ---- losslessness: sampling ----------------------------------------------------------------------

N = 1500
SAMPLING_CASES = {
    "fitted-static-T1": ("fitted_dir", {}, {"temperature": 1.0}),
    "fitted-dynamic-T0.7-topk": ("fitted_dir", {"tree": "dynamic", "topk": 3, "max_budget": 8},
                                 {"temperature": 0.7, "top_k": 6}),
    "random-static-T1.2-topp-minp": ("random_dir", {}, {"temperature": 1.2, "top_p": 0.9, "min_p": 0.02}),
    "vocab-static-T1": ("vocab_dir", {}, {"temperature": 1.0}),
    "vocab-dynamic-T0.8": ("vocab_dir", {"tree": "dynamic", "topk": 3, "max_budget": 8}, {"temperature": 0.8}),
    "root-static-T1": ("root_dir", {}, {"temperature": 1.0}),
    "parent-static-T1": ("parent_dir", {}, {"temperature": 1.0}),
    "parent-static-T0.8-topk": ("parent_dir", {"storage": "int8"}, {"temperature": 0.8, "top_k": 5}),
}


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampled_tokens_follow_target_distribution(small_vocab_dir, case, request):
    fixture, options, sampling = SAMPLING_CASES[case]
    path = request.getfixturevalue(fixture)
    # max_tokens=8: the first decode step drafts 6 nodes (siblings at depths 1 and 2), and its root
    # children and their children are the 2nd and 3rd tokens whose distributions are checked.
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, **sampling) for seed in range(N)]
    llm = LLM(small_vocab_dir, drafter=f"medusa:{path}", drafter_options=options, device="cpu", max_num_seqs=N, speculation="static")
    outs = llm.generate([PROMPT] * N, params)
    assert_follows_target(outs, small_vocab_dir, PROMPT, params[0])
    accepted = sum(sum(o.spec.accepted_per_position) for o in outs)
    assert accepted > (N if fixture in ("fitted_dir", "vocab_dir", "root_dir", "parent_dir") else N // 10)  # drafts were accepted


@pytest.mark.parametrize("options", [{}, {"tree": "dynamic", "topk": 4, "max_budget": 12}])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_draft_vocabulary_drafts_only_its_tokens(small_vocab_dir, vocab_dir, options, temperature):
    """Trees and their draft distributions name target ids, all inside the draft vocabulary; greedy nodes are
    the heads' top draft-vocabulary tokens (a float64 ranking of the full heads' logits over those ids)."""
    drafter = create_drafter(f"medusa:{vocab_dir}", target_info(small_vocab_dir), options)
    requests = _requests([p + [2, 3] for p in PROMPTS], temperature, seed=4)
    trees = drafter.propose(requests, [12] * len(requests))
    assert all(t.num_nodes for t in trees)
    for tree in trees:
        assert set(tree.tokens.tolist()) <= set(DRAFT_IDS)
        if temperature > 0:
            ids = tree.q_ids[tree.q_ids >= 0].tolist()
            assert ids and set(ids) <= set(DRAFT_IDS)
    if temperature == 0.0 and not options:
        heads = load_heads(vocab_dir, hidden_size=64, vocab_size=16).heads.double()
        for req, tree in zip(requests, trees):
            with torch.no_grad():
                logits = heads(req.hidden_states[2][-1].double())  # [K, V']
            best = [DRAFT_IDS[int(i)] for i in logits.argmax(-1)]
            kids = tree.children(0)
            assert int(tree.tokens[kids[0]]) == best[0]  # the static tree's first node: head 0's rank 0


# ---- static trees from paths ---------------------------------------------------------------------


def test_static_buffers_match_hand_computed():
    tree = StaticTree.from_choices([[0], [1], [0, 0], [0, 1], [2], [0, 0, 0]])
    assert tree.parents.tolist() == [-1, -1, 0, 0, -1, 2]
    assert tree.depths.tolist() == [1, 1, 2, 2, 1, 3]
    assert tree.ranks.tolist() == [0, 1, 0, 1, 2, 0]
    expected = np.array([  # node i's row: itself and its ancestors
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=bool)
    assert (tree.ancestors == expected).all()
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 11, 13]
    draft = DraftTree(torch.zeros(6, dtype=torch.int64), torch.from_numpy(tree.parents))
    assert torch.equal(draft.ancestor_mask[1:, 1:], torch.from_numpy(expected))
    assert draft.positions(10).tolist() == tree.positions(10).tolist()


def test_static_order_keeps_the_list_order_and_puts_parents_first():
    tree = StaticTree.from_choices([[0, 0], [1], [0], [1, 0]])
    assert tree.choices == ((0,), (0, 0), (1,), (1, 0))  # [0] is pulled up to its child's place
    assert tree.parents.tolist() == [-1, 0, -1, 2]
    for n in range(1, tree.num_nodes + 1):  # every prefix of the node order is a tree
        assert all(p < n for p in tree.parents[:n])
    assert StaticTree.from_choices(DEFAULT_CHOICES).num_nodes == 20
    assert StaticTree.from_choices(DEFAULT_CHOICES).limited_to(2).max_depth == 2


@pytest.mark.parametrize("choices, message", [
    ([[0], [0, 1, 0]], r"needs its prefix \[0, 1\]"),
    ([[1, 0]], r"needs its prefix \[1\]"),
    ([[0], [0]], "appears twice"),
    ([[0], [-1]], "ranks >= 0"),
    ([[0], []], "non-empty list"),
    ([[0], [True]], "ranks >= 0"),
    ([], "non-empty list"),
    ("[[0], [1", "JSON"),
    ("{\"a\": 1}", "list of lists"),
    (5, "list of lists"),
])
def test_invalid_choices_are_rejected(choices, message):
    with pytest.raises(ValueError, match=message):
        StaticTree.from_choices(choices)


def test_choices_from_accuracies_is_greedy_and_ancestor_closed():
    acc = [[0.6, 0.25, 0.1], [0.5, 0.1, 0.3], [0.4, 0.1, 0.0]]  # [1][2] > [1][1]: noise, made non-increasing
    choices = choices_from_accuracies(acc, 6)
    assert choices == [[0], [0, 0], [1], [1, 0], [0, 0, 0], [2]]  # [0, 2] would be 0.18 without the fix
    StaticTree.from_choices(choices)


# ---- dynamic trees -------------------------------------------------------------------------------


def test_dynamic_trees_are_the_best_ancestor_closed_sets(small_vocab_dir, random_dir):
    """Greedy dynamic trees keep, among each depth's top-k candidates, the budget's best rank paths by
    summed head log-probability — the best ancestor-closed set (checked by enumerating every path)."""
    k = 3
    drafter = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {"tree": "dynamic", "topk": k,
                                                                                    "max_budget": 39})
    heads = load_heads(random_dir, hidden_size=64, vocab_size=16).heads
    for i, budget in enumerate((1, 7, 30)):
        req = _requests([PROMPT], prefix=f"d{i}-")[0]
        (tree,) = drafter.propose([req], [budget])
        with torch.no_grad():
            logq = torch.log_softmax(heads(req.hidden_states[2][-1]), -1)  # [D, V]
        top = logq.topk(k, dim=-1)
        paths = [p for depth in range(1, drafter.depth + 1) for p in itertools.product(range(k), repeat=depth)]
        score = {p: float(sum(top.values[j, x] for j, x in enumerate(p))) for p in paths}
        best = sorted(paths, key=lambda p: -score[p])[:budget]
        got = set()
        for node in range(tree.num_nodes):
            path = [tree.tokens[n] for n in tree.path_to(node)]
            got.add(tuple(top.indices[j].tolist().index(int(t)) for j, t in enumerate(path)))
        assert got == set(best)


def test_budgets_cut_trees_to_a_prefix(small_vocab_dir, random_dir):
    assert create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir)).max_budget == 8  # the default
    drafter = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {"max_budget": 1000})
    full = drafter.static.num_nodes
    assert drafter.max_budget == full == 17  # the default choices limited to the checkpoint's 3 heads
    feature = {2: torch.randn(len(PROMPT) - 1, 64)}
    trees = drafter.propose([DraftRequest(f"r{i}", np.asarray(PROMPT), 0.0, feature) for i in range(4)], [0, 1, 3, 100])
    assert [t.num_nodes for t in trees] == [0, 1, 3, full]
    for t in trees[1:3]:
        assert t.parents.tolist() == trees[3].parents[: t.num_nodes].tolist()
        assert t.tokens.tolist() == trees[3].tokens[: t.num_nodes].tolist()


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_a_depth_asked_for_limits_the_trees_and_the_heads_run(small_vocab_dir, random_dir, tree):
    """`propose(..., depth=d)` (the adaptive policy's chosen depth) drafts only levels 1..d and runs only the
    first d heads; greedy trees keep their nodes' tokens: the full tree's nodes of depth <= d, in its order."""
    options = {"max_budget": 1000, **({"tree": "dynamic", "topk": 2} if tree == "dynamic" else {})}
    drafter = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), options)
    heads_run = []  # how many heads each propose ran (through the CPU kernels or the torch module)
    if drafter.kernels is not None:
        kernels = drafter.kernels
        drafter.kernels = lambda feats, reach, *rest: heads_run.append(reach) or kernels(feats, reach, *rest)
    else:
        module = drafter.heads
        drafter.heads = lambda *args, heads, **kw: heads_run.append(heads) or module(*args, heads=heads, **kw)
    req = _requests([PROMPT])[0]
    (full,) = drafter.propose([req], [1000])
    for depth in (1, 2):
        (limited,) = drafter.propose([req], [1000], depth=depth)
        assert int(limited.depths.max()) == depth and heads_run[-1] == depth
        keep = np.flatnonzero(full.depths.numpy() <= depth)
        assert limited.num_nodes == len(keep)
        assert limited.tokens.tolist() == full.tokens[keep].tolist()
    (capped,) = drafter.propose([req], [1], depth=2)  # one node: head 0 alone
    assert capped.num_nodes == 1 and heads_run[-1] == (1 if tree == "static" else 2)


def test_greedy_trees_take_each_heads_top_ranks(small_vocab_dir, random_dir):
    drafter = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {"tree": "dynamic", "topk": 3})
    req = _requests([PROMPT])[0]
    (tree,) = drafter.propose([req], [12])
    heads = load_heads(random_dir, hidden_size=64, vocab_size=16).heads
    with torch.no_grad():
        logits = heads(req.hidden_states[2][-1])  # [K, V]: head k from the last committed position's feature
    top = logits.topk(3, dim=-1).indices
    for node in range(tree.num_nodes):
        depth = int(tree.depths[node])
        assert int(tree.tokens[node]) in top[depth - 1].tolist()
    assert tree.tokens[tree.children(0)].tolist() == top[0, : len(tree.children(0))].tolist()
    assert not tree.has_q


def test_root_token_heads_read_each_requests_own_root(small_vocab_dir, tmp_path):
    """Root-token heads: two requests with the same feature and different roots (their last token) get the
    trees a float64 evaluation of the heads' definition gives with the target's embedding of THAT root."""
    save_heads(_random_heads(11, root_token=True), tmp_path / "h", small_vocab_dir)
    llm = LLM(small_vocab_dir, drafter=f"medusa:{tmp_path / 'h'}", drafter_options={"tree": "dynamic", "topk": 3},
              device="cpu")
    drafter = llm.engine.drafter
    feature = torch.randn(len(PROMPT), 64, generator=torch.Generator().manual_seed(2))
    roots = [4, 13]
    requests = [DraftRequest(f"q{root}", np.asarray(PROMPT + [root], dtype=np.int64), 0.0, {2: feature}, None)
                for root in roots]
    trees = drafter.propose(requests, [12, 12])
    heads = load_heads(tmp_path / "h", hidden_size=64, vocab_size=16).heads.double()
    hf = AutoModelForCausalLM.from_pretrained(str(small_vocab_dir), dtype=torch.float64)
    firsts = []
    for root, tree in zip(roots, trees):
        h, e = feature[-1].double(), hf.model.embed_tokens.weight[root].detach()
        x = h + heads.root_weight[0] @ e
        x = x + torch.nn.functional.silu(heads.weight[0, 0] @ x + heads.bias[0, 0])
        logits = heads.lm_heads[0] @ x  # head 0 written out: the depth-1 nodes' scores
        with torch.no_grad():
            assert torch.allclose(heads(h, heads=1, root_embed=e)[0], logits)
        kids = tree.children(0)
        assert tree.tokens[kids].tolist() == logits.topk(len(kids)).indices.tolist()
        firsts.append(logits)
    assert not torch.allclose(firsts[0], firsts[1])  # the root changed what head 0 scores


@pytest.mark.parametrize("storage", ["int8", "q4_1", "int4"])
def test_heads_stored_in_any_kernel_storage_stay_lossless(small_vocab_dir, reference, root_dir, storage):
    """The heads' products in the storage asked for (the target's stay float32): greedy output equals plain."""
    llm = LLM(small_vocab_dir, drafter=f"medusa:{root_dir}", drafter_options={"storage": storage}, device="cpu",
              speculation="static")
    kernels = llm.engine.drafter.kernels
    assert {q.storage for q in kernels.lm_heads + kernels.roots + [b for bs in kernels.blocks for b in bs]} == {storage}
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize(("quantization", "expected"), [("int8", "int8"), ("int4", "q4_1")])
def test_heads_beside_a_quantized_target_take_its_bit_width(small_vocab_dir, root_dir, quantization, expected):
    """No storage asked for: beside 8-bit target layers the heads run Q8_0, beside 4-bit ones Q4_1 (their bytes
    are a drafting step's time; `kernels.drafter_storage`); greedy output stays the quantized target's."""
    llm = LLM(small_vocab_dir, drafter=f"medusa:{root_dir}", device="cpu", speculation="static",
              quantization=quantization)
    kernels = llm.engine.drafter.kernels
    assert {q.storage for q in kernels.lm_heads + kernels.roots + [b for bs in kernels.blocks for b in bs]} == {expected}
    plain = LLM(small_vocab_dir, drafter=None, device="cpu", quantization=quantization)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def test_sampled_tree_probs_are_what_each_node_was_drawn_from(small_vocab_dir, random_dir):
    drafter = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {"max_budget": 17})
    req = _requests([PROMPT], temperature=0.7)[0]
    (tree,) = drafter.propose([req], [17])
    assert tree.parents.tolist() == drafter.static.parents.tolist()  # no draw ran out: the full static shape
    heads = load_heads(random_dir, hidden_size=64, vocab_size=16).heads
    with torch.no_grad():
        q = torch.softmax(heads(req.hidden_states[2][-1]) / 0.7, dim=-1)  # [K, V]
    probs = tree.q_dense(16)
    torch.testing.assert_close(probs.sum(-1), torch.ones(tree.num_nodes))
    for row in range(tree.num_nodes + 1):
        kids = tree.children(row)
        depth = 0 if row == 0 else int(tree.depths[row - 1])
        for j, node in enumerate(kids):  # sibling j: q of its depth without siblings 0..j-1, renormalised
            expected = q[depth].clone()
            expected[tree.tokens[kids[:j]]] = 0
            torch.testing.assert_close(probs[node], expected / expected.sum(), atol=1e-5, rtol=1e-4)
            assert float(probs[node, tree.tokens[node]]) > 0
        assert len({int(tree.tokens[k]) for k in kids}) == len(kids)


@pytest.mark.parametrize("options", [{}, {"tree": "dynamic", "topk": 3}])
def test_sampled_tree_shapes_do_not_depend_on_the_draws(small_vocab_dir, random_dir, options):
    """Losslessness needs the shape fixed before drawing: different draws, same parents."""
    shapes, tokens = set(), set()
    for seed in range(6):
        drafter = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {**options, "seed": seed})
        for budget in (5, 12):
            (tree,) = drafter.propose(_requests([PROMPT], temperature=1.0, prefix=f"b{budget}-"), [budget])
            shapes.add((budget, tuple(tree.parents.tolist())))
            tokens.add(tuple(tree.tokens.tolist()))
    assert len(shapes) == 2 and len(tokens) > 2


def test_mixed_greedy_and_sampled_requests_in_one_batch(small_vocab_dir, random_dir):
    drafter = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {"tree": "dynamic"})
    reqs = [DraftRequest(f"m{i}", np.asarray(PROMPT, dtype=np.int64), t, {2: torch.ones(4, 64) * (1 + (i % 2))})
            for i, t in enumerate((0.0, 0.8, 0.0, 1.3))]
    trees = drafter.propose(reqs, [6, 6, 6, 6])
    assert [not t.has_q for t in trees] == [True, False, True, False]
    alone = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {"tree": "dynamic"})
    (single,) = alone.propose(reqs[2:3], [6])
    assert single.tokens.tolist() == trees[2].tokens.tolist() == trees[0].tokens.tolist()


# ---- features -------------------------------------------------------------------------------------


def test_features_are_kept_across_zero_budgets_and_released(small_vocab_dir, random_dir):
    drafter = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir))
    first = _requests([PROMPT])
    assert drafter.propose(first, [0])[0].num_nodes == 0  # budget 0, but the feature is kept
    again = [DraftRequest("r0", np.asarray(PROMPT, dtype=np.int64), 0.0)]
    assert drafter.propose(again, [4])[0].num_nodes == 4
    stale = [DraftRequest("r0", np.asarray(PROMPT + [1], dtype=np.int64), 0.0)]  # one token on, no new feature
    assert drafter.propose(stale, [4])[0].num_nodes == 0
    unknown = [DraftRequest("new", np.asarray(PROMPT, dtype=np.int64), 0.0)]
    assert drafter.propose(unknown, [4])[0].num_nodes == 0
    drafter.release("r0")
    drafter.release("never-seen")
    assert not drafter._features


def test_the_engine_hands_over_the_targets_final_normed_feature(small_vocab_dir, random_dir):
    llm = LLM(small_vocab_dir, drafter=f"medusa:{random_dir}", device="cpu", speculation="static")
    drafter = llm.engine.drafter
    seen = []
    original = drafter.propose

    def spy(requests, budgets, depth=None):
        trees = original(requests, budgets, depth)
        seen.extend((r.token_ids.copy(), torch.as_tensor(drafter._features[r.request_id][0]).clone()) for r in requests)
        return trees

    drafter.propose = spy
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(small_vocab_dir), dtype=torch.float32).eval()
    assert len(seen) >= 2
    for tokens, feature in seen:
        with torch.no_grad():
            ref = hf.model(input_ids=torch.tensor([tokens[:-1].tolist()])).last_hidden_state[0, -1]
        torch.testing.assert_close(feature, ref, atol=1e-4, rtol=1e-4)


# ---- checkpoints ----------------------------------------------------------------------------------


def _proposals(path, target_dir, options=None, temperature=0.0):
    drafter = create_drafter(f"medusa:{path}", target_info(target_dir), options or {})
    return [(t.tokens.tolist(), t.parents.tolist()) for t in drafter.propose(_requests(PROMPTS, temperature, seed=3), [9] * 4)]


def test_round_trip_gives_the_same_proposals(small_vocab_dir, tmp_path):
    heads = _random_heads(5)
    save_heads(heads, tmp_path / "a", small_vocab_dir)
    loaded = load_heads(tmp_path / "a", hidden_size=64, vocab_size=16, target_dir=small_vocab_dir)
    for name, p in heads.named_parameters():
        assert torch.equal(p, dict(loaded.heads.named_parameters())[name]), name
    config = json.loads((tmp_path / "a" / "medusa_config.json").read_text())
    assert config["target"]["vocab_size"] == 16 and len(config["target"]["fingerprint"]) == 64
    save_heads(loaded.heads, tmp_path / "b", small_vocab_dir)
    for temperature in (0.0, 0.9):
        assert _proposals(tmp_path / "a", small_vocab_dir, temperature=temperature) == \
            _proposals(tmp_path / "b", small_vocab_dir, temperature=temperature)


def test_root_token_heads_round_trip_as_version_2(small_vocab_dir, tmp_path):
    heads = _random_heads(6, root_token=True)
    config = save_heads(heads, tmp_path / "a", small_vocab_dir)
    assert config["version"] == 2 and config["root_token"] is True
    assert json.loads((tmp_path / "a" / "medusa_config.json").read_text())["root_token"] is True
    loaded = load_heads(tmp_path / "a", hidden_size=64, vocab_size=16, target_dir=small_vocab_dir).heads
    assert loaded.root_token and torch.equal(loaded.root_weight, heads.root_weight)
    assert save_heads(_random_heads(6), tmp_path / "b", small_vocab_dir)["version"] == 1  # plain heads stay version 1
    bad = json.loads((tmp_path / "a" / "medusa_config.json").read_text())
    (tmp_path / "a" / "medusa_config.json").write_text(json.dumps({**bad, "version": 1}))
    with pytest.raises(ValueError, match="root_token"):
        load_heads(tmp_path / "a", hidden_size=64, vocab_size=16)
    (tmp_path / "a" / "medusa_config.json").write_text(json.dumps({**bad, "version": 4}))
    with pytest.raises(ValueError, match="reads versions 1, 2, 3"):
        load_heads(tmp_path / "a", hidden_size=64, vocab_size=16)


def test_parent_token_heads_round_trip_as_version_3_and_need_root_tokens(small_vocab_dir, tmp_path):
    heads = _random_heads(8, root_token=True, parent_token=True)
    config = save_heads(heads, tmp_path / "a", small_vocab_dir)
    assert config["version"] == 3 and config["parent_token"] is True and heads.parent_weight.shape == (2, 64, 64)
    loaded = load_heads(tmp_path / "a", hidden_size=64, vocab_size=16, target_dir=small_vocab_dir).heads
    assert loaded.parent_token and torch.equal(loaded.parent_weight, heads.parent_weight)
    bad = json.loads((tmp_path / "a" / "medusa_config.json").read_text())
    for broken in ({**bad, "version": 2}, {**bad, "root_token": False}):
        (tmp_path / "a" / "medusa_config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="parent_token"):
            load_heads(tmp_path / "a", hidden_size=64, vocab_size=16)
    with pytest.raises(ValueError, match="root token too"):
        MedusaHeads(64, 16, 3, 1, "own", parent_token=True)
    with pytest.raises(ValueError, match="one at a time"):
        heads(torch.zeros(2, 64), heads=2, root_embed=torch.zeros(2, 64))


def test_parent_token_heads_give_each_node_its_own_children(small_vocab_dir, tmp_path):
    """Every expanded node's children are the top ranks of the head of its depth evaluated in float64 with THAT
    node's token as the parent (so two depth-1 siblings get different children), on the CPU kernels in float32 and
    in int8 and on the torch module alike."""
    heads = _random_heads(12, root_token=True, parent_token=True)
    save_heads(heads, tmp_path / "h", small_vocab_dir,
               extra={"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0]]})
    hf = AutoModelForCausalLM.from_pretrained(str(small_vocab_dir), dtype=torch.float64)
    embed = hf.model.embed_tokens.weight.detach()
    ref = load_heads(tmp_path / "h", hidden_size=64, vocab_size=16).heads.double()
    feature = torch.randn(len(PROMPT), 64, generator=torch.Generator().manual_seed(4))
    context = PROMPT + [9]

    def head(k: int, parent: int | None) -> torch.Tensor:  # head k's logits, its definition written out
        x = feature[-1].double() + ref.root_weight[k] @ embed[context[-1]]
        if k:
            x = x + ref.parent_weight[k - 1] @ embed[parent]
        x = x + torch.nn.functional.silu(ref.weight[k, 0] @ x + ref.bias[k, 0])
        return ref.lm_heads[k] @ x

    model = LLM(small_vocab_dir, device="cpu").engine.model
    for options, on_kernels in (({}, True), ({"storage": "int8"}, True), ({}, False)):
        info = target_info(small_vocab_dir, model if on_kernels else _EmbedOnly(model))
        drafter = create_drafter(f"medusa:{tmp_path / 'h'}", info, {"max_budget": 100, **options})
        assert (drafter.kernels is not None) == on_kernels
        (tree,) = drafter.propose([DraftRequest("p", np.asarray(context), 0.0, {2: feature}, None)], [100])
        assert tree.num_nodes == 11
        seen = []
        for row in range(tree.num_nodes + 1):
            kids = tree.children(row)
            if not kids:
                continue
            depth = 0 if row == 0 else int(tree.depths[row - 1])
            logits = head(depth, None if row == 0 else int(tree.tokens[row - 1]))
            ranks = logits.argsort(descending=True).tolist()
            tol = 0.05 if options else 1e-4  # 8-bit products may swap near-ties: ranks are checked where clear
            for j, kid in enumerate(kids):
                gaps = [logits[ranks[i]] - logits[ranks[i + 1]] for i in (j - 1, j) if i >= 0]
                if min(gaps) > tol:
                    assert int(tree.tokens[kid]) == ranks[j]
            if depth == 1:
                seen.append(logits)
        assert len(seen) >= 2 and not torch.allclose(seen[0], seen[1])  # siblings' children read their own parents


class _EmbedOnly:
    """A target seen without its CPU kernels (the heads then run as a torch module): its embedding only."""

    def __init__(self, model) -> None:
        self.embed, self.kernels = model.embed, None


def test_a_draft_vocabulary_round_trips_and_bad_maps_are_refused(small_vocab_dir, vocab_dir, tmp_path):
    loaded = load_heads(vocab_dir, hidden_size=64, vocab_size=16, target_dir=small_vocab_dir).heads
    assert loaded.draft_to_target.tolist() == DRAFT_IDS and loaded.lm_heads.shape == (3, len(DRAFT_IDS), 64)
    config = json.loads((vocab_dir / "medusa_config.json").read_text())
    assert config["draft_vocab_size"] == len(DRAFT_IDS)
    save_heads(loaded, tmp_path / "again", small_vocab_dir, extra={"choices": config["choices"]})
    for temperature in (0.0, 0.9):
        assert _proposals(tmp_path / "again", small_vocab_dir, temperature=temperature) == \
            _proposals(vocab_dir, small_vocab_dir, temperature=temperature)
    from safetensors.torch import load_file

    tensors = load_file(str(vocab_dir / "medusa_heads.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "medusa_config.json").write_text((vocab_dir / "medusa_config.json").read_text())
    for ids, message in ((torch.tensor(DRAFT_IDS[::-1]), "ascending"), (torch.tensor([16] + DRAFT_IDS[1:]), "ascending"),
                         (torch.tensor(DRAFT_IDS, dtype=torch.float32), "integer token ids")):
        save_file({**tensors, "draft_to_target": ids}, str(bad / "medusa_heads.safetensors"))
        with pytest.raises(ValueError, match=message):
            create_drafter(f"medusa:{bad}", target_info(small_vocab_dir))
    del tensors["draft_to_target"]
    save_file(tensors, str(bad / "medusa_heads.safetensors"))
    with pytest.raises(ValueError, match="missing draft_to_target"):
        create_drafter(f"medusa:{bad}", target_info(small_vocab_dir))
    with pytest.raises(ValueError, match="needs own LM heads"):
        MedusaHeads(64, 16, 3, 1, "shared", 8)


@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_public_medusa_layout_loads_like_ours(small_vocab_dir, tmp_path, suffix):
    heads = _random_heads(6, num_heads=2)
    save_heads(heads, tmp_path / "ours", small_vocab_dir)
    public = tmp_path / "public"
    public.mkdir()
    (public / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                    "base_model_name_or_path": str(small_vocab_dir)}))
    state = {}
    for k in range(2):  # the state dict of ModuleList[Sequential(ResBlock, Linear(H, V, bias=False))]
        state[f"{k}.0.linear.weight"] = heads.weight[k, 0].detach().clone()
        state[f"{k}.0.linear.bias"] = heads.bias[k, 0].detach().clone()
        state[f"{k}.1.weight"] = heads.lm_heads[k].detach().clone()
    if suffix == "safetensors":
        save_file(state, str(public / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, public / "medusa_lm_head.pt")
    assert load_heads(public, hidden_size=64, vocab_size=16).layout == "medusa"
    for options in ({}, {"tree": "dynamic"}):
        assert _proposals(public, small_vocab_dir, options) == _proposals(tmp_path / "ours", small_vocab_dir, options)
    del state["1.0.linear.bias"]
    save_file(state, str(public / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1\.0\.linear\.bias"):
        load_heads(public, hidden_size=64, vocab_size=16)


def test_shared_lm_head_reads_the_targets(small_vocab_dir, tmp_path):
    shared = _random_heads(8, lm_head="shared")
    save_heads(shared, tmp_path / "shared", small_vocab_dir)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "shared" / "medusa_heads.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["bias", "weight"]  # no LM head stored
    assert json.loads((tmp_path / "shared" / "medusa_config.json").read_text())["lm_head"] == "shared"
    llm = LLM(small_vocab_dir, drafter=f"medusa:{tmp_path / 'shared'}", device="cpu", speculation="static")
    own = MedusaHeads(64, 16, 3, 1, "own")
    own.load_state_dict({**shared.state_dict(), "lm_heads": llm.model.lm_head.detach()[None].expand(3, -1, -1).clone()})
    save_heads(own, tmp_path / "own", small_vocab_dir, dtype=torch.float32)
    assert _proposals(tmp_path / "own", small_vocab_dir) == [
        (t.tokens.tolist(), t.parents.tolist())
        for t in llm.engine.drafter.propose(_requests(PROMPTS, seed=3), [9] * 4)]
    with pytest.raises(ValueError, match="share the target's LM head"):
        create_drafter(f"medusa:{tmp_path / 'shared'}", target_info(small_vocab_dir))  # no target model given


def test_wrong_targets_and_broken_files_are_clear_errors(small_vocab_dir, llama_dir, random_dir, tmp_path):
    with pytest.raises(ValueError, match="vocab_size 16 but the target has"):
        LLM(llama_dir, drafter=f"medusa:{random_dir}", device="cpu", speculation="static")
    other = build_model(tmp_path / "other", "llama", vocab_size=16, tokenizer=False, init_std=0.3, seed=1)
    with pytest.raises(ValueError, match="trained for another target"):
        LLM(other, drafter=f"medusa:{random_dir}", device="cpu", speculation="static")
    wide = build_model(tmp_path / "wide", "llama", vocab_size=16, tokenizer=False, hidden_size=32, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="hidden size 64 but the target has 32"):
        LLM(wide, drafter=f"medusa:{random_dir}", device="cpu", speculation="static")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_drafter(f"medusa:{tmp_path / 'nope'}", target_info(small_vocab_dir))
    with pytest.raises(ValueError, match="holds no Medusa heads"):
        create_drafter(f"medusa:{small_vocab_dir}", target_info(small_vocab_dir))
    with pytest.raises(ValueError, match="needs a heads directory"):
        create_drafter("medusa", target_info(small_vocab_dir))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "medusa_config.json").write_text((random_dir / "medusa_config.json").read_text())
    (broken / "medusa_heads.safetensors").write_bytes((random_dir / "medusa_heads.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        create_drafter(f"medusa:{broken}", target_info(small_vocab_dir))
    (broken / "medusa_heads.safetensors").unlink()
    with pytest.raises(ValueError, match="are missing"):
        create_drafter(f"medusa:{broken}", target_info(small_vocab_dir))
    (broken / "medusa_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        create_drafter(f"medusa:{broken}", target_info(small_vocab_dir))


@pytest.mark.parametrize("options, message", [
    ({"tree": "beam"}, "tree must be one of"),
    ({"topk": 2}, "topk applies to tree='dynamic'"),
    ({"tree": "dynamic", "choices": [[0]]}, "choices applies to tree='static'"),
    ({"tree": "dynamic", "topk": 0}, "topk"),
    ({"tree": "dynamic", "topk": 17}, "topk"),
    ({"depth": 0}, "depth"),
    ({"depth": 4}, "depth"),
    ({"max_budget": 0}, "max_budget"),
    ({"seed": -1}, "seed"),
    ({"choices": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}, "has depth 4 but only 3"),
    ({"choices": [[0], [0, 0]], "depth": 1}, "has depth 2 but only 1"),
    ({"choices": [[16]]}, "vocabulary has 16"),
    ({"choices": [[0, 1]]}, "needs its prefix"),
    ({"branching": 2}, "unknown option"),
    ({"storage": "int3"}, "storage must be one of"),
    ({"storage": "int8"}, "applies to the CPU kernels"),  # this target_info has no model, so no kernels
])
def test_bad_options(small_vocab_dir, random_dir, options, message):
    with pytest.raises(ValueError, match=message):
        create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), options)


def test_parent_token_heads_refuse_dynamic_trees(small_vocab_dir, parent_dir):
    with pytest.raises(ValueError, match="static trees only"):
        create_drafter(f"medusa:{parent_dir}", target_info(small_vocab_dir), {"tree": "dynamic"})


def test_options_and_defaults(small_vocab_dir, random_dir, fitted_dir):
    static = create_drafter(f"medusa:{fitted_dir}", target_info(small_vocab_dir))
    assert static.static.num_nodes == static.max_budget == 5  # the checkpoint's own choices
    assert static.hidden_layers == (2,) and static.needs_hidden_states and static.gives_probs
    dynamic = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {"tree": "dynamic", "topk": 2, "depth": 2})
    assert dynamic.max_budget == 2 + 4
    json_choices = create_drafter(f"medusa:{random_dir}", target_info(small_vocab_dir), {"choices": "[[0], [1], [0, 0]]"})
    assert json_choices.max_budget == 3


def test_seeded_sampling_reproduces_across_calls(small_vocab_dir, fitted_dir):
    llm = LLM(small_vocab_dir, drafter=f"medusa:{fitted_dir}", drafter_options={"tree": "dynamic"}, speculation="static")
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=77, ignore_eos=True)
    first = llm.generate([[3, 1, 4, 1, 5]], params)[0]
    again = llm.generate([[3, 1, 4, 1, 5]], params)[0]
    assert first.token_ids == again.token_ids


@pytest.mark.parametrize("lm_head,root_token", [("own", True), ("own", False), ("shared", False)])
def test_the_compiled_heads_match_their_float64_definition_and_batch_invariance(small_vocab_dir, tmp_path, lm_head,
                                                                                 root_token):
    """All heads in one compiled call (root product, two residual blocks each, their own or the target's LM head)
    against the heads' definition written out in float64; a request's logits are bitwise those it gets alone."""
    heads = MedusaHeads(64, 16, 3, 2, lm_head, root_token=root_token)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.2).half().float())
    save_heads(heads, tmp_path / "h", small_vocab_dir)
    llm = LLM(small_vocab_dir, drafter=f"medusa:{tmp_path / 'h'}", device="cpu")
    kernels = llm.engine.drafter.kernels
    assert kernels is not None  # a float32 target on the CPU runs its kernels, and the heads' products with them
    hf = AutoModelForCausalLM.from_pretrained(str(small_vocab_dir), dtype=torch.float64)
    feats = torch.randn(3, 64, generator=gen)
    root_ids = np.array([4, 13, 7])
    roots = hf.model.embed_tokens.weight[root_ids].detach().float() if root_token else None  # the reference's lookup
    for depth in (3, 2):
        got = kernels(feats.numpy(), depth, root_ids if root_token else None)  # float32[3, depth, 16]
        assert got.shape == (3, depth, 16)
        for k in range(depth):
            x = feats.double()
            if root_token:
                x = x + roots.double() @ heads.root_weight[k].detach().double().T
            for layer in range(2):
                y = x @ heads.weight[k, layer].detach().double().T + heads.bias[k, layer].detach().double()
                x = x + y * torch.sigmoid(y)
            lm = heads.lm_heads[k].detach().double() if lm_head == "own" else hf.lm_head.weight.detach()
            torch.testing.assert_close(torch.from_numpy(got[:, k]).double(), x @ lm.T, atol=2e-4, rtol=2e-4)
        for a in range(3):
            alone = kernels(feats[a:a + 1].numpy(), depth, root_ids[a:a + 1] if root_token else None)
            assert np.array_equal(alone[0], got[a])


def test_compiled_parent_token_heads_match_their_float64_definition_and_batch_invariance(small_vocab_dir, tmp_path):
    """One head from head 1 on over rows that each read their own parent (two residual blocks, own LM heads), in the
    compiled call, against the definition written out in float64; a row's logits are bitwise those it gets alone."""
    heads = MedusaHeads(64, 16, 3, 2, "own", root_token=True, parent_token=True)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.2).half().float())
    save_heads(heads, tmp_path / "h", small_vocab_dir)
    kernels = LLM(small_vocab_dir, drafter=f"medusa:{tmp_path / 'h'}", device="cpu").engine.drafter.kernels
    embed = AutoModelForCausalLM.from_pretrained(str(small_vocab_dir), dtype=torch.float64).model.embed_tokens.weight
    feats = torch.randn(4, 64, generator=gen)
    root_ids, parent_ids = np.array([4, 13, 4, 2]), np.array([1, 1, 5, 15])
    for k in (1, 2):
        got = kernels(feats.numpy(), 1, root_ids, k, parent_ids)[:, 0]  # float32[4, 16]
        x = feats.double() + embed[root_ids].detach() @ heads.root_weight[k].detach().double().T \
            + embed[parent_ids].detach() @ heads.parent_weight[k - 1].detach().double().T
        for layer in range(2):
            y = x @ heads.weight[k, layer].detach().double().T + heads.bias[k, layer].detach().double()
            x = x + y * torch.sigmoid(y)
        torch.testing.assert_close(torch.from_numpy(got).double(), x @ heads.lm_heads[k].detach().double().T,
                                   atol=2e-4, rtol=2e-4)
        for a in range(4):
            alone = kernels(feats[a:a + 1].numpy(), 1, root_ids[a:a + 1], k, parent_ids[a:a + 1])
            assert np.array_equal(alone[0, 0], got[a])
