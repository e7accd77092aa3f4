"""DraftTree: hand-computed structure for small trees, validation, and properties of random trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.verify import DraftTree

T, F = True, False


def tree(tokens: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))


def mask(rows: list[list[bool]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# ---- hand-computed trees -------------------------------------------------------------------------


def test_chain():
    t = DraftTree.chain([5, 6, 7])
    assert t.parents.tolist() == [-1, 0, 1]
    assert torch.equal(
        t.ancestor_mask,
        mask([
            [T, F, F, F],
            [T, T, F, F],
            [T, T, T, F],
            [T, T, T, T],
        ]),
    )
    assert t.depths.tolist() == [1, 2, 3]
    assert t.positions(10).tolist() == [10, 11, 12, 13]
    assert t.max_depth == 3
    assert t.is_leaf.tolist() == [F, F, T]
    assert t.paths() == [[0, 1, 2]]
    assert t.path_to(1) == [0, 1]
    first_child, next_sibling = t.first_child_next_sibling
    assert first_child.tolist() == [0, 1, 2, -1]
    assert next_sibling.tolist() == [-1, -1, -1]
    assert [t.children(r) for r in range(4)] == [[0], [1], [2], []]


def test_fan():
    t = tree([1, 2, 3], [-1, -1, -1])
    assert torch.equal(
        t.ancestor_mask,
        mask([
            [T, F, F, F],
            [T, T, F, F],
            [T, F, T, F],
            [T, F, F, T],
        ]),
    )
    assert t.depths.tolist() == [1, 1, 1]
    assert t.positions(4).tolist() == [4, 5, 5, 5]
    assert t.max_depth == 1
    assert t.paths() == [[0], [1], [2]]
    first_child, next_sibling = t.first_child_next_sibling
    assert first_child.tolist() == [0, -1, -1, -1]
    assert next_sibling.tolist() == [1, 2, -1]
    assert t.children(0) == [0, 1, 2]


def test_mixed():
    #            root
    #          /      \
    #        n0        n1
    #       /  \        \
    #     n2    n3       n4
    #     |
    #     n5
    t = tree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2])
    assert torch.equal(
        t.ancestor_mask,
        mask([
            # root n0 n1 n2 n3 n4 n5
            [T, F, F, F, F, F, F],  # root
            [T, T, F, F, F, F, F],  # n0
            [T, F, T, F, F, F, F],  # n1
            [T, T, F, T, F, F, F],  # n2
            [T, T, F, F, T, F, F],  # n3
            [T, F, T, F, F, T, F],  # n4
            [T, T, F, T, F, F, T],  # n5
        ]),
    )
    assert t.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert t.positions(0).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.max_depth == 3
    assert t.is_leaf.tolist() == [F, F, F, T, T, T]
    assert t.paths() == [[0, 3], [1, 4], [0, 2, 5]]
    assert t.path_to(5) == [0, 2, 5]
    first_child, next_sibling = t.first_child_next_sibling
    assert first_child.tolist() == [0, 2, 4, 5, -1, -1, -1]
    assert next_sibling.tolist() == [1, -1, 3, -1, -1, -1]
    assert [t.children(r) for r in range(7)] == [[0, 1], [2, 3], [4], [5], [], [], []]


def test_interleaved_siblings_keep_index_order():
    # Siblings need not be contiguous: root's children are 0 and 2, n0's children are 1 and 3.
    t = tree([1, 2, 3, 4], [-1, 0, -1, 0])
    first_child, next_sibling = t.first_child_next_sibling
    assert first_child.tolist() == [0, 1, -1, -1, -1]
    assert next_sibling.tolist() == [2, 3, -1, -1]
    assert t.children(0) == [0, 2]
    assert t.children(1) == [1, 3]
    assert t.depths.tolist() == [1, 2, 1, 2]
    assert t.paths() == [[0, 1], [2], [0, 3]]


def test_empty():
    t = DraftTree.empty()
    assert t.num_nodes == 0
    assert torch.equal(t.ancestor_mask, mask([[T]]))
    assert t.depths.tolist() == []
    assert t.positions(7).tolist() == [7]
    assert t.max_depth == 0
    assert t.paths() == []
    first_child, next_sibling = t.first_child_next_sibling
    assert first_child.tolist() == [-1]
    assert next_sibling.tolist() == []
    assert t.children(0) == []
    assert DraftTree.from_paths([]).num_nodes == 0
    assert DraftTree.chain([]).num_nodes == 0


def test_from_paths_merges_shared_prefixes():
    t = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3]])
    assert t.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert t.parents.tolist() == [-1, 0, 1, 1, 0, -1]
    assert t.paths() == [[0, 1, 2], [0, 1, 3], [0, 4], [5]]
    assert t.children(0) == [0, 5]  # earlier paths first
    # The same token under different parents is two nodes.
    t2 = DraftTree.from_paths([[7, 7], [8, 7]])
    assert t2.tokens.tolist() == [7, 7, 8, 7]
    assert t2.parents.tolist() == [-1, 0, -1, 2]


def test_chain_keeps_probs():
    probs = torch.full((2, 4), 0.25)
    t = DraftTree.chain([1, 2], probs=probs)
    assert t.probs is probs
    assert t.parents.tolist() == [-1, 0]


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parents",
    [
        [0],  # parents[0] must be -1
        [-1, 1],  # a node cannot be its own parent
        [-1, 2, 0],  # parents must come first
        [-1, -2],  # -1 is the only negative value allowed
    ],
)
def test_rejects_bad_parents(parents):
    with pytest.raises(ValueError, match="parents"):
        tree(list(range(len(parents))), parents)


def test_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="one length"):
        tree([1, 2, 3], [-1, 0])
    with pytest.raises(ValueError, match="1-D"):
        DraftTree(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64))


def test_rejects_bad_types_and_tokens():
    with pytest.raises(TypeError, match="int64"):
        DraftTree(torch.tensor([1], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(TypeError, match="torch tensors"):
        DraftTree([1], [-1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        tree([-3], [-1])


def test_rejects_bad_probs_shape():
    tokens = torch.tensor([1, 2], dtype=torch.int64)
    parents = torch.tensor([-1, 0], dtype=torch.int64)
    with pytest.raises(ValueError, match="probs"):
        DraftTree(tokens, parents, torch.full((3, 4), 0.25))
    with pytest.raises(ValueError, match="probs"):
        DraftTree(tokens, parents, torch.full((2,), 0.5))


# ---- properties of random trees ------------------------------------------------------------------


@st.composite
def parent_arrays(draw, max_nodes: int = 24) -> list[int]:
    n = draw(st.integers(0, max_nodes))
    return [draw(st.integers(-1, i - 1)) for i in range(n)]


def walk_depth(parents: list[int], i: int) -> int:
    d = 0
    while i != -1:
        i, d = parents[i], d + 1
    return d


@settings(max_examples=200, deadline=None)
@given(parent_arrays())
def test_random_tree_properties(parents):
    n = len(parents)
    t = tree([7] * n, parents)
    m = t.ancestor_mask
    assert m.shape == (n + 1, n + 1) and m.dtype == torch.bool
    assert bool(m.diagonal().all())  # reflexive
    assert bool(m[:, 0].all())  # the root is everyone's ancestor
    assert torch.equal(m, m.tril())  # ancestors have lower indices
    for i, p in enumerate(parents):
        expected = m[p + 1].clone()
        expected[i + 1] = True
        assert torch.equal(m[i + 1], expected)  # mask[i] == mask[parent] | self
        path = t.path_to(i)
        assert t.depths[i] == len(path) == walk_depth(parents, i)
        assert path[-1] == i and all(parents[b] == a for a, b in zip([-1, *path], path))
    assert t.positions(3).tolist() == [3] + [3 + walk_depth(parents, i) for i in range(n)]
    for r in range(n + 1):
        assert t.children(r) == [i for i, p in enumerate(parents) if p + 1 == r]
    leaves = [i for i in range(n) if i not in parents]
    assert t.is_leaf.tolist() == [i in leaves for i in range(n)]
    assert t.paths() == [t.path_to(i) for i in leaves]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=8))
def test_from_paths_is_a_trie(paths):
    t = DraftTree.from_paths(paths)
    tokens = t.tokens.tolist()
    # every inserted path is a root→node path of the tree
    node_paths = {tuple(tokens[j] for j in t.path_to(i)) for i in range(t.num_nodes)}
    assert {tuple(p) for p in paths} <= node_paths
    # and every node is a prefix of some inserted path; no two siblings share a token
    assert node_paths == {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}
    for r in range(t.num_nodes + 1):
        kids = [tokens[i] for i in t.children(r)]
        assert len(kids) == len(set(kids))
