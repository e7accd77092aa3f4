"""The shared dynamic tree builder (drafters/tree_builder.py) against hand-computed cases: expansion of
the top-W frontier, reranking and the budget cut, ancestor closure and ties, the tail masks drafting
feeds with, batches of requests with different depths, sampled trees' value-independent shape and the
exact compact q of every drawn sibling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specserve.drafters.tree_builder import SAMPLED_SIBLING_LOGP, TreeBuilder, log_normalizer


def greedy_builder(k: int, depth: int, requests: int = 1, vocab: int = 6, width: int | None = None) -> TreeBuilder:
    return TreeBuilder(k, depth, width or k, np.zeros(requests, dtype=np.float32), None, vocab)


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
    tree = greedy_builder(k, depth)
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
    np.testing.assert_allclose(np.exp(tree.scores[0]), expected, atol=1e-6, rtol=1e-5)
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
    ((got_tokens, got_parents, q_ids, q_probs, _),) = build(budget).finish([budget])
    assert got_tokens.tolist() == tokens and got_parents.tolist() == parents and q_ids is None and q_probs is None


def test_chain_mode_is_the_greedy_path():
    tree = greedy_builder(1, 3)
    f = tree.add_level(logq([0.1, 0.6, 0.1])[None])
    assert f.tokens.tolist() == [[1]]
    f = tree.add_level(logq([0.1, 0.1, 0.1, 0.5])[None])
    tree.add_level(logq([0.7])[None])
    ((tokens, parents, _, _, _),) = tree.finish([3])
    assert tokens.tolist() == [1, 3, 0] and parents.tolist() == [-1, 0, 1]
    ((tokens, parents, _, _, _),) = tree.finish([2])
    assert tokens.tolist() == [1, 3]


def test_ties_go_to_the_lower_index_and_keep_ancestors():
    """A child with q = 1 ties its parent; the parent (lower index) ranks first, so the cut stays closed."""
    tree = greedy_builder(2, 2, vocab=3)
    certain = torch.tensor([0.0, -math.inf, -math.inf])  # q = one-hot on token 0
    tree.add_level(torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]])[None])
    tree.add_level(torch.stack([certain, certain])[None])  # second children are impossible (-inf): not nodes
    assert np.isinf(tree.scores[0, [3, 5]]).all()
    for budget, tokens, parents in ((1, [0], [-1]), (2, [0, 1], [-1, -1]), (3, [0, 1, 0], [-1, -1, 0]),
                                    (9, [0, 1, 0, 0], [-1, -1, 0, 1])):
        ((t, p, _, _, _),) = tree.finish([budget])
        assert t.tolist() == tokens and p.tolist() == parents, budget


def test_batched_requests_with_different_depths_match_single_builds():
    """Request 1 stops after level 1 (the drafter feeds only requests whose depth allows the next level)."""
    rows1 = [logq([0.5, 0.3, 0.1]), logq([0.2, 0.25, 0.4])]
    tree = greedy_builder(2, 3, requests=2)
    tree.add_level(torch.cat(rows1)[:, None])
    lvl2 = logq([0.05, 0.05, 0.58, 0.2], [0.9, 0.01, 0.01, 0.01, 0.05])
    tree.add_level(lvl2[None], np.array([0]))
    tree.add_level(logq([0.01, 0.2, 0.04, 0.03, 0.02, 0.7], [0.03, 0.03, 0.4, 0.5])[None], np.array([0]))
    (a_tokens, a_parents, _, _, _), (b_tokens, b_parents, _, _, _) = tree.finish([5, 5])
    ((ref_tokens, ref_parents, _, _, _),) = build(5).finish([5])
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
    tree = greedy_builder(2, 2)
    with pytest.raises(ValueError, match="logits have shape"):
        tree.add_level(torch.zeros(1, 2, 6))
    tree.add_level(torch.zeros(1, 1, 6).log_softmax(-1))
    tree.add_level(torch.zeros(1, 2, 6).log_softmax(-1))
    with pytest.raises(ValueError, match="no level 3"):
        tree.add_level(torch.zeros(1, 2, 6).log_softmax(-1))


def test_sampled_trees_have_a_value_independent_shape_and_exact_probs():
    """Sampled siblings are scored by rank (log .8 + j log .2): every seed gives the same parents,
    the kept siblings are each parent's first draws, and a node's q is q without siblings 0..j-1."""
    q1 = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    shapes = set()
    draws = set()
    for seed in range(8):
        rng = np.random.default_rng(seed)
        tree = TreeBuilder(2, 3, 2, np.ones(1, dtype=np.float32), rng.random((1, 2 + 2 * 2 * 2)), 6)
        f = tree.add_level(q1.log()[None, None])
        for _ in range(2):
            # the next distributions depend on the drawn tokens (as a head's would)
            rows = torch.stack([torch.roll(q1, int(t)) for t in f.tokens[0]])
            f = tree.add_level(rows.log()[None])
        ((tokens, parents, q_ids, q_probs, _),) = tree.finish([6])
        shapes.add(tuple(parents.tolist()))
        draws.add(tuple(tokens.tolist()))
        probs = dense(q_ids, q_probs, 6)
        np.testing.assert_allclose(probs.sum(-1), np.ones(6), rtol=1e-6)
        roots = [i for i, p in enumerate(parents.tolist()) if p == -1]
        np.testing.assert_allclose(probs[roots[0]], q1.numpy(), rtol=1e-6)
        second = q1.clone()
        second[tokens[roots[0]]] = 0
        np.testing.assert_allclose(probs[roots[1]], (second / second.sum()).numpy(), rtol=1e-6)
        assert all(float(probs[i, t]) > 0 for i, t in enumerate(tokens.tolist()))
    expected_scores = sorted([SAMPLED_SIBLING_LOGP[0], SAMPLED_SIBLING_LOGP[1]])
    np.testing.assert_allclose(np.sort(tree.scores[0, :2]), expected_scores)
    assert len(shapes) == 1 and len(draws) > 1


def test_sampled_q_is_the_top_support_renormalised():
    """Past DRAFT_Q_SUPPORT tokens the draft's mass is dropped: q is softmax(logits / T) over the
    support, renormalised — the distribution the node was really drawn from."""
    vocab = 100
    logits = torch.linspace(0, 5, vocab)
    tree = TreeBuilder(1, 1, 1, np.full(1, 0.7, dtype=np.float32), np.full((1, 1), 0.5), vocab, q_support=8)
    tree.add_level(logits[None, None])
    ((tokens, _, q_ids, q_probs, _),) = tree.finish([1])
    top = torch.softmax(logits / 0.7, -1).topk(8)
    assert sorted(q_ids[0].tolist()) == sorted(top.indices.tolist())
    np.testing.assert_allclose(dense(q_ids, q_probs, vocab)[0][top.indices.numpy()],
                               (top.values / top.values.sum()).numpy(), rtol=1e-5)
    assert int(tokens[0]) in top.indices.tolist()


def test_mixed_greedy_and_sampled_rows():
    tree = TreeBuilder(2, 1, 2, np.array([0.0, 1.0], dtype=np.float32), np.random.default_rng(0).random((2, 2)), 6)
    tree.add_level(logq([0.5, 0.3], [0.5, 0.3])[:, None])
    (g_tokens, _, g_ids, _, _), (s_tokens, _, s_ids, s_probs, _) = tree.finish([2, 2])
    assert g_tokens.tolist() == [0, 1] and g_ids is None
    assert s_ids is not None and s_probs.shape[0] == 2 and len(set(s_tokens.tolist())) == 2


def test_width_expands_more_nodes_than_topk():
    """width W > topk: the W best nodes of a level each get topk children (the draft model's trees)."""
    tree = greedy_builder(1, 2, width=2)
    tree.add_level(logq([0.6, 0.4])[None])  # one child only (topk 1): n0 = token 0
    f = tree.add_level(logq([0.1, 0.9], [0.5, 0.5])[None])
    assert f.nodes.tolist() == [[1, -1]]  # level 2 has one node: the frontier's second slot is empty
    ((tokens, parents, _, _, _),) = tree.finish([5])
    assert tokens.tolist() == [0, 1] and parents.tolist() == [-1, 0]


def dense(q_ids: np.ndarray, q_probs: np.ndarray, vocab: int) -> np.ndarray:
    out = np.zeros((q_ids.shape[0], vocab))
    for i in range(q_ids.shape[0]):
        for t, p in zip(q_ids[i], q_probs[i]):
            if t >= 0:
                out[i, t] += p
    return out


def test_draw_siblings_stops_when_the_support_is_spent():
    """Two tokens with mass, three siblings asked: exactly two are drawn (each once) whatever the
    uniforms — the spent support must not leave a rounding residue that 'draws' token -1."""
    from specserve.drafters.tree_builder import draw_siblings

    row = np.full(100, -np.inf, np.float32)
    row[[3, 7]] = [0.1, 0.37]
    support = 32
    rng = np.random.default_rng(0)
    for _ in range(500):
        q_ids, q_probs = np.full((3, support), -1, np.int64), np.zeros((3, support), np.float32)
        tokens = np.zeros(3, np.int64)
        drawn = draw_siblings(row, 1.0, 3, rng.random(3), q_ids, q_probs, tokens, np.empty(support, np.int64),
                              np.empty(support, np.float64), np.empty(support, np.float64))
        assert drawn == 2 and sorted(tokens[:2].tolist()) == [3, 7]


@pytest.mark.parametrize("length", [1, 15, 16, 37, 4096, 4100])
def test_log_normalizer_is_the_rows_log_sum_exp(length):
    """`log_normalizer` (16 lanes at a time, a tail one by one) against log Σ exp in float64, with masked (-inf)
    columns adding nothing; a row masked everywhere gives -inf."""
    rng = np.random.default_rng(length)
    row = (rng.standard_normal(length) * 4).astype(np.float32)
    row[rng.random(length) < 0.3] = -np.inf
    row[0] = 1.5  # at least one visible column
    finite = row[np.isfinite(row)].astype(np.float64)
    expected = finite.max() + np.log(np.exp(finite - finite.max()).sum())
    assert log_normalizer(row) == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert log_normalizer(np.full(length, -np.inf, dtype=np.float32)) == -np.inf
