"""EAGLE-2 dynamic tree construction (drafters/eagle_tree.py) against hand-computed cases: expansion of
the top-k frontier, reranking and the budget cut, ancestor closure and ties, the tail masks drafting
feeds with, batches of requests with different depths, and sampled trees' value-independent shape."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.drafters.eagle_tree import SAMPLED_SIBLING_LOGP, DynamicTree


def logq(*rows: list[float]) -> torch.Tensor:
    """Rows of probabilities over a 6-token vocabulary (rest of the mass spread evenly) → log q [R, 6]."""
    out = []
    for row in rows:
        p = torch.tensor(row + [0.0] * (6 - len(row)))
        rest = 1.0 - float(p.sum())
        p = torch.where(p == 0, torch.tensor(max(rest, 0.0) / max(int((p == 0).sum()), 1)), p)
        out.append(p.log())
    return torch.stack(out)


def build(budget: int, k: int = 2, depth: int = 3):
    """The worked example: probabilities (hence scores) by hand.

    level 1 (root):           t0 .5, t1 .3                        -> n0 = .5, n1 = .3
    level 2, frontier [n0, n1]: n0 -> t2 .58, t3 .2; n1 -> t0 .9, t4 .05
                              -> n2 = .29, n3 = .10, n4 = .27, n5 = .015
    level 3, frontier [n2, n4]: n2 -> t5 .7, t1 .2; n4 -> t3 .5, t2 .4
                              -> n6 = .203, n7 = .058, n8 = .135, n9 = .108
    """
    tree = DynamicTree(k, depth, [False], [None], 6)
    f1 = tree.add_level(logq([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])[None])
    assert f1.nodes.tolist() == [[0, 1]] and f1.parent_slot.tolist() == [[0, 0]]
    if depth >= 2:
        f2 = tree.add_level(logq([0.05, 0.05, 0.58, 0.2, 0.07, 0.05], [0.9, 0.01, 0.01, 0.01, 0.05, 0.02])[None])
        assert f2.nodes.tolist() == [[2, 4]] and f2.tokens.tolist() == [[2, 0]] and f2.parent_slot.tolist() == [[0, 1]]
    if depth >= 3:
        tree.add_level(logq([0.01, 0.2, 0.04, 0.03, 0.02, 0.7], [0.03, 0.03, 0.4, 0.5, 0.02, 0.02])[None])
    return tree


def test_worked_example_scores_and_parents():
    tree = build(10)
    expected = [0.5, 0.3, 0.29, 0.10, 0.27, 0.015, 0.203, 0.058, 0.135, 0.108]
    torch.testing.assert_close(tree.scores[0].exp(), torch.tensor(expected), atol=1e-6, rtol=1e-5)
    assert tree.tokens[0].tolist() == [0, 1, 2, 3, 0, 4, 5, 1, 3, 2]
    assert tree.parents[0].tolist() == [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]


@pytest.mark.parametrize("budget, tokens, parents", [
    (1, [0], [-1]),
    (3, [0, 1, 2], [-1, -1, 0]),
    (5, [0, 1, 2, 0, 5], [-1, -1, 0, 1, 2]),  # n0 .5, n1 .3, n2 .29, n4 .27, n6 .203
    (7, [0, 1, 2, 0, 5, 3, 2], [-1, -1, 0, 1, 2, 3, 3]),  # + n8 .135, n9 .108
    (100, [0, 1, 2, 3, 0, 4, 5, 1, 3, 2], [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]),  # every generated node
])
def test_cut_keeps_the_best_nodes_parents_first(budget, tokens, parents):
    ((got_tokens, got_parents, probs),) = build(budget).finish([budget])
    assert got_tokens.tolist() == tokens and got_parents.tolist() == parents and probs is None


def test_chain_mode_is_the_greedy_path():
    tree = DynamicTree(1, 3, [False], [None], 6)
    f = tree.add_level(logq([0.1, 0.6, 0.1])[None])
    assert f.tokens.tolist() == [[1]]
    f = tree.add_level(logq([0.1, 0.1, 0.1, 0.5])[None])
    tree.add_level(logq([0.7])[None])
    ((tokens, parents, _),) = tree.finish([3])
    assert tokens.tolist() == [1, 3, 0] and parents.tolist() == [-1, 0, 1]
    ((tokens, parents, _),) = tree.finish([2])
    assert tokens.tolist() == [1, 3]


def test_ties_go_to_the_lower_index_and_keep_ancestors():
    """A child with q = 1 ties its parent; the parent (lower index) ranks first, so the cut stays closed."""
    tree = DynamicTree(2, 2, [False], [None], 3)
    certain = torch.tensor([0.0, -math.inf, -math.inf])  # q = one-hot on token 0
    tree.add_level(torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]])[None])
    tree.add_level(torch.stack([certain, certain])[None])  # second children are impossible (-inf): not nodes
    assert torch.isinf(tree.scores[0, [3, 5]]).all()
    for budget, tokens, parents in ((1, [0], [-1]), (2, [0, 1], [-1, -1]), (3, [0, 1, 0], [-1, -1, 0]),
                                    (9, [0, 1, 0, 0], [-1, -1, 0, 1])):
        ((t, p, _),) = tree.finish([budget])
        assert t.tolist() == tokens and p.tolist() == parents, budget


def test_batched_requests_with_different_depths_match_single_builds():
    """Request 1 stops after level 1 (the drafter feeds only requests whose depth allows the next level)."""
    rows1 = [logq([0.5, 0.3, 0.1]), logq([0.2, 0.25, 0.4])]
    tree = DynamicTree(2, 3, [False, False], [None, None], 6)
    tree.add_level(torch.cat(rows1)[:, None])
    lvl2 = logq([0.05, 0.05, 0.58, 0.2], [0.9, 0.01, 0.01, 0.01, 0.05])
    tree.add_level(lvl2[None], torch.tensor([0]))
    tree.add_level(logq([0.01, 0.2, 0.04, 0.03, 0.02, 0.7], [0.03, 0.03, 0.4, 0.5])[None], torch.tensor([0]))
    (a_tokens, a_parents, _), (b_tokens, b_parents, _) = tree.finish([5, 5])
    ((ref_tokens, ref_parents, _),) = build(5).finish([5])
    assert a_tokens.tolist() == ref_tokens.tolist() and a_parents.tolist() == ref_parents.tolist()
    assert b_tokens.tolist() == [2, 1]  # its two level-1 nodes only, best first
    assert b_parents.tolist() == [-1, -1]


def test_feed_masks_follow_ancestry():
    """Frontier slot f of level d is fed at slot (d-1)k + f and sees exactly its fed ancestors and itself."""
    tree = build(10)
    # level-1 frontier [n0, n1] at fed slots 0, 1: each sees itself
    assert tree.feed_mask(1, 0).tolist() == [[True, False], [False, True]]
    # level-2 frontier [n2 (child of n0, slot 0), n4 (child of n1, slot 1)] at fed slots 2, 3
    assert tree.feed_mask(2, 0).tolist() == [[True, False, True, False], [False, True, False, True]]


def test_invalid_requests_and_shapes_are_refused():
    tree = DynamicTree(2, 2, [False], [None], 6)
    with pytest.raises(ValueError, match="logq has shape"):
        tree.add_level(torch.zeros(1, 2, 6))
    tree.add_level(torch.zeros(1, 1, 6).log_softmax(-1))
    tree.add_level(torch.zeros(1, 2, 6).log_softmax(-1))
    with pytest.raises(ValueError, match="no level 3"):
        tree.add_level(torch.zeros(1, 2, 6).log_softmax(-1))


def test_sampled_trees_have_a_value_independent_shape_and_exact_probs():
    """Sampled siblings are scored by rank (log .8 + j log .2): every seed gives the same parents,
    the kept siblings are each parent's first draws, and probs[j] is q without siblings 0..j-1."""
    q1 = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    shapes = set()
    draws = set()
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        tree = DynamicTree(2, 3, [True], [gen], 6)
        f = tree.add_level(q1.log()[None, None])
        for _ in range(2):
            # the next distributions depend on the drawn tokens (as a head's would)
            rows = torch.stack([torch.roll(q1, int(t)) for t in f.tokens[0]])
            f = tree.add_level(rows.log()[None])
        ((tokens, parents, probs),) = tree.finish([6])
        shapes.add(tuple(parents.tolist()))
        draws.add(tuple(tokens.tolist()))
        assert probs.shape == (6, 6)
        torch.testing.assert_close(probs.sum(-1), torch.ones(6))
        roots = [i for i, p in enumerate(parents.tolist()) if p == -1]
        first = q1.clone()
        torch.testing.assert_close(probs[roots[0]], first)
        second = q1.clone()
        second[tokens[roots[0]]] = 0
        torch.testing.assert_close(probs[roots[1]], second / second.sum())
        assert all(float(probs[i, t]) > 0 for i, t in enumerate(tokens.tolist()))
    expected_scores = sorted([SAMPLED_SIBLING_LOGP[0], SAMPLED_SIBLING_LOGP[1]])
    assert torch.allclose(tree.scores[0, :2].sort().values, torch.tensor(expected_scores))
    assert len(shapes) == 1 and len(draws) > 1


def test_mixed_greedy_and_sampled_rows():
    gen = torch.Generator().manual_seed(0)
    tree = DynamicTree(2, 1, [False, True], [None, gen], 6)
    tree.add_level(logq([0.5, 0.3], [0.5, 0.3])[:, None])
    (g_tokens, _, g_probs), (s_tokens, _, s_probs) = tree.finish([2, 2])
    assert g_tokens.tolist() == [0, 1] and g_probs is None
    assert s_probs is not None and s_probs.shape == (2, 6) and len(set(s_tokens.tolist())) == 2
