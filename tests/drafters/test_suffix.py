"""The ``suffix`` drafter: the count index against a brute-force matcher, trees, the shared index's cap,
options, and losslessness / cross-request learning through the engine."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams
from specserve.drafters import DraftRequest, TargetInfo, create_drafter, registered_drafters
from specserve.drafters import suffix_match as sm
from specserve.drafters.suffix import SuffixDrafter
from specserve.verify import DraftTree
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target

TARGET = TargetInfo(vocab_size=100, hidden_size=8, num_layers=1, device=torch.device("cpu"), dtype=torch.float32)


def drafter(**options) -> SuffixDrafter:
    """Without the weak-evidence cuts unless asked for (they have their own tests)."""
    return SuffixDrafter(TARGET, **{"spec_factor": 0, "min_prob": 0.0, **options})


def request(tokens, request_id: str = "r0") -> DraftRequest:
    return DraftRequest(request_id=request_id, token_ids=np.asarray(tokens, dtype=np.int64), temperature=0.0)


def as_lists(tree: DraftTree) -> tuple[list[int], list[int]]:
    return tree.tokens.tolist(), tree.parents.tolist()


# ---- a brute-force statement of the spec ------------------------------------------------------------


def brute_lookup(corpus: list[list[int]], tail: list[int], min_match: int, max_match: int):
    """Longest k in [min_match, max_match] such that tail[-k:] is followed by some token in some corpus
    sequence; the next tokens with counts, count descending then token ascending."""
    for k in range(min(max_match, len(tail)), min_match - 1, -1):
        window = tail[len(tail) - k:]
        counts: Counter = Counter()
        for seq in corpus:
            for i in range(k, len(seq)):
                if seq[i - k:i] == window:
                    counts[seq[i]] += 1
        if counts:
            ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            return k, [t for t, _ in ranked], [c for _, c in ranked]
    return 0, [], []


def brute_tree(corpus, ctx, min_match, max_match, depth, cap, spec_factor=0, min_prob=0.0):
    tokens, parents, scores, depths = [], [], [], []
    root_match = brute_lookup(corpus, ctx, min_match, max_match)[0]
    if spec_factor > 0 and root_match < max_match:  # a match as long as max_match: a copied passage, no cut
        cap = min(cap, spec_factor * root_match)
    if cap <= 0 or depth <= 0 or not ctx:
        return tokens, parents
    cands: list[list] = []  # [score, parent, token, live]

    def expand(node, score, d):
        if d >= depth or len(tokens) >= cap:
            return
        path, n = [], node
        while n >= 0:
            path.append(tokens[n])
            n = parents[n]
        _, toks, cnts = brute_lookup(corpus, ctx + path[::-1], min_match, max_match)
        total = sum(cnts)
        for t, c in zip(toks, cnts):
            if score * (c / total) < min_prob:
                break
            cands.append([score * (c / total), node, t, True])

    expand(-1, 1.0, 0)
    while len(tokens) < cap:
        live = [i for i, c in enumerate(cands) if c[3]]
        if not live:
            break
        best = max(live, key=lambda i: (cands[i][0], -i))
        cands[best][3] = False
        score, parent, tok, _ = cands[best]
        tokens.append(tok)
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        expand(len(tokens) - 1, score, depths[-1])
    return tokens, parents


# ---- hand-built contexts ----------------------------------------------------------------------------


def test_repeated_sequence_proposes_its_continuation():
    (tree,) = drafter(depth=6).propose([request([1, 2, 3, 4, 5, 9, 1, 2, 3])], [24])
    assert as_lists(tree) == ([4, 5, 9, 1, 2, 3], [-1, 0, 1, 2, 3, 4])
    assert not tree.has_q
    assert tree.scores is not None and torch.all(tree.scores == 0)  # every step seen once: probability 1


def test_children_are_ranked_by_frequency_and_scored_by_it():
    # after [1, 2]: 7 twice, 8 once
    ctx = [1, 2, 7, 1, 2, 7, 1, 2, 8, 5, 1, 2]
    (tree,) = drafter(max_match=2, depth=1).propose([request(ctx)], [24])
    assert as_lists(tree) == ([7, 8], [-1, -1])
    assert np.allclose(tree.scores.exp().tolist(), [2 / 3, 1 / 3])


def test_weak_evidence_cuts():
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3]  # the root's longest match is 3 tokens
    assert as_lists(drafter(spec_factor=1).propose([request(ctx)], [24])[0]) == ([4, 5, 9], [-1, 0, 1])
    assert drafter(spec_factor=2).propose([request(ctx)], [24])[0].num_nodes == 6
    # after [1, 2]: 7 twice, 8 once, 6 once -> 1/4 each for 8 and 6
    ctx = [1, 2, 7, 1, 2, 7, 1, 2, 8, 1, 2, 6, 5, 1, 2]
    assert as_lists(drafter(max_match=2, depth=1, min_prob=0.3).propose([request(ctx)], [24])[0]) == ([7], [-1])
    assert as_lists(drafter(max_match=2, depth=1, min_prob=0.25).propose([request(ctx)], [24])[0]) == ([7, 6, 8], [-1, -1, -1])
    # the defaults are SuffixDecoding's
    d = SuffixDrafter(TARGET)
    assert (d.spec_factor, d.min_prob) == (1, 0.1)


def test_a_copied_passage_drafts_a_chain_as_deep_as_depth():
    # The context ends with the first 4 tokens of a 12-token passage it holds: a match of max_match (4) tokens
    # is as long as the index can tell, so spec_factor does not cut the chain to 4 nodes; depth does.
    passage = list(range(10, 22))
    ctx = [1] + passage + [2] + passage[:4]
    chain = passage[4:] + [2, 10]

    def tree(**options):
        return as_lists(drafter(spec_factor=1, **options).propose([request(ctx)], [24])[0])

    assert tree(max_match=4, depth=10) == (chain, list(range(-1, 9)))
    assert tree(max_match=4, depth=5)[0] == chain[:5]
    # a match shorter than max_match (4 of 5: the passage's earlier copy follows 1, not 2): spec_factor x 4 nodes
    assert tree(max_match=5, depth=10)[0] == chain[:4]


def test_no_match_and_zero_budget_give_the_empty_tree():
    d = drafter()
    assert d.propose([request([1, 2, 3, 4])], [24])[0].num_nodes == 0
    assert d.propose([request([1, 2, 1, 2], "b")], [0])[0].num_nodes == 0
    assert d.propose([request([], "c")], [5])[0].num_nodes == 0


def test_budget_and_depth_cap_the_tree():
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert as_lists(drafter().propose([request(ctx)], [3])[0]) == ([4, 5, 9], [-1, 0, 1])
    assert as_lists(drafter(max_budget=2).propose([request(ctx)], [10])[0]) == ([4, 5], [-1, 0])
    assert drafter(depth=8).propose([request(ctx)], [24], depth=2)[0].max_depth == 2


def test_finished_output_is_proposed_to_a_later_request():
    d = drafter(depth=8)
    prompt = [10, 11, 12, 13]
    d.propose([request(prompt + [20], "a")], [4])
    d.propose([request(prompt + [20, 21, 22], "a")], [4])
    d.release("a")  # output 20 21 22 (+ nothing committed after) goes to the shared index
    (tree,) = d.propose([request(prompt + [20], "b")], [8])
    assert as_lists(tree) == ([21, 22], [-1, 0])
    # without sharing, the new request finds nothing
    d0 = drafter(shared_tokens=0)
    d0.propose([request(prompt + [20, 21, 22], "a")], [4])
    d0.release("a")
    assert d0.propose([request(prompt + [20], "b")], [8])[0].num_nodes == 0


def test_release_frees_the_request_state():
    d = drafter()
    d.propose([request([1, 2, 1, 2], "a"), request([3, 4, 3], "b")], [4, 4])
    assert set(d._states) == {"a", "b"}
    d.release("a")
    d.release("b")
    d.release("never-seen")
    assert d._states == {}


def test_context_that_is_not_an_extension_is_reindexed():
    d = drafter(depth=3)
    d.propose([request([1, 2, 3, 1, 2])], [8])
    (tree,) = d.propose([request([5, 6, 7, 5])], [8])  # same id, different context
    assert as_lists(tree) == ([6, 7, 5], [-1, 0, 1])


# ---- the index against brute force ------------------------------------------------------------------


@st.composite
def corpora(draw):
    vocab = draw(st.integers(1, 5))
    tok = st.integers(0, vocab - 1)
    ctx_chunks = draw(st.lists(st.lists(tok, max_size=12), min_size=1, max_size=4))
    shared = draw(st.lists(st.lists(tok, max_size=25), max_size=6))
    min_match = draw(st.integers(1, 3))
    options = dict(min_match=min_match, max_match=draw(st.integers(min_match, 6)), depth=draw(st.integers(1, 6)),
                   max_budget=draw(st.integers(1, 20)), shared_tokens=draw(st.integers(0, 60)),
                   spec_factor=draw(st.integers(0, 3)), min_prob=draw(st.sampled_from([0.0, 0.1, 0.3, 0.5])))
    return ctx_chunks, shared, options, draw(st.integers(0, 24))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpora())
def test_index_and_tree_match_brute_force(case):
    ctx_chunks, shared, options, budget = case
    d = drafter(**options)
    for s in shared:
        d.add_shared(np.asarray(s, np.int64))
    kept = [s.tolist() for s in d.shared_seqs]
    assert d.shared_size == sum(map(len, kept)) <= options["shared_tokens"]
    ctx: list[int] = []
    for chunk in ctx_chunks:  # grown incrementally, one propose per chunk
        ctx = ctx + chunk
        (tree,) = d.propose([request(ctx)], [budget])
        corpus = [ctx] + kept
        cap = min(budget, options["max_budget"])
        assert as_lists(tree) == brute_tree(corpus, ctx, options["min_match"], options["max_match"],
                                            options["depth"], cap, options["spec_factor"], options["min_prob"])
        # the lookup kernel itself: longest match, next tokens, counts and order
        st_ = d._states["r0"]
        shared_view = d.shared.lookup_view()
        for end in range(len(ctx) + 1):
            k, toks, cnts = sm.lookup(*st_.index.lookup_view(), *shared_view, np.asarray(ctx[:end], np.int64),
                                      options["min_match"], options["max_match"])
            bk, btoks, bcnts = brute_lookup(corpus, ctx[:end], options["min_match"], options["max_match"])
            assert (k, toks.tolist(), cnts.tolist()) == (bk, btoks, bcnts)


def test_shared_cap_holds_and_eviction_keeps_counts_exact():
    rng = np.random.default_rng(0)
    d = drafter(shared_tokens=500, max_match=4)
    for i in range(300):
        seq = rng.integers(0, 6, size=int(rng.integers(2, 40)))
        d.add_shared(seq)
        assert d.shared_size <= 500
    kept = [s.tolist() for s in d.shared_seqs]
    assert d.shared_size == sum(map(len, kept))
    empty = sm.new_index(1, 1)
    view = (empty[0], empty[1], empty[3], empty[6], empty[7], empty[8])
    for tail in ([1], [2, 3], [0, 1, 2], [5, 5, 5, 5]):
        got = sm.lookup(*d.shared.lookup_view(), *view, np.asarray(tail, np.int64), 1, 4)
        assert (got[0], got[1].tolist(), got[2].tolist()) == brute_lookup(kept, tail, 1, 4)
    # the rebuild after evictions keeps the index from growing with history
    assert d.shared.entries <= 2 * d.shared.live_entries + 4096


# ---- options and the registry -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, name",
    [
        ({"min_match": 0}, "min_match"),
        ({"min_match": 3, "max_match": 2}, "max_match"),
        ({"max_match": 65}, "max_match"),
        ({"depth": 0}, "depth"),
        ({"depth": 2.5}, "depth"),
        ({"max_budget": 0}, "max_budget"),
        ({"max_budget": True}, "max_budget"),
        ({"shared_tokens": -1}, "shared_tokens"),
        ({"spec_factor": -1}, "spec_factor"),
        ({"min_prob": 1.5}, "min_prob"),
        ({"min_prob": "0.1"}, "min_prob"),
    ],
)
def test_option_validation(options, name):
    with pytest.raises(ValueError, match=name):
        drafter(**options)


def test_created_through_the_registry():
    assert "suffix" in registered_drafters()
    d = create_drafter("suffix", TARGET, {"depth": 3})
    assert isinstance(d, SuffixDrafter) and d.name == "suffix" and d.depth == 3
    assert d.gives_probs is False and d.needs_hidden_states is False
    with pytest.raises(ValueError, match="no path"):
        create_drafter("suffix:some/path", TARGET)
    with pytest.raises(ValueError, match="unknown option"):
        create_drafter("suffix", TARGET, {"bogus": 1})


# ---- through the engine -----------------------------------------------------------------------------


def test_greedy_equals_plain_batched(llama_dir):
    prompts = ["for i in range(10):\n    print(i, i * i)\n" * 3, "def f(x):", "class A:\n    def __init__(self):"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(llama_dir, device="cpu").generate(prompts, params)
    llm = LLM(llama_dir, drafter="suffix", device="cpu", speculation="static")
    for _ in range(2):  # the second round drafts from the first round's outputs too
        spec = llm.generate(prompts, params)
        for a, b in zip(plain, spec):
            assert a.token_ids == b.token_ids and a.text == b.text
    assert llm.engine.drafter._states == {}  # released at finish
    assert llm.engine.drafter.shared_size > 0


def test_repeated_request_is_accepted_deeply(llama_dir):
    prompt = "def area(w, h):\n    return"
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(llama_dir, drafter="suffix", device="cpu", speculation="static")
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.token_ids == first.token_ids
    # cross-request learning: >= 2 draft tokens accepted per step on average (tau counts the bonus too)
    assert second.spec.mean_accepted_length >= 3.0
    assert second.spec.mean_accepted_length > first.spec.mean_accepted_length
    # drafter state and KV freed at finish
    assert llm.engine.drafter._states == {}
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


N = 1500
PROMPT = [3, 1, 4, 1, 5]


def test_sampled_tokens_follow_target_distribution(small_vocab_dir):
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, temperature=1.0, ignore_eos=True)
              for seed in range(N)]
    reference = LLM(small_vocab_dir, device="cpu").generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    llm = LLM(small_vocab_dir, drafter="suffix", device="cpu", max_num_seqs=N, max_prefill_tokens=N * len(PROMPT),
              drafter_options={"depth": 4, "max_budget": 6}, speculation="static")
    # earlier "outputs": the greedy path and a few perturbed ones, so trees branch and drafts are accepted
    rng = np.random.default_rng(1)
    llm.engine.drafter.add_shared(np.asarray(PROMPT + reference, np.int64))
    for _ in range(5):
        seq = PROMPT + reference
        seq[len(PROMPT) + int(rng.integers(0, 3))] = int(rng.integers(0, 16))
        llm.engine.drafter.add_shared(np.asarray(seq, np.int64))
    outs = llm.generate([PROMPT] * N, params)
    assert_follows_target(outs, small_vocab_dir, PROMPT, params[0])
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > N // 10


def test_incremental_index_agrees_with_brute_force_on_a_long_growing_context():
    rng = np.random.default_rng(0)
    motifs = [rng.integers(0, 30, size=int(rng.integers(3, 10))).tolist() for _ in range(6)]
    ctx = [t for _ in range(60) for t in motifs[int(rng.integers(0, 6))]]
    d = drafter(max_match=4, depth=4, max_budget=12, shared_tokens=0)
    empty = sm.new_index(1, 1)
    view = (empty[0], empty[1], empty[3], empty[6], empty[7], empty[8])
    for end in range(2, len(ctx), 7):  # tables grow (doubling) many times on the way
        (tree,) = d.propose([request(ctx[:end])], [12])
        assert as_lists(tree) == brute_tree([ctx[:end]], ctx[:end], 1, 4, 4, 12)
        got = sm.lookup(*d._states["r0"].index.lookup_view(), *view, np.asarray(ctx[:end], np.int64), 1, 4)
        assert (got[0], got[1].tolist(), got[2].tolist()) == brute_lookup([ctx[:end]], ctx[:end], 1, 4)


def test_forget_shared_drops_earlier_requests_outputs():
    """Benchmarks call forget_shared before each timed run: a repeated prompt is then drafted from its own
    context only, not from its earlier answer."""
    d = drafter(shared_tokens=1000)
    d.add_shared(np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.int64))
    tree = d.propose([request([9, 1, 2, 3])], [4])[0]
    assert tree.tokens.tolist()[:1] == [4]
    d.forget_shared()
    assert d.shared_size == 0 and d.propose([request([9, 1, 2, 3], "r1")], [4])[0].num_nodes == 0
