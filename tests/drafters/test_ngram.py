"""The ``ngram`` drafter: matching, ranking, trie building, budgets, options and the registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.drafters import DraftRequest, TargetInfo, create_drafter, registered_drafters
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.ngram_match import build_ngram_tree, match_candidates, rank_continuations
from specserve.verify import DraftTree

TARGET = TargetInfo(vocab_size=100, hidden_size=8, num_layers=1, device=torch.device("cpu"), dtype=torch.float32)


def drafter(**options) -> NgramDrafter:
    return NgramDrafter(TARGET, **options)


def request(tokens, request_id: str = "r0") -> DraftRequest:
    return DraftRequest(request_id=request_id, token_ids=np.asarray(tokens, dtype=np.int64), temperature=0.0)


def propose(tokens, budget: int = 24, **options) -> DraftTree:
    (tree,) = drafter(**options).propose([request(tokens)], [budget])
    return tree


def as_lists(tree: DraftTree) -> tuple[list[int], list[int]]:
    return tree.tokens.tolist(), tree.parents.tolist()


def leaf_paths(tree: DraftTree) -> list[list[int]]:
    """Root→leaf paths as token sequences, in leaf index order."""
    return [[int(tree.tokens[i]) for i in path] for path in tree.paths()]


# ---- a plain-Python statement of the spec, compared against the numba kernels ---------------------


def reference_tree(ctx, min_n, max_n, branching, depth, cap) -> tuple[list[int], list[int]]:
    ctx = [int(t) for t in ctx]
    length = len(ctx)
    tokens: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}
    if cap <= 0:
        return tokens, parents
    leaves = 1  # the empty tree's leaf is the root
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = ctx[length - n :]
        groups: dict[tuple[int, ...], tuple[int, int]] = {}  # continuation -> (count, most recent start)
        for i in range(0, length - n):  # the occurrence must end before the last token
            if ctx[i : i + n] == suffix:
                j = i + n
                cont = tuple(ctx[j : j + depth])
                count, recent = groups.get(cont, (0, -1))
                groups[cont] = (count + 1, max(recent, j))
        for cont, _ in sorted(groups.items(), key=lambda kv: (-kv[1][0], -kv[1][1])):
            parent, t = -1, 0
            while t < len(cont) and (parent, cont[t]) in child_of:
                parent = child_of[(parent, cont[t])]
                t += 1
            if t == len(cont):
                continue
            if parent in parents:  # branching off a node that already has children
                if leaves >= branching:
                    continue
                leaves += 1
            while t < len(cont) and len(tokens) < cap:
                child_of[(parent, cont[t])] = len(tokens)
                tokens.append(cont[t])
                parents.append(parent)
                parent = len(tokens) - 1
                t += 1
            if len(tokens) >= cap:
                return tokens, parents
    return tokens, parents


# ---- hand-built contexts ---------------------------------------------------------------------------


def test_repeated_sequence_proposes_its_continuation_as_a_chain():
    tree = propose([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert as_lists(tree) == ([4, 5, 9, 1, 2, 3], [-1, 0, 1, 2, 3, 4])
    assert not tree.has_q


def test_two_continuations_branch_with_the_more_frequent_first():
    # after [1, 2]: "7 3" twice, "8 3" once but more recently -> frequency wins over recency
    ctx = [1, 2, 7, 3, 1, 2, 7, 3, 1, 2, 8, 3, 1, 2]
    tree = propose(ctx, max_ngram=2, depth=2)
    assert as_lists(tree) == ([7, 3, 8, 3], [-1, 0, -1, 2])
    assert [int(tree.tokens[c]) for c in tree.children(0)] == [7, 8]
    tree = propose(ctx, max_ngram=2, depth=1)
    assert as_lists(tree) == ([7, 8], [-1, -1])


def test_equal_frequency_is_ranked_most_recent_first():
    tree = propose([1, 2, 7, 1, 2, 8, 1, 2], max_ngram=2, depth=1)
    assert as_lists(tree) == ([8, 7], [-1, -1])


def test_shared_prefixes_share_nodes():
    # after [0]: "5 6 1" and "5 7 1" -> one node for 5, then a branch
    tree = propose([0, 5, 6, 1, 0, 5, 7, 1, 0], max_ngram=1, depth=3)
    assert as_lists(tree) == ([5, 7, 1, 6, 1], [-1, 0, 1, 0, 3])


def test_longer_ngram_match_beats_a_more_frequent_shorter_one():
    # suffix [9, 1, 2] was followed by 5 once; the shorter [1, 2] was followed by 6 twice
    ctx = [9, 1, 2, 5, 1, 2, 6, 1, 2, 6, 9, 1, 2]
    assert as_lists(propose(ctx, max_ngram=3, depth=1, branching=1)) == ([5], [-1])
    # with room for a second branch, the shorter n-gram fills it
    assert as_lists(propose(ctx, max_ngram=3, depth=1, branching=2)) == ([5, 6], [-1, -1])
    # without the longer n-gram, frequency decides
    assert as_lists(propose(ctx, max_ngram=2, depth=1, branching=2)) == ([6, 5], [-1, -1])
    assert as_lists(propose(ctx, min_ngram=3, max_ngram=3, depth=1, branching=4)) == ([5], [-1])


def test_branching_limits_leaves():
    ctx = [0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0]
    tree = propose(ctx, max_ngram=1, depth=1, branching=3)
    assert as_lists(tree) == ([5, 4, 3], [-1, -1, -1])
    assert int(tree.is_leaf.sum()) == 3


def test_budget_caps_node_count_and_truncates_the_last_continuation():
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert as_lists(propose(ctx, budget=3)) == ([4, 5, 9], [-1, 0, 1])
    assert as_lists(propose(ctx, budget=10, max_budget=2)) == ([4, 5], [-1, 0])
    assert propose(ctx, budget=0).num_nodes == 0
    branchy = [1, 2, 7, 3, 1, 2, 7, 3, 1, 2, 8, 3, 1, 2]
    # the more frequent continuation keeps its nodes; the second one is cut at the cap
    assert as_lists(propose(branchy, budget=3, max_ngram=2, depth=2)) == ([7, 3, 8], [-1, 0, -1])


def test_no_match_gives_the_empty_tree():
    assert propose([1, 2, 3, 4]).num_nodes == 0
    assert propose([7]).num_nodes == 0
    assert propose([]).num_nodes == 0
    # the last token itself is not an occurrence of the suffix
    assert propose([3, 3], min_ngram=2, max_ngram=2).num_nodes == 0
    # min_ngram excludes the only (short) match
    assert propose([1, 2, 5, 3, 2], min_ngram=2).num_nodes == 0
    assert propose([1, 2, 5, 3, 2], min_ngram=1).tokens.tolist() == [5, 3, 2]


def test_depth_limits_each_continuation():
    tree = propose([1, 2, 3, 4, 5, 9, 1, 2, 3], depth=2)
    assert as_lists(tree) == ([4, 5], [-1, 0])
    assert tree.max_depth == 2


def test_continuation_near_the_end_is_truncated_and_may_overlap_the_suffix():
    # [5, 6] occurs at 0; what follows runs into the end of the context: 7, 5, 6 (the suffix itself)
    assert as_lists(propose([5, 6, 7, 5, 6], max_ngram=2, depth=6)) == ([7, 5, 6], [-1, 0, 1])
    # a run: [7, 7] is followed by the root 7 only; the shorter [7] extends that path to 7, 7
    assert as_lists(propose([7, 7, 7], depth=6)) == ([7, 7], [-1, 0])


def test_a_truncated_recent_continuation_is_extended_without_using_a_branch():
    # after [1, 2]: j=8 "7 1 2" (cut by the end, most recent) and j=2 "7 1 2 8 1 2" extend one path
    ctx = [1, 2, 7, 1, 2, 8, 1, 2, 7, 1, 2]
    tree = propose(ctx, depth=6, branching=2)
    assert leaf_paths(tree) == [[8, 1, 2, 7, 1, 2], [7, 1, 2, 8, 1, 2]]
    assert as_lists(tree)[1] == [-1, 0, 1, 2, 3, 4, -1, 6, 7, 8, 9, 10]
    # one branch: the longest n-gram's continuation only
    assert leaf_paths(propose(ctx, depth=6, branching=1)) == [[8, 1, 2, 7, 1, 2]]


def test_higher_priority_continuations_keep_lower_node_indices():
    ctx = [1, 2, 7, 1, 2, 8, 1, 2, 7, 1, 2]
    tree = propose(ctx, depth=6, branching=2)
    first_children = tree.children(0)
    assert [int(tree.tokens[c]) for c in first_children] == [8, 7]
    assert first_children == sorted(first_children)


def test_batch_budgets_and_dtypes():
    d = drafter(depth=3)
    reqs = [
        request([1, 2, 3, 4, 5, 9, 1, 2, 3], "a"),
        request([1, 2, 3], "b"),
        # int32 ids; [4, 1, 4] -> "1 4" (cut by the end), then [4] -> "1 4 1" extends that path
        DraftRequest("c", np.asarray([4, 1, 4, 1, 4], dtype=np.int32), 1.0),
    ]
    trees = d.propose(reqs, [2, 5, 5])
    assert [as_lists(t) for t in trees] == [([4, 5], [-1, 0]), ([], []), ([1, 4, 1], [-1, 0, 1])]
    assert all(t.tokens.dtype == torch.int64 and t.parents.dtype == torch.int64 for t in trees)
    assert d.propose([], []) == []
    with pytest.raises(ValueError, match="budgets"):
        d.propose(reqs, [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        d.propose(reqs[:1], [-1])


def test_large_token_ids():
    big = 2**40
    assert propose([big, big + 1, big + 2, big, big + 1]).tokens.tolist() == [big + 2, big, big + 1]


# ---- kernels ---------------------------------------------------------------------------------------


def test_match_candidates_groups_starts_by_match_length():
    ctx = np.asarray([9, 1, 2, 5, 1, 2, 6, 1, 2, 6, 9, 1, 2], dtype=np.int64)
    starts, lens = match_candidates(ctx, 1, 4)
    # [9, 1, 2] ends at 2 (start 3); [1, 2] ends at 5, 8 (starts 6, 9); nothing else ends in 2
    assert starts.tolist() == [3, 9, 6]
    assert lens.tolist() == [3, 2, 2]
    starts, lens = match_candidates(ctx, 3, 4)
    assert starts.tolist() == [3] and lens.tolist() == [3]
    assert match_candidates(ctx[:1], 1, 4)[0].size == 0


def test_rank_continuations_counts_and_orders():
    ctx = np.asarray([1, 2, 7, 3, 1, 2, 7, 3, 1, 2, 8, 3, 1, 2], dtype=np.int64)
    starts, _ = match_candidates(ctx, 2, 2)
    reps, counts = rank_continuations(ctx, starts, 2)
    assert [ctx[r : r + 2].tolist() for r in reps] == [[7, 3], [8, 3]]
    assert counts.tolist() == [2, 1]
    assert reps.tolist() == [6, 10]  # the most recent start of each continuation


# ---- options and the registry ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, name",
    [
        ({"min_ngram": 0}, "min_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "max_ngram"),
        ({"max_ngram": 0}, "max_ngram"),
        ({"branching": 0}, "branching"),
        ({"depth": 0}, "depth"),
        ({"depth": 2.5}, "depth"),
        ({"depth": True}, "depth"),
        ({"max_budget": 0}, "max_budget"),
        ({"max_budget": "8"}, "max_budget"),
    ],
)
def test_option_validation(options, name):
    with pytest.raises(ValueError, match=name) as info:
        drafter(**options)
    assert ">=" in str(info.value)  # names the allowed range


def test_path_is_rejected():
    with pytest.raises(ValueError, match="the ngram drafter takes no path"):
        NgramDrafter(TARGET, "some/path")


def test_created_through_the_registry():
    assert "ngram" in registered_drafters()
    d = create_drafter("ngram", TARGET, {"depth": 3})
    assert isinstance(d, NgramDrafter) and d.name == "ngram"
    assert (d.min_ngram, d.max_ngram, d.branching, d.depth, d.max_budget) == (1, 4, 4, 3, 24)
    assert d.gives_probs is False and d.needs_hidden_states is False
    (tree,) = d.propose([request([1, 2, 3, 4, 5, 9, 1, 2, 3])], [24])
    assert tree.tokens.tolist() == [4, 5, 9]
    with pytest.raises(ValueError, match="unknown option"):
        create_drafter("ngram", TARGET, {"bogus": 1})
    with pytest.raises(ValueError, match="no path"):
        create_drafter("ngram:some/path", TARGET)
    # stateless: commit/release are accepted and change nothing
    d.on_commit([])
    d.release("r0")


# ---- properties ------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    vocab = draw(st.integers(1, 6))
    ctx = draw(st.lists(st.integers(0, vocab - 1), max_size=80))
    min_n = draw(st.integers(1, 3))
    max_n = draw(st.integers(min_n, 5))
    options = dict(
        min_ngram=min_n,
        max_ngram=max_n,
        branching=draw(st.integers(1, 5)),
        depth=draw(st.integers(1, 7)),
        max_budget=draw(st.integers(1, 30)),
    )
    budget = draw(st.integers(0, 40))
    return ctx, options, budget


def follows_a_suffix_match(ctx: list[int], path: list[int], min_n: int, max_n: int) -> bool:
    """Some occurrence of a suffix n-gram (min_n <= n <= max_n) ending before the last token is followed
    by ``path`` within the context."""
    length = len(ctx)
    for j in range(1, length):
        if ctx[j : j + len(path)] != path:
            continue
        for n in range(min_n, max_n + 1):
            if n <= j and ctx[j - n : j] == ctx[length - n :]:
                return True
    return False


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_trees_follow_the_context_and_respect_limits(case):
    ctx, options, budget = case
    tree = propose(ctx, budget=budget, **options)
    cap = min(budget, options["max_budget"])
    n = tree.num_nodes
    assert n <= cap
    DraftTree(tree.tokens.clone(), tree.parents.clone())  # valid (re-validated)
    # no duplicate sibling tokens
    siblings = list(zip(tree.parents.tolist(), tree.tokens.tolist()))
    assert len(siblings) == len(set(siblings))
    if n:
        assert tree.max_depth <= options["depth"]
        assert int(tree.is_leaf.sum()) <= options["branching"]
    for path in leaf_paths(tree):
        assert follows_a_suffix_match(ctx, path, options["min_ngram"], options["max_ngram"]), (ctx, path)
    # empty only when there is nothing to propose
    any_match = any(
        follows_a_suffix_match(ctx, [ctx[j]], options["min_ngram"], options["max_ngram"]) for j in range(1, len(ctx))
    )
    assert (n > 0) == (cap > 0 and any_match)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_the_plain_python_statement_of_the_ranking(case):
    ctx, options, budget = case
    tree = propose(ctx, budget=budget, **options)
    cap = min(budget, options["max_budget"])
    expected = reference_tree(
        ctx, options["min_ngram"], options["max_ngram"], options["branching"], options["depth"], cap
    )
    assert as_lists(tree) == expected


def test_kernel_agrees_with_reference_on_a_long_repetitive_context():
    rng = np.random.default_rng(0)
    motifs = [rng.integers(0, 50, size=int(rng.integers(3, 12))) for _ in range(8)]
    ctx = np.concatenate([motifs[int(rng.integers(0, 8))] for _ in range(200)]).astype(np.int64)
    for end in range(len(ctx) - 40, len(ctx)):
        got = build_ngram_tree(ctx[:end], 1, 4, 4, 6, 24)
        assert (got[0].tolist(), got[1].tolist()) == reference_tree(ctx[:end], 1, 4, 4, 6, 24)
