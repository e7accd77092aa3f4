"""The ``lookahead`` drafter: its Jacobi window update from the verify rows' argmax, its bounded pool,
options, and losslessness through the engine (greedy equality, chi-square at T = 1, inside a hybrid)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.drafters import CommitInfo, DraftRequest, TargetInfo, create_drafter
from specserve.drafters.lookahead import POOL_KEYS, LookaheadDrafter
from specserve.verify import DraftTree, VerifyResult
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target

TARGET = TargetInfo(vocab_size=100, hidden_size=8, num_layers=1, device=torch.device("cpu"), dtype=torch.float32)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5], [7, 7, 7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def _req(tokens, rid="r"):
    return DraftRequest(rid, np.asarray(tokens, dtype=np.int64), 0.0)


def test_a_fresh_window_is_prompt_lookups_guess_and_the_tree_holds_window_and_pool():
    d = LookaheadDrafter(TARGET, window=3, ngram=3, pool=2)
    (tree,) = d.propose([_req([5, 6, 7, 8, 9, 5])], [16])
    st = d._states["r"]
    assert st.window == [6, 7, 8]  # what followed the root's (5) earlier occurrence
    paths = {tuple(tree.tokens[tree.path_to(n)].tolist()) for n in range(tree.num_nodes) if tree.is_leaf[n]}
    assert (6, 7, 8) in paths and (6, 7) in {p[:2] for p in paths}  # window and the pool's 5 -> (6, 7) merged
    scores = tree.scores.numpy()
    assert all(scores[n] <= scores[p] + 1e-6 for n, p in enumerate(tree.parents.tolist()) if p >= 0)


def test_the_window_moves_one_jacobi_step_from_the_verify_rows():
    """Window chain c1 c2 c3 after the root; rows are [root, c1, c2, c3]. With c1 accepted, the bonus is
    argmax(row c1) and the new window is argmax(rows c2, c3) padded to W."""
    d = LookaheadDrafter(TARGET, window=3, ngram=2, pool=1)
    d.propose([_req([40, 41, 42, 43])], [3])  # no earlier 43: the window is the last 3 tokens
    st = d._states["r"]
    st.window = [50, 51, 52]
    tree = DraftTree(torch.tensor([50, 51, 52]), torch.tensor([-1, 0, 1]))
    argmax = np.array([50, 60, 61, 62])  # the target's argmax at root, c1, c2, c3
    result = VerifyResult(accepted_nodes=(0,), accepted_tokens=(50,), bonus_token=60, num_drafted=3)
    d.on_commit([CommitInfo("r", result, 6, tree, argmax)])
    assert st.window[:2] == [61, 62] and len(st.window) == 3
    assert (61,) in st.pool[60] and (62,) in st.pool[61]  # [bonus, guesses] harvested as n-grams


def test_the_pool_is_bounded_and_release_frees_the_state():
    d = LookaheadDrafter(TARGET, window=2, ngram=3, pool=2)
    rng = np.random.default_rng(0)
    d.propose([_req(rng.integers(0, 100, 3000))], [4])
    pool = d._states["r"].pool
    assert len(pool) <= POOL_KEYS and all(len(grams) <= 2 for grams in pool.values())
    d.release("r")
    assert d._states == {}


@pytest.mark.parametrize("options, message", [({"window": 0}, "window"), ({"ngram": 1}, "ngram"), ({"pool": 17}, "pool"),
                                              ({"max_budget": 0}, "max_budget")])
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        create_drafter("lookahead", TARGET, options)
    with pytest.raises(ValueError, match="needs no files"):
        create_drafter("lookahead:/x", TARGET)


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    return [o.token_ids for o in LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("speculation", ["static", "adaptive"])
@pytest.mark.parametrize("spec", ["lookahead", "hybrid:lookahead+suffix"])
def test_greedy_equals_plain(small_vocab_dir, reference, spec, speculation):
    llm = LLM(small_vocab_dir, drafter=spec, device="cpu", speculation=speculation)
    for batch in (1, 4):
        outs = llm.generate(PROMPTS[:batch], GREEDY)
        assert [o.token_ids for o in outs] == reference[:batch]
    if speculation == "static":
        assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0
    alloc = llm.engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


def test_drafts_are_accepted(small_vocab_dir, reference):
    """On the 16-token model's prompts (its own output repeats) lookahead's window and pool are accepted:
    tau well above 1 (1.29-1.43 measured), output identical to plain."""
    llm = LLM(small_vocab_dir, drafter="lookahead", device="cpu", speculation="static")
    outs = [llm.generate([p], GREEDY)[0] for p in PROMPTS[:3]]
    assert [o.token_ids for o in outs] == reference[:3]
    assert min(o.spec.mean_accepted_length for o in outs) > 1.15


def test_sampled_tokens_follow_target_distribution(small_vocab_dir):
    n, prompt = 1500, [3, 1, 4, 1, 5]
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, temperature=1.0, ignore_eos=True)
              for seed in range(n)]
    llm = LLM(small_vocab_dir, drafter="lookahead", drafter_options={"window": 3}, device="cpu", max_num_seqs=n,
              max_prefill_tokens=n * len(prompt), speculation="static")
    outs = llm.generate([prompt] * n, params)
    assert_follows_target(outs, small_vocab_dir, prompt, params[0])
    assert sum(sum(o.spec.drafted_per_position) for o in outs) > 0
