"""The ``hybrid`` drafter: merged trees (duplicates merged, values, cut, sampled-sibling order), per-part
calibration, specs, and losslessness through the engine (greedy equality, sampled distribution)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.drafters import CommitInfo, DraftRequest, Drafter, TargetInfo, create_drafter, register
from specserve.drafters.hybrid import HybridDrafter
from specserve.verify import DraftTree, VerifyResult
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target

TARGET = TargetInfo(vocab_size=100, hidden_size=8, num_layers=1, device=torch.device("cpu"), dtype=torch.float32)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5], [7, 7, 7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


# ---- two hand-driven parts, to state the merge exactly -------------------------------------------


class _Fixed(Drafter):
    """Proposes the trees it is given (``trees[request_id]``), whatever the budget (cut to it)."""

    def __init__(self, target, path=None, max_budget: int = 8):
        self.max_budget = max_budget
        self.trees: dict[str, DraftTree] = {}

    def propose(self, requests, budgets, depth=None):
        out = []
        for r, b in zip(requests, budgets):
            tree = self.trees.get(r.request_id, DraftTree.empty())
            out.append(tree.subtree(np.arange(min(b, tree.num_nodes))) if b else DraftTree.empty())
        return out


@register("fixed_a")
class _FixedA(_Fixed):
    pass


@register("fixed_b")
class _FixedB(_Fixed):
    gives_probs = True


@register("fixed_costly")
class _FixedCostly(_Fixed):
    """A part with a model of its own, run per level after catching up on the context (like EAGLE): remembers
    the budgets it was handed."""

    drafts_by_level = True
    catches_up = True

    def propose(self, requests, budgets, depth=None):
        self.seen = list(budgets)
        return super().propose(requests, budgets, depth)


@register("fixed_levels")
class _FixedLevels(_FixedCostly):
    """A part that drafts by level without a model to catch up (like Medusa's heads: a small product a level)."""

    catches_up = False


def _tree(tokens, parents, scores=None, q=None):
    q_ids = q_probs = None
    if q is not None:
        q_ids = torch.tensor([[t, -1] for t in tokens], dtype=torch.int64) if q == "own" else q[0]
        q_probs = torch.tensor([[1.0, 0.0]] * len(tokens)) if q == "own" else q[1]
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64), q_ids=q_ids,
                     q_probs=q_probs, scores=None if scores is None else torch.tensor(scores, dtype=torch.float32))


def _hybrid() -> HybridDrafter:
    return create_drafter("hybrid:fixed_a+fixed_b", TARGET)


def _req(rid="r", temperature=0.0):
    return DraftRequest(rid, np.array([1, 2, 3], dtype=np.int64), temperature)


def test_trees_merge_into_one_trie_with_sources():
    h = _hybrid()
    a, b = h.parts
    a.trees["r"] = _tree([5, 6, 7], [-1, 0, 0], scores=np.log([0.9, 0.5, 0.3]))
    b.trees["r"] = _tree([5, 8, 9], [-1, 0, -1], scores=np.log([0.8, 0.6, 0.1]))
    (tree,) = h.propose([_req()], [16])
    paths = {tuple(tree.tokens[tree.path_to(n)].tolist()): tree.sources[n] for n in range(tree.num_nodes)}
    assert paths == {(5,): "fixed_a+fixed_b", (5, 6): "fixed_a", (5, 7): "fixed_a", (5, 8): "fixed_b", (9,): "fixed_b"}
    scores = tree.scores.numpy()
    for n in range(tree.num_nodes):  # a node never scores above its parent
        par = int(tree.parents[n])
        assert par < 0 or scores[n] <= scores[par] + 1e-7
    # the merged node takes the better guess: 0.9 (a's) at factor 1
    root_child = next(n for n in range(tree.num_nodes) if tree.parents[n] < 0 and tree.tokens[n] == 5)
    assert np.exp(scores[root_child]) == pytest.approx(0.9, rel=1e-5)


def test_the_budget_keeps_the_best_nodes_closed_under_ancestors():
    h = _hybrid()
    a, b = h.parts
    a.trees["r"] = _tree([5, 6, 7, 8], [-1, 0, 1, 2], scores=np.log([0.9, 0.8, 0.7, 0.6]))
    b.trees["r"] = _tree([9, 10], [-1, 0], scores=np.log([0.85, 0.1]))
    (tree,) = h.propose([_req()], [3])
    paths = sorted(tuple(tree.tokens[tree.path_to(n)].tolist()) for n in range(tree.num_nodes))
    assert paths == [(5,), (5, 6), (9,)]


def test_sampled_requests_put_the_sampling_parts_draws_first_and_deterministic_ones_one_hot():
    h = _hybrid()
    a, b = h.parts  # b samples
    a.trees["r"] = _tree([4, 3], [-1, -1], scores=np.log([0.9, 0.5]))  # 4 duplicates b's second draw
    q_ids = torch.tensor([[3, 4, 6], [4, 6, -1]])
    q_probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0]])
    b.trees["r"] = _tree([3, 4], [-1, -1], scores=np.log([0.8, 0.16]), q=(q_ids, q_probs))
    (tree,) = h.propose([_req(temperature=1.0)], [8])
    assert tree.tokens.tolist() == [3, 4] and tree.parents.tolist() == [-1, -1]  # b's draws, in draw order
    assert tree.sources == ("fixed_a+fixed_b", "fixed_a+fixed_b")
    q_ids_out, q_probs_out = tree.compact_q
    assert q_ids_out[1, :2].tolist() == [4, 6] and q_probs_out[1, :2].tolist() == pytest.approx([0.6, 0.4])
    a.trees["r"] = _tree([7], [-1], scores=np.log([0.99]))  # a deterministic proposal b did not draw
    (tree,) = h.propose([_req(temperature=1.0)], [8])
    assert tree.tokens.tolist() == [3, 4, 7]
    q_ids_out, q_probs_out = tree.compact_q
    assert q_ids_out[2, 0] == 7 and q_probs_out[2, 0] == 1.0 and q_probs_out[2, 1:].sum() == 0
    (tree,) = h.propose([_req(temperature=1.0)], [1])  # the cut keeps the first draw, never the second alone
    assert tree.tokens.tolist() in ([3], [7])
    scores = dict(zip(tree.tokens.tolist(), tree.scores.tolist()))
    assert 4 not in scores


def test_a_scoreless_sampled_tree_is_valued_by_its_shape():
    """A sampling part whose trees carry no scores (Medusa's sampled trees: scores may not depend on the draws) is
    valued by the tree's shape, as the adaptive policy values such a tree: its first draw above its second, a child
    below its parent. A flat guess for every node made the draws tie, so the policy could not tell the first draw
    (the likely one) from the later ones and priced every draw alike."""
    h = _hybrid()
    _, b = h.parts  # b samples
    q_ids = torch.tensor([[3, 4, 6], [4, 6, -1], [5, -1, -1]])
    q_probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [1.0, 0.0, 0.0]])
    b.trees["r"] = _tree([3, 4, 5], [-1, -1, 0], q=(q_ids, q_probs))  # the root's two draws and the first's child
    (tree,) = h.propose([_req(temperature=1.0)], [8])
    assert tree.tokens.tolist() == [3, 4, 5] and tree.parents.tolist() == [-1, -1, 0]
    first, second, child = np.exp(tree.scores.numpy().astype(np.float64))
    # at calibration factor 1: a first child e^-1 of its parent, a second sibling e^-2 (`fallback_scores`)
    assert first == pytest.approx(np.exp(-1), rel=1e-5)
    assert second == pytest.approx(np.exp(-2), rel=1e-5)
    assert child == pytest.approx(np.exp(-1) * first, rel=1e-5)


def test_parts_are_calibrated_against_what_is_accepted():
    h = _hybrid()
    a, b = h.parts
    for step in range(60):
        rid = f"r{step}"
        a.trees[rid] = _tree([5], [-1], scores=np.log([0.5]))  # always right
        b.trees[rid] = _tree([6], [-1], scores=np.log([0.5]))  # always wrong
        h.propose([_req(rid)], [2])
        result = VerifyResult(accepted_nodes=(0,), accepted_tokens=(5,), bonus_token=1, num_drafted=2)
        h.on_commit([CommitInfo(rid, result, 5)])
    fa, fb = h.factors
    assert fa > 1.5 and fb < 0.2
    a.trees["x"] = _tree([5], [-1], scores=np.log([0.3]))
    b.trees["x"] = _tree([6], [-1], scores=np.log([0.9]))
    (tree,) = h.propose([_req("x")], [1])
    assert tree.tokens.tolist() == [5]  # a's weaker raw guess wins once calibrated


@pytest.mark.parametrize("spec, message", [
    ("hybrid", "needs its parts"),
    ("hybrid:ngram", "two or more"),
    ("hybrid:ngram+ngram", "distinct"),
    ("hybrid:ngram+hybrid", "distinct"),
    ("hybrid:ngram+nope", "unknown drafter 'nope'"),
])
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        create_drafter(spec, TARGET)


def test_part_options_reach_their_parts():
    """A per-request suffix part (``shared_tokens=0``) makes a hybrid that learns nothing across requests, as
    `specserve train default-drafter` reads it from the options before building one."""
    from specserve.evals.default_drafter import _learns_across_requests

    shared = create_drafter("hybrid:ngram+suffix", TARGET)
    private = create_drafter("hybrid:ngram+suffix", TARGET, {"part_options": {"suffix": {"shared_tokens": 0}}})
    assert shared.learns_across_requests and shared.parts[1].shared_tokens > 0
    assert not private.learns_across_requests and private.parts[1].shared_tokens == 0
    assert _learns_across_requests("hybrid:ngram+suffix", {})
    assert not _learns_across_requests("hybrid:ngram+suffix", {"part_options": {"suffix": {"shared_tokens": 0}}})
    for options, message in (({"part_options": {"draft": {}}}, "not parts of"), ({"part_options": {"suffix": 0}}, "option objects"),
                             ({"part_options": {"suffix": {"nope": 1}}}, r"unknown option\(s\) \['nope'\]")):
        with pytest.raises(ValueError, match=message):
            create_drafter("hybrid:ngram+suffix", TARGET, options)


# ---- through the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    return [o.token_ids for o in LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("speculation", ["static", "adaptive"])
@pytest.mark.parametrize("parts", ["suffix+draft", "ngram+suffix+draft"])
def test_greedy_equals_plain(small_vocab_dir, near_draft_dir, reference, parts, speculation):
    spec = "+".join(f"draft:{near_draft_dir}" if p == "draft" else p for p in parts.split("+"))
    llm = LLM(small_vocab_dir, drafter=f"hybrid:{spec}", device="cpu", speculation=speculation)
    for batch in (1, 4):
        outs = llm.generate(PROMPTS[:batch], GREEDY)
        assert [o.token_ids for o in outs] == reference[:batch]
    if speculation == "static":
        accepted = sum(sum(o.spec.accepted_per_position) for o in outs)
        by_drafter = [o.spec.accepted_by_drafter for o in outs]
        assert accepted > 0 and sum(sum(d.values()) for d in by_drafter) == accepted
        assert {name for d in by_drafter for label in d for name in label.split("+")} <= set(parts.split("+"))
    alloc = llm.engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks and llm.engine.drafter._last == {}


def test_sampled_tokens_follow_target_distribution(small_vocab_dir, near_draft_dir):
    n, prompt = 1500, [3, 1, 4, 1, 5]
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, temperature=1.0, ignore_eos=True)
              for seed in range(n)]
    greedy = LLM(small_vocab_dir, device="cpu").generate([prompt], SamplingParams(max_tokens=6, temperature=0.0,
                                                                                 ignore_eos=True))[0].token_ids
    llm = LLM(small_vocab_dir, drafter=f"hybrid:suffix+draft:{near_draft_dir}", device="cpu", max_num_seqs=n,
              max_prefill_tokens=n * len(prompt), speculation="static")
    suffix = llm.engine.drafter.parts[0]
    rng = np.random.default_rng(1)
    suffix.add_shared(np.asarray(prompt + greedy, np.int64))  # deterministic proposals that merge and that don't
    for _ in range(5):
        seq = prompt + greedy
        seq[len(prompt) + int(rng.integers(0, 3))] = int(rng.integers(0, 16))
        suffix.add_shared(np.asarray(seq, np.int64))
    outs = llm.generate([prompt] * n, params)
    assert_follows_target(outs, small_vocab_dir, prompt, params[0])
    by_drafter = {}
    for o in outs:
        for label, count in o.spec.accepted_by_drafter.items():
            by_drafter[label] = by_drafter.get(label, 0) + count
    assert by_drafter.get("suffix", 0) + by_drafter.get("suffix+draft", 0) > 0 and by_drafter.get("draft", 0) > 0


def test_info_describes_every_part(small_vocab_dir, near_draft_dir):
    llm = LLM(small_vocab_dir, drafter=f"hybrid:ngram+draft:{near_draft_dir}", device="cpu")
    info = llm.engine.drafter.describe()
    assert set(info["parts"]) == {"ngram", "draft"} and info["parts"]["draft"]["path"] == str(near_draft_dir)
    assert set(info["calibration_factors"]) == {"ngram", "draft"}


def test_costly_parts_draft_only_where_the_cheap_ones_fall_short():
    h = create_drafter("hybrid:fixed_a+fixed_costly", TARGET)
    a, costly = h.parts
    a.trees["strong"] = _tree([5, 6, 7], [-1, 0, 1], scores=np.log([0.95, 0.9, 0.85]))  # expects 2.7 tokens
    a.trees["weak"] = _tree([5], [-1], scores=np.log([0.3]))
    costly.trees["strong"] = costly.trees["weak"] = _tree([9], [-1], scores=np.log([0.6]))
    trees = h.propose([_req("strong"), _req("weak")], [8, 8])
    assert costly.seen == [0, 8]
    assert trees[0].tokens.tolist() == [5, 6, 7] and sorted(trees[1].tokens.tolist()) == [5, 9]
    always = create_drafter("hybrid:fixed_a+fixed_costly", TARGET, {"fallback_below": 1e9})
    always.parts[0].trees["strong"] = a.trees["strong"]
    always.propose([_req("strong")], [8])
    assert always.parts[1].seen == [8]
    with pytest.raises(ValueError, match="fallback_below"):
        create_drafter("hybrid:fixed_a+fixed_costly", TARGET, {"fallback_below": -1})


def test_a_part_that_drafts_by_level_without_catching_up_is_cheap():
    """Medusa's heads draft by level but have no model to catch up: they draft beside the cheap parts every step,
    not only where those fall short (as a fallback only, suffix+medusa fell from 1.19x to 1.11x)."""
    h = create_drafter("hybrid:fixed_a+fixed_levels", TARGET)
    a, levels = h.parts
    a.trees["strong"] = _tree([5, 6, 7], [-1, 0, 1], scores=np.log([0.95, 0.9, 0.85]))
    levels.trees["strong"] = _tree([9], [-1], scores=np.log([0.6]))
    h.propose([_req("strong")], [8])
    assert levels.seen == [8]
