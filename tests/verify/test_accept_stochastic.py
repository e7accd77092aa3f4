"""Stochastic acceptance is lossless: the emitted tokens follow the target distribution exactly.

The statistical check: a synthetic target model p(next | prefix) over a small vocabulary, a draft
tree per trial (fixed, or drawn from a draft model q), `accept_trees` on a thousand trials' trees at
once (as the engine accepts a step's requests; `test_accept_trees_mixed_equals_per_tree_calls` ties it
to `stochastic_accept` on one tree), and a chi-square test of the joint distribution of the first K
emitted tokens against prod_k p(t_k | t_<k). When a trial emits fewer than K tokens, the rest are
sampled directly from the target, so the K-token joint is exactly the target's whenever the verifier
is. The same check rejects deliberately broken verifiers (`test_check_has_power`), so a pass means
something.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from specserve.verify import (
    DraftTree,
    VerifyResult,
    accept_trees,
    draw_uniforms,
    greedy_accept,
    pack_trees,
    stochastic_accept,
)
from specserve.verify.accept import RESIDUAL_EPS

ALPHA = 1e-3
TRIALS = 20_000  # per statistical check; the power tests below need only POWER_TRIALS
POWER_TRIALS = 5_000
CTX = (1,)  # committed tokens before the root row


# ---- synthetic models ----------------------------------------------------------------------------


class TableModel:
    """p(next | prefix) from a fixed seeded table: Dirichlet(1)-like weights, some entries zeroed.

    ``zeros`` entries per row are set to 0 (like top-k / top-p truncation); ``overrides`` pins the
    distribution for chosen prefixes; ``transform`` reshapes a row (e.g. to build a draft model that
    disagrees with the target).
    """

    def __init__(
        self,
        seed: int,
        vocab: int,
        zeros: int = 1,
        overrides: dict[tuple[int, ...], list[float]] | None = None,
        transform: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor] | None = None,
    ):
        self.seed, self.vocab, self.zeros = seed, vocab, zeros
        self.overrides = overrides or {}
        self.transform = transform
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """float64[V], sums to 1."""
        if prefix not in self._cache:
            if prefix in self.overrides:
                w = torch.tensor(self.overrides[prefix], dtype=torch.float64)
            else:
                g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, prefix)).encode()))
                w = -torch.log(torch.rand(self.vocab, generator=g, dtype=torch.float64))
                w[torch.randperm(self.vocab, generator=g)[: self.zeros]] = 0.0
            if self.transform is not None:
                w = self.transform(w / w.sum(), prefix)
            self._cache[prefix] = w / w.sum()
        return self._cache[prefix]

    def list(self, prefix: tuple[int, ...]) -> list[float]:
        return self(prefix).tolist()


def row_prefixes(tree: DraftTree, ctx: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The token prefix of every verify row: row 0 = ctx, row i+1 = ctx + path to node i."""
    prefixes = [ctx]
    for tok, par in zip(tree.tokens.tolist(), tree.parents.tolist()):
        prefixes.append(prefixes[par + 1] + (tok,))
    return prefixes


def target_rows(tree: DraftTree, target: TableModel, ctx: tuple[int, ...]) -> torch.Tensor:
    """float32[N+1, V]: the target's distribution at each verify row."""
    return torch.stack([target(pre) for pre in row_prefixes(tree, ctx)]).float()


def sample_tree(
    rng: random.Random,
    parents: list[int],
    draft: TableModel,
    ctx: tuple[int, ...],
    without_replacement: bool,
) -> DraftTree:
    """Draw a tree of the given shape from the draft model, recording each node's q in probs.

    i.i.d.: every child of a row is drawn from q(. | row prefix). Without replacement: a child is
    drawn from q with its earlier siblings' tokens removed and renormalised, and that is its q.
    """
    vocab = draft.vocab
    tokens: list[int] = []
    probs: list[list[float]] = []
    prefixes: list[tuple[int, ...]] = []
    drawn: dict[int, list[int]] = {}
    for par in parents:
        prefix = ctx if par == -1 else prefixes[par]
        q = draft.list(prefix)
        if without_replacement:
            q = [0.0 if t in drawn.get(par, ()) else w for t, w in enumerate(q)]
            total = sum(q)
            q = [w / total for w in q]
        tok = rng.choices(range(vocab), weights=q)[0]
        drawn.setdefault(par, []).append(tok)
        tokens.append(tok)
        probs.append(q)
        prefixes.append(prefix + (tok,))
    return DraftTree(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(parents, dtype=torch.int64),
        torch.tensor(probs, dtype=torch.float32).reshape(len(parents), vocab),
    )


# ---- the statistical check -----------------------------------------------------------------------

AcceptFn = Callable[[DraftTree, torch.Tensor, torch.Generator], VerifyResult]
# Many trees at once: (trees, each tree's target rows float[N+1, V], generator) -> their results.
BatchAcceptFn = Callable[[list[DraftTree], list[torch.Tensor], torch.Generator], list[VerifyResult]]
BATCH = 1_000  # trials accepted in one call


def accept_batch(trees: list[DraftTree], rows: list[torch.Tensor], generator: torch.Generator) -> list[VerifyResult]:
    """Every tree in one `accept_trees` call, as the engine accepts a step's requests (each tree a sampled
    request with its own uniforms, drawn here from one generator in turn)."""
    packed = pack_trees(trees)
    uniforms = draw_uniforms(packed, [False] * len(trees), [generator] * len(trees))
    probs = torch.cat(rows).float().contiguous()
    return accept_trees(trees, packed, np.zeros(len(trees), dtype=bool), torch.zeros(len(probs), dtype=torch.int64),
                        probs, np.arange(len(probs), dtype=np.int64), uniforms)


def one_at_a_time(accept: AcceptFn) -> BatchAcceptFn:
    return lambda trees, rows, generator: [accept(t, r, generator) for t, r in zip(trees, rows)]


def emitted_counts(
    make_tree: Callable[[random.Random], DraftTree],
    target: TableModel,
    accept: BatchAcceptFn,
    k: int,
    trials: int = TRIALS,
    seed: int = 0,
    ctx: tuple[int, ...] = CTX,
) -> tuple[Counter, Counter]:
    """(counts of the first k emitted tokens, counts of num_accepted) over `trials` verify steps, accepted
    BATCH at a time."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    counts: Counter = Counter()
    accepted: Counter = Counter()
    fixed_rows: dict[int, torch.Tensor] = {}  # a fixed tree's rows, computed once (drawn trees are fresh objects)
    for start in range(0, trials, BATCH):
        trees = [make_tree(rng) for _ in range(min(BATCH, trials - start))]
        fixed = len({id(t) for t in trees}) == 1
        if fixed and id(trees[0]) not in fixed_rows:
            fixed_rows[id(trees[0])] = target_rows(trees[0], target, ctx)
        rows = [fixed_rows[id(t)] if fixed else target_rows(t, target, ctx) for t in trees]
        for tree, r in zip(trees, accept(trees, rows, gen)):
            # the accepted nodes are a root→node path and carry the tree's tokens
            nodes = list(r.accepted_nodes)
            assert tree.parents[nodes].tolist() == [-1, *nodes][: len(nodes)]
            assert list(r.accepted_tokens) == [int(tree.tokens[n]) for n in r.accepted_nodes]
            out = r.emitted_tokens[:k]
            while len(out) < k:
                out.append(int(torch.multinomial(target(ctx + tuple(out)), 1, generator=gen)))
            counts[tuple(out)] += 1
            accepted[r.num_accepted] += 1
    return counts, accepted


def target_joint(target: TableModel, k: int, ctx: tuple[int, ...] = CTX) -> dict[tuple[int, ...], float]:
    """The exact distribution of the next k tokens under the target."""
    joint = {}
    for seq in itertools.product(range(target.vocab), repeat=k):
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= float(target(ctx + seq[:i])[tok])
            if prob == 0.0:
                break
        joint[seq] = prob
    return joint


def chi_square_pvalue(counts: Counter, joint: dict[tuple[int, ...], float]) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 are pooled. Impossible outcomes fail."""
    trials = sum(counts.values())
    impossible = [seq for seq in counts if joint.get(seq, 0.0) == 0.0]
    assert not impossible, f"emitted sequences the target gives probability 0: {impossible[:5]}"
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for seq, prob in joint.items():
        if prob == 0.0:
            continue
        exp = prob * trials
        if exp >= 5:
            cells.append((counts[seq], exp))
        else:
            pooled_obs += counts[seq]
            pooled_exp += exp
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    df = len(cells) - 1
    if df < 1:
        return 1.0  # a single possible outcome: nothing to test beyond "no impossible outcome"
    stat = sum((o - e) ** 2 / e for o, e in cells)
    # survival function of chi2(df) = regularised upper incomplete gamma Q(df/2, stat/2)
    half = lambda v: torch.tensor(v / 2, dtype=torch.float64)  # noqa: E731
    return float(torch.special.gammaincc(half(df), half(stat)))


def test_chi_square_pvalue_matches_closed_form():
    # chi2 with 2 degrees of freedom has survival function exp(-x / 2)
    joint = {(0,): 0.5, (1,): 0.25, (2,): 0.25}
    counts = Counter({(0,): 520, (1,): 230, (2,): 250})
    stat = 20**2 / 500 + 20**2 / 250 + 0
    assert chi_square_pvalue(counts, joint) == pytest.approx(math.exp(-stat / 2), rel=1e-9)
    # cells expecting fewer than 5 are pooled; an impossible outcome fails outright
    joint = {(0,): 0.5, (1,): 0.493, (2,): 0.004, (3,): 0.003, (4,): 0.0}
    counts = Counter({(0,): 500, (1,): 493, (2,): 1, (3,): 6})  # (2) and (3) pool: 7 seen, 7 expected
    assert chi_square_pvalue(counts, joint) == pytest.approx(1.0)
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square_pvalue(Counter({(0,): 999, (4,): 1}), joint)


def check_lossless(make_tree, target: TableModel, accept: BatchAcceptFn = accept_batch, k: int = 2, **kw) -> Counter:
    counts, accepted = emitted_counts(make_tree, target, accept, k, **kw)
    pvalue = chi_square_pvalue(counts, target_joint(target, k))
    assert pvalue > ALPHA, f"emitted tokens do not follow the target (chi-square p = {pvalue:.3g})"
    return accepted


def fixed(tree: DraftTree) -> Callable[[random.Random], DraftTree]:
    return lambda rng: tree


def drawn(parents, draft, without_replacement=False, ctx=CTX) -> Callable[[random.Random], DraftTree]:
    return lambda rng: sample_tree(rng, parents, draft, ctx, without_replacement)


def argmax_paths(model: TableModel, ctx, depth: int) -> list[int]:
    out, prefix = [], ctx
    for _ in range(depth):
        out.append(int(model(prefix).argmax()))
        prefix += (out[-1],)
    return out


def zero_token(model: TableModel, prefix) -> int:
    return int(torch.nonzero(model(prefix) == 0)[0])


V = 5
CHAIN3 = [-1, 0, 1]
TREE = [-1, -1, -1, 0, 0, 1, 3]  # root: 3 children; n0: 2 children; n1: 1; n3: 1 (depth 3)
BINARY = [-1, -1, 0, 0, 1, 1]


def far_from(p: torch.Tensor, prefix) -> torch.Tensor:
    """A draft row that puts its mass where p has little (including p's zeros)."""
    return (1.0 - p) ** 8 + 1e-3


# ---- losslessness --------------------------------------------------------------------------------


def test_sanity_of_the_check_on_plain_decoding():
    target = TableModel(seed=1, vocab=V)
    accepted = check_lossless(fixed(DraftTree.empty()), target, trials=5_000)
    assert accepted == Counter({0: 5_000})


def test_one_hot_chain_of_likely_tokens():
    target = TableModel(seed=2, vocab=V)
    chain = DraftTree.chain(argmax_paths(target, CTX, 3))
    accepted = check_lossless(fixed(chain), target)
    assert accepted[3] > 0 and accepted[0] > 0


def test_one_hot_chain_always_wrong():
    target = TableModel(seed=3, vocab=V, zeros=2)
    wrong = [zero_token(target, CTX)]
    wrong.append(zero_token(target, CTX + (wrong[0],)))
    accepted = check_lossless(fixed(DraftTree.chain(wrong)), target)
    assert accepted == Counter({0: TRIALS})


def test_one_hot_chain_always_right_then_random():
    # The target is certain of the first two tokens (3 then 0); the third draft is only sometimes right.
    target = TableModel(seed=4, vocab=V, overrides={CTX: [0, 0, 0, 1, 0], CTX + (3,): [1, 0, 0, 0, 0]})
    third = int(target(CTX + (3, 0)).argmax())
    accepted = check_lossless(fixed(DraftTree.chain([3, 0, third])), target, k=3, trials=10_000)
    assert set(accepted) == {2, 3}


def test_one_hot_mixed_tree():
    target = TableModel(seed=5, vocab=V)
    best = argmax_paths(target, CTX, 2)
    z = zero_token(target, CTX)
    paths = [[z, 0], [(best[0] + 1) % V, best[1]], best, [(best[0] + 2) % V]]
    tree = DraftTree.from_paths(paths)  # an impossible branch, two plausible ones, a short one
    accepted = check_lossless(fixed(tree), target)
    assert accepted[2] > 0 and accepted[1] > 0 and accepted[0] > 0


def test_iid_chain_with_probs():
    target, draft = TableModel(seed=6, vocab=V), TableModel(seed=60, vocab=V)
    accepted = check_lossless(drawn(CHAIN3, draft), target)
    assert accepted[3] > 0 and accepted[0] > 0


def test_iid_tree_with_probs():
    target, draft = TableModel(seed=7, vocab=V), TableModel(seed=70, vocab=V, zeros=0)
    check_lossless(drawn(TREE, draft), target)


def test_without_replacement_tree_with_probs():
    target, draft = TableModel(seed=8, vocab=V), TableModel(seed=80, vocab=V)
    check_lossless(drawn(TREE, draft, without_replacement=True), target)


def test_draft_far_from_target():
    target = TableModel(seed=9, vocab=V, zeros=2)
    draft = TableModel(seed=9, vocab=V, zeros=2, transform=far_from)  # same table, inverted
    accepted = check_lossless(drawn(BINARY, draft), target)
    assert accepted[0] > TRIALS // 3  # the drafts really are bad


def test_deep_chain_three_tokens():
    target, draft = TableModel(seed=10, vocab=4), TableModel(seed=100, vocab=4, zeros=0)
    accepted = check_lossless(drawn(CHAIN3, draft), target, k=3)
    assert accepted[3] > 0


def test_draft_equal_to_target_always_accepts():
    target = TableModel(seed=11, vocab=V)
    accepted = check_lossless(drawn(CHAIN3, target), target, trials=2_000)
    assert accepted == Counter({3: 2_000})  # p/q == 1 everywhere


# ---- the check has power -------------------------------------------------------------------------


def broken_accept(variant: str) -> AcceptFn:
    """stochastic_accept with one deliberate mistake (and, for "none", without one: a plain reference
    of the algorithm that consumes the generator the same way — N + 1 uniforms per call, one per node
    and one for the bonus token, drawn by inverse CDF)."""

    def accept(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> VerifyResult:
        u = torch.rand(tree.num_nodes + 1, generator=generator, dtype=torch.float64)
        tokens, accepted, row, p = tree.tokens.tolist(), [], 0, target_probs[0].double()
        probs = tree.probs.double() if tree.probs is not None else None
        while True:
            for node in tree.children(row):
                x = tokens[node]
                q = probs[node] if probs is not None else torch.nn.functional.one_hot(torch.tensor(x), p.numel()).double()
                ratio = float(p[x]) if variant == "ignore_q" else float(p[x]) / float(q[x])
                if float(u[node]) < ratio:
                    break
                if variant == "no_residual":
                    continue
                r = p.clone()
                if variant == "one_hot_residual":  # drops x but ignores the rest of q
                    r[x] = 0
                elif variant == "stale_residual":  # forgets the earlier siblings' rejections
                    r = (target_probs[row].double() - q).clamp(min=0)
                else:
                    r = (r - q).clamp(min=0)
                if float(r.sum()) <= RESIDUAL_EPS:
                    r = p.clone()
                    r[x] = 0
                p = r / r.sum()
            else:
                break
            accepted.append(node)
            row, p = node + 1, target_probs[node + 1].double()
        cdf = torch.cumsum(p, 0)
        bonus = int(torch.searchsorted(cdf, u[-1] * cdf[-1], right=True).clamp(max=p.numel() - 1))
        return VerifyResult(tuple(accepted), tuple(tokens[i] for i in accepted), bonus, tree.num_nodes)

    return accept


@pytest.mark.parametrize("variant", ["no_residual", "ignore_q", "one_hot_residual", "stale_residual"])
def test_check_has_power(variant):
    """The same check, with fewer trials, rejects verifiers that are subtly wrong.

    Plain random target and draft tables (not the adversarial far-from-target draft), so the
    mistakes are caught in the ordinary case, not only in a contrived one.
    """
    target, draft = TableModel(seed=7, vocab=V), TableModel(seed=70, vocab=V, zeros=0)
    counts, _ = emitted_counts(drawn(TREE, draft), target, one_at_a_time(broken_accept(variant)), k=2,
                               trials=POWER_TRIALS)
    assert chi_square_pvalue(counts, target_joint(target, 2)) < ALPHA


@pytest.mark.parametrize("without_replacement", [False, True])
def test_broken_copy_without_a_mistake_is_the_real_algorithm(without_replacement):
    """Harness sanity: the copy above differs from stochastic_accept only by its deliberate mistake.

    With no mistake it consumes the generator identically and returns identical results (up to float
    rounding at a boundary, which 300 trials do not meet), so the power test measures the mistakes
    and nothing else.
    """
    target, draft = TableModel(seed=7, vocab=V), TableModel(seed=70, vocab=V, zeros=0)
    rng = random.Random(0)
    g_real, g_copy = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    copy = broken_accept("none")
    for _ in range(300):
        tree = sample_tree(rng, TREE, draft, CTX, without_replacement)
        rows = target_rows(tree, target, CTX)
        assert stochastic_accept(tree, rows, g_real) == copy(tree, rows, g_copy)


# ---- deterministic behaviour and errors ----------------------------------------------------------


def test_seed_reproduces():
    target, draft = TableModel(seed=12, vocab=V), TableModel(seed=120, vocab=V)
    tree = sample_tree(random.Random(0), TREE, draft, CTX, False)
    rows = target_rows(tree, target, CTX)

    def run(seed: int) -> list[VerifyResult]:
        g = torch.Generator().manual_seed(seed)
        return [stochastic_accept(tree, rows, g) for _ in range(50)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_certain_target_accepts_matching_one_hot_chain():
    probs = torch.tensor([[0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=torch.float32)
    r = stochastic_accept(DraftTree.chain([1, 2]), probs, torch.Generator().manual_seed(0))
    assert r.emitted_tokens == [1, 2, 0]


def test_impossible_one_hot_draft_is_never_accepted():
    probs = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    seen = Counter()
    for _ in range(300):
        r = stochastic_accept(DraftTree.chain([2]), probs, g)
        assert r.num_accepted == 0
        seen[r.bonus_token] += 1
    assert set(seen) == {0, 1}


def test_rejected_fan_samples_from_residual():
    # p = [.2, .2, .6]; one-hot children 2 then 0: when both are rejected the residual is one-hot on 1,
    # and the bonus can never repeat a rejected token.
    probs = torch.tensor([[0.2, 0.2, 0.6], [1, 0, 0], [1, 0, 0]], dtype=torch.float32)
    tree = DraftTree(torch.tensor([2, 0]), torch.tensor([-1, -1]))
    g = torch.Generator().manual_seed(1)
    outcomes = Counter()
    for _ in range(500):
        r = stochastic_accept(tree, probs, g)
        outcomes[(r.accepted_nodes, r.bonus_token)] += 1
    assert set(outcomes) == {((0,), 0), ((1,), 0), ((), 1)}


def test_errors():
    g = torch.Generator().manual_seed(0)
    tree = DraftTree.chain([1, 2])
    ok = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="N\\+1"):
        stochastic_accept(tree, ok[:2], g)
    with pytest.raises(TypeError, match="floating"):
        stochastic_accept(tree, torch.ones(3, 4, dtype=torch.int64), g)
    with pytest.raises(ValueError, match="vocabulary"):
        stochastic_accept(DraftTree.chain([1, 4]), ok, g)
    with pytest.raises(ValueError, match="vocab"):
        stochastic_accept(DraftTree.chain([1, 2], probs=torch.full((2, 5), 0.2)), ok, g)
    q_zero = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.25] * 4])  # node 0 (token 1) has q = 0
    with pytest.raises(ValueError, match="draft probability"):
        stochastic_accept(DraftTree.chain([1, 2], probs=q_zero), ok, g)


def test_degenerate_residual_falls_back_to_one_hot_residual():
    # p and q equal up to one float32 ulp: the true residual is rounding noise below RESIDUAL_EPS, so a
    # rejection of token 0 drops token 0 alone and the bonus must be token 1 whatever its uniform.
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]], dtype=torch.float32)
    tree = DraftTree.chain([0], probs=torch.tensor([[0.50000006, 0.49999994]]))
    packed = pack_trees([tree])
    for u_bonus in (0.0, 0.3, 0.999):
        r = accept_trees([tree], packed, np.array([False]), torch.zeros(2, dtype=torch.int64), p, np.arange(2),
                         np.array([0.9999999, u_bonus]))[0]
        assert r.num_accepted == 0 and r.bonus_token == 1
    # a genuine residual is normalize(max(0, p - q)): here one-hot on token 0
    p = torch.tensor([[0.6, 0.3, 0.1], [1.0, 0.0, 0.0]], dtype=torch.float32)
    tree = DraftTree.chain([1], probs=torch.tensor([[0.2, 0.7, 0.1]]))
    for u_bonus in (0.0, 0.5, 0.999):
        r = accept_trees([tree], pack_trees([tree]), np.array([False]), torch.zeros(2, dtype=torch.int64), p,
                         np.arange(2), np.array([0.9999, u_bonus]))[0]
        assert r.num_accepted == 0 and r.bonus_token == 0


def test_accept_trees_mixed_equals_per_tree_calls():
    target, draft = TableModel(seed=13, vocab=V), TableModel(seed=130, vocab=V)
    rng = random.Random(5)
    trees = [
        sample_tree(rng, TREE, draft, CTX, False),
        DraftTree.chain([1, 2]),
        DraftTree.empty(),
        sample_tree(rng, CHAIN3, draft, CTX, True),
    ]
    greedy = np.array([False, True, False, False])
    rows = [target_rows(t, target, CTX) for t in trees]
    flat_probs = torch.cat(rows)  # [R, V], the output of the verify forward
    packed = pack_trees(trees)
    sampled_rows = np.concatenate([np.arange(packed.cu_rows[b], packed.cu_rows[b + 1]) for b in np.flatnonzero(~greedy)])
    prob_index = np.full(packed.num_rows, -1)
    prob_index[sampled_rows] = np.arange(len(sampled_rows))
    gens = [torch.Generator().manual_seed(s) if not g else None for s, g in enumerate(greedy)]
    uniforms = draw_uniforms(packed, greedy, gens)
    results = accept_trees(trees, packed, greedy, flat_probs.argmax(-1), flat_probs[sampled_rows], prob_index, uniforms)

    ref_gens = [torch.Generator().manual_seed(s) for s in range(len(trees))]
    expected = [
        stochastic_accept(trees[0], rows[0], ref_gens[0]),
        greedy_accept(trees[1], rows[1].argmax(-1)),
        stochastic_accept(trees[2], rows[2], ref_gens[2]),
        stochastic_accept(trees[3], rows[3], ref_gens[3]),
    ]
    assert results == expected
    with pytest.raises(ValueError, match="no generator"):
        draw_uniforms(packed, greedy, [None] * 4)


def test_device_implementation_equals_the_kernel():
    """The tensor-op path (used when logits live on an accelerator) gives the kernel's results for the
    same uniforms, greedy and sampled, on random trees (run here on CPU tensors)."""
    from specserve.verify.accept import RESIDUAL_EPS as eps
    from specserve.verify.accept_device import accept_on_device

    target, draft = TableModel(seed=21, vocab=V), TableModel(seed=210, vocab=V)
    rng = random.Random(3)
    for trial in range(60):
        trees = [sample_tree(rng, shape, draft, CTX, trial % 2 == 0) for shape in (TREE, CHAIN3, BINARY)]
        trees.append(DraftTree(torch.tensor([rng.randrange(V) for _ in BINARY]), torch.tensor(BINARY)))
        trees.append(DraftTree.empty())
        greedy = np.array([rng.random() < 0.4 for _ in trees])
        rows = torch.cat([target_rows(t, target, CTX) for t in trees])
        packed = pack_trees(trees)
        sampled_rows = np.concatenate([np.arange(packed.cu_rows[b], packed.cu_rows[b + 1])
                                       for b in np.flatnonzero(~greedy)] or [np.zeros(0, np.int64)])
        prob_index = np.full(packed.num_rows, -1)
        prob_index[sampled_rows] = np.arange(len(sampled_rows))
        uniforms = np.array([rng.random() for _ in range(packed.num_nodes + len(trees))])
        probs = rows[sampled_rows] if len(sampled_rows) else None
        kernel = accept_trees(trees, packed, greedy, rows.argmax(-1), probs, prob_index, uniforms)
        last, bonus, bad = accept_on_device(packed, greedy, rows.argmax(-1), probs, prob_index, uniforms, eps)
        assert bad == -1
        assert [r.bonus_token for r in kernel] == bonus.tolist()
        assert [r.accepted_nodes[-1] if r.num_accepted else -1 for r in kernel] == last.tolist()
