"""Greedy acceptance: hand-built cases, a reference walk, and equality with plain greedy decoding."""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np

from specserve.verify import DraftTree, VerifyResult, accept_trees, greedy_accept, pack_trees


def tree(tokens: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))


def tt(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64)


# ---- hand-built ----------------------------------------------------------------------------------


def test_empty_tree_is_plain_decoding():
    r = greedy_accept(DraftTree.empty(), tt(42))
    assert r == VerifyResult((), (), 42, 0)
    assert r.emitted_tokens == [42]


def test_chain_all_right_accepts_all_plus_bonus():
    # target argmax per row: root->5, after 5->6, after 6->7, after 7->8
    r = greedy_accept(DraftTree.chain([5, 6, 7]), tt(5, 6, 7, 8))
    assert r.accepted_nodes == (0, 1, 2)
    assert r.accepted_tokens == (5, 6, 7)
    assert r.bonus_token == 8
    assert r.num_drafted == 3 and r.num_accepted == 3
    assert r.emitted_tokens == [5, 6, 7, 8]


def test_chain_all_wrong_accepts_none():
    r = greedy_accept(DraftTree.chain([1, 2, 3]), tt(9, 2, 3, 4))
    assert r.accepted_nodes == () and r.accepted_tokens == ()
    assert r.bonus_token == 9  # the root's argmax
    assert r.num_drafted == 3


def test_chain_stops_at_first_mismatch_even_if_later_rows_match():
    # node 1 is wrong (target wants 8 after 5); node 2 "matches" its row but its parent was rejected.
    r = greedy_accept(DraftTree.chain([5, 6, 7]), tt(5, 8, 7, 1))
    assert r.accepted_nodes == (0,)
    assert r.bonus_token == 8


def test_branch_chooses_the_matching_child():
    t = tree([3, 4, 5], [-1, -1, -1])
    for target_root, node in [(3, 0), (4, 1), (5, 2)]:
        rows = tt(target_root, 10, 11, 12)  # rows 1..3 are the children's next tokens
        r = greedy_accept(t, rows)
        assert r.accepted_nodes == (node,)
        assert r.accepted_tokens == (target_root,)
        assert r.bonus_token == int(rows[node + 1])


def test_deepest_among_branches():
    #        root
    #       /    \
    #     n0=1   n1=1 (duplicate sibling token)
    #      |       |
    #     n2=2   n3=2
    #              |
    #            n4=3
    t = tree([1, 1, 2, 2, 3], [-1, -1, 0, 1, 3])
    # rows:      root n0 n1 n2 n3 n4
    r = greedy_accept(t, tt(1, 2, 2, 9, 3, 7))
    assert r.accepted_nodes == (1, 3, 4)  # n0's branch matches too but is shallower
    assert r.accepted_tokens == (1, 2, 3)
    assert r.bonus_token == 7
    # break n4: both branches reach depth 2; the tie goes to the lower node index (n2)
    r = greedy_accept(t, tt(1, 2, 2, 9, 8, 7))
    assert r.accepted_nodes == (0, 2)
    assert r.bonus_token == 9


def test_mixed_tree_second_branch():
    t = DraftTree.from_paths([[1, 2, 3], [1, 4, 5], [6]])  # tokens 1,2,3,4,5,6 parents -1,0,1,0,3,-1
    # rows:   root n0 n1 n2 n3 n4 n5
    r = greedy_accept(t, tt(1, 4, 0, 0, 5, 0, 0))
    assert r.accepted_nodes == (0, 3, 4)
    assert r.accepted_tokens == (1, 4, 5)
    assert r.bonus_token == 0


def test_rejects_bad_target_shape_and_dtype():
    t = DraftTree.chain([1, 2])
    with pytest.raises(ValueError, match="N\\+1"):
        greedy_accept(t, tt(1, 2))
    with pytest.raises(TypeError, match="int64"):
        greedy_accept(t, torch.tensor([1, 2, 3], dtype=torch.int32))


# ---- reference walk and plain greedy decoding ----------------------------------------------------


def reference_greedy(tokens: list[int], parents: list[int], target: list[int]) -> tuple[list[int], int]:
    """Obviously correct: check every node's whole path; keep the deepest, then the lowest index."""
    best: list[int] = []
    for i in range(len(tokens)):
        path, j = [], i
        while j != -1:
            path.append(j)
            j = parents[j]
        path.reverse()
        if all(tokens[j] == target[parents[j] + 1] for j in path) and len(path) > len(best):
            best = path
    bonus = target[best[-1] + 1] if best else target[0]
    return best, bonus


@st.composite
def trees_and_targets(draw, vocab: int = 3, max_nodes: int = 20):
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    target = draw(st.lists(st.integers(0, vocab - 1), min_size=n + 1, max_size=n + 1))
    return tokens, parents, target


@settings(max_examples=200, deadline=None)
@given(trees_and_targets())
def test_matches_reference_walk(case):
    tokens, parents, target = case
    r = greedy_accept(tree(tokens, parents), torch.tensor(target, dtype=torch.int64))
    path, bonus = reference_greedy(tokens, parents, target)
    assert list(r.accepted_nodes) == path
    assert list(r.accepted_tokens) == [tokens[j] for j in path]
    assert r.bonus_token == bonus
    assert r.num_drafted == len(tokens)


def greedy_next(prefix: tuple[int, ...], vocab: int) -> int:
    """A deterministic 'target model': argmax as a fixed hash of the whole prefix."""
    return zlib.crc32(repr(prefix).encode()) % vocab


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), max_size=6),
    st.lists(st.integers(0, 2), max_size=3),
)
def test_equals_plain_greedy_decoding(paths, context):
    """Speculative greedy output == plain greedy output, token for token, for any draft tree."""
    vocab = 3
    t = DraftTree.from_paths(paths)
    tokens = t.tokens.tolist()
    ctx = tuple(context)
    rows = [greedy_next(ctx, vocab)]
    for i in range(t.num_nodes):
        rows.append(greedy_next(ctx + tuple(tokens[j] for j in t.path_to(i)), vocab))
    r = greedy_accept(t, torch.tensor(rows, dtype=torch.int64))

    plain, seq = [], ctx
    for _ in range(len(r.emitted_tokens)):
        plain.append(greedy_next(seq, vocab))
        seq += (plain[-1],)
    assert r.emitted_tokens == plain
    # and nothing longer was available: the tree holds no path equal to a longer greedy prefix
    seq = ctx + tuple(plain)
    longer = tuple(plain) + (greedy_next(seq, vocab),)
    node_paths = {tuple(tokens[j] for j in t.path_to(i)) for i in range(t.num_nodes)}
    assert longer[: r.num_accepted + 1] not in node_paths


# ---- batch hand-off (greedy side; the sampled side is in test_accept_stochastic) -----------------


def test_packed_rows_and_links():
    trees = [DraftTree.chain([1, 2]), DraftTree.empty(), DraftTree.from_paths([[3, 4], [5]])]
    packed = pack_trees(trees)
    assert packed.cu_rows.tolist() == [0, 3, 4, 8] and packed.cu_nodes.tolist() == [0, 2, 2, 5]
    assert packed.tokens.tolist() == [1, 2, 3, 4, 5]
    assert packed.parent_row.tolist() == [0, 1, 4, 5, 4]  # global rows: request 2's root is row 4
    assert packed.first_child.tolist() == [0, 1, -1, -1, 2, 3, -1, -1]
    assert packed.next_sibling.tolist() == [-1, -1, 4, -1, -1]
    assert packed.depth.tolist() == [1, 2, 1, 2, 1]
    assert packed.node_rows().tolist() == [1, 2, 5, 6, 7]
    assert packed.q_ids[:, 0].tolist() == [1, 2, 3, 4, 5] and packed.q_probs[:, 0].tolist() == [1.0] * 5


def test_accept_trees_greedy_equals_per_tree():
    trees = [DraftTree.chain([5, 6, 7]), DraftTree.empty(), DraftTree.from_paths([[1, 2], [3]])]
    per_tree = [tt(5, 6, 0, 1), tt(9), tt(3, 2, 0, 4)]
    flat = torch.cat(per_tree)
    packed = pack_trees(trees)
    results = accept_trees(trees, packed, np.ones(3, dtype=bool), flat, None, np.full(8, -1), np.zeros(0))
    assert results == [greedy_accept(t, rows) for t, rows in zip(trees, per_tree)]
    assert [r.emitted_tokens for r in results] == [[5, 6, 0], [9], [3, 4]]
