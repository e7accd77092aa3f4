"""Prefix caching (specserve/prefix_cache.py) through the real engine and model.

Lossless: greedy output with caching on equals caching off, token for token, for every drafter kind the
tiny models run (their own KV: draft model, EAGLE; target features: EAGLE, Medusa; token indexes:
n-gram, suffix; a hybrid), for chunked prefills that end inside a block and at a block edge, for a
grammar-constrained request and under eviction pressure; sampled output keeps the target's
distribution. Bookkeeping: reference counts stay consistent under any interleaving of add / step /
abort, only unreferenced blocks are evicted, and a request never writes into a block it shares.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scripted_drafter  # noqa: F401  (registers "scripted")
import specserve.drafters.eagle  # noqa: F401  (registers "eagle")
import specserve.drafters.medusa  # noqa: F401  (registers "medusa")
from specserve import LLM, SamplingParams
from specserve.drafters.eagle_checkpoint import save_head
from specserve.drafters.medusa_heads import save_heads
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target

BLOCK = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Two shared prefixes; each prompt diverges from the others inside a block or at a block edge.
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]  # 3 full blocks + 1 token
OTHER = [2, 7, 1, 8, 2, 8, 1, 8]  # exactly 2 blocks
PROMPTS = [SYSTEM + [7, 9], SYSTEM + [1], SYSTEM + [7, 2, 2, 4, 4, 6], OTHER + [3], OTHER + [3, 3, 1, 1, 2], SYSTEM[:6]]


def _llm(model_dir, drafter=None, cache=True, **kwargs) -> LLM:
    return LLM(model_dir, drafter=drafter, device="cpu", block_size=BLOCK, speculation="static",
               enable_prefix_caching=cache, **kwargs)


@pytest.fixture(scope="module")
def reference(small_vocab_dir) -> dict[tuple, list[int]]:
    """Plain greedy output, caching off, of every prompt (and of the chat turns below)."""
    llm = _llm(small_vocab_dir, cache=False)
    out = {tuple(p): o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}
    turn = list(SYSTEM)
    for _ in range(3):  # a chat: each turn's prompt is the last prompt, its answer and a new message
        answer = llm.generate([turn], GREEDY)[0].token_ids
        out[tuple(turn)] = answer
        turn = turn + answer + [5, 5, 1]
    return out


@pytest.fixture(scope="module")
def eagle_dir(small_vocab_dir, tmp_path_factory):
    """A random EAGLE-1 head for the 16-token target (acceptance does not matter: losslessness does)."""
    from tests.drafters.test_eagle import random_head

    return save_head(random_head(small_vocab_dir, "eagle1"), tmp_path_factory.mktemp("eagle_pc"), torch.float32)


@pytest.fixture(scope="module")
def medusa_dir(small_vocab_dir, tmp_path_factory):
    from tests.drafters.test_medusa import _random_heads

    out = tmp_path_factory.mktemp("medusa_pc")
    save_heads(_random_heads(1), out, small_vocab_dir)
    return out


def _drafter_spec(kind: str, request) -> str | None:
    if kind == "scripted":  # drafts the reference continuation: every step accepts several tokens
        return "scripted"
    return {
        "none": None, "ngram": "ngram", "suffix": "suffix",
        "draft": f"draft:{request.getfixturevalue('near_draft_dir')}",
        "eagle": f"eagle:{request.getfixturevalue('eagle_dir')}",
        "medusa": f"medusa:{request.getfixturevalue('medusa_dir')}",
        "hybrid": f"hybrid:suffix+draft:{request.getfixturevalue('near_draft_dir')}",
    }[kind]


def _run_scenario(llm: LLM, reference) -> list:
    """One at a time (each finds the earlier ones' blocks), then a chat, then all at once; every output
    checked against the cache-off reference. Returns the outputs."""
    outs = []
    for p in PROMPTS:
        o = llm.generate([p], GREEDY)[0]
        assert o.token_ids == reference[tuple(p)], p
        outs.append(o)
    turn = list(SYSTEM)
    for _ in range(3):
        o = llm.generate([turn], GREEDY)[0]
        assert o.token_ids == reference[tuple(turn)], "chat turn"
        outs.append(o)
        turn = turn + o.token_ids + [5, 5, 1]
    batch = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batch] == [reference[tuple(p)] for p in PROMPTS]
    alloc = llm.engine.allocator
    alloc.check()
    assert alloc.num_free_blocks == alloc.num_blocks  # cached blocks are evictable: all of it is free
    assert llm.engine.speculator.drafter_failures == 0
    return outs + batch


@pytest.mark.parametrize("kind", ["none", "ngram", "suffix", "draft", "eagle", "medusa", "hybrid", "scripted"])
def test_greedy_with_cache_equals_without(small_vocab_dir, reference, kind, request):
    options = {"mode": "all_right", "references": [list(p) + out for p, out in reference.items()], "max_budget": 5}
    llm = _llm(small_vocab_dir, _drafter_spec(kind, request), drafter_options=options if kind == "scripted" else None)
    outs = _run_scenario(llm, reference)
    by_prompt = {tuple(o.prompt_token_ids): o for o in outs[:len(PROMPTS)]}
    # The second prompt on SYSTEM reuses its three full blocks; the chat's later turns their whole history
    # but the tail block(s) a drafter keeping KV had not caught up on when the earlier turn ended.
    assert by_prompt[tuple(PROMPTS[1])].num_cached_tokens == 12
    assert by_prompt[tuple(PROMPTS[4])].num_cached_tokens == 8  # OTHER + [3]: two blocks, then its own
    chat = outs[len(PROMPTS):len(PROMPTS) + 3]
    for before, turn in zip(chat, chat[1:]):  # a turn finds the earlier one's history, its answer included
        committed = (len(before.prompt_token_ids) + len(before.token_ids) - 1) // BLOCK * BLOCK
        if kind in ("none", "ngram", "suffix", "medusa", "scripted"):  # all of it
            assert turn.num_cached_tokens == committed
        else:  # but the tail a drafter keeping KV had not caught up on when the earlier turn ended
            assert committed - 3 * BLOCK <= turn.num_cached_tokens <= committed
    if kind != "none":  # the drafter still drafts after a cache hit (none was left unable to)
        assert by_prompt[tuple(PROMPTS[1])].spec.num_drafted > 0 or kind in ("ngram", "suffix")
        assert sum(o.spec.num_drafted for o in outs) > 0


class _DraftsEvery:
    """A budget policy drafting on every `period`-th step only (None: never), as adaptive speculation does
    where drafting does not pay: the steps between leave a drafter's own KV behind."""

    wants_calibration = False

    def __init__(self, period: int | None) -> None:
        self.period, self.steps = period, 0

    def plan(self, requests, fixed_rows):
        from specserve.budget import DraftPlan

        self.steps += 1
        drafts = self.period is not None and self.steps % self.period == 0
        return DraftPlan([3 if drafts else 0] * len(requests))

    def cut(self, requests, trees, budgets, fixed_rows, draft_s):
        return trees, [None] * len(trees)

    def observe(self, record) -> None:
        pass

    def release(self, request_id) -> None:
        pass


@pytest.mark.parametrize("period", [None, 3], ids=["never-drafts", "drafts-every-third-step"])
@pytest.mark.parametrize("kind", ["draft", "eagle", "hybrid"])
def test_chat_history_stays_cached_while_the_drafter_sits_out(small_vocab_dir, reference, kind, period, request):
    """A drafter keeping KV catches up within a block of each request's tokens even on steps it does not draft,
    so the next turn of a chat finds its whole history but the last block or two (before: none of it, with a
    drafter that never drafted); output stays the plain reference."""
    llm = _llm(small_vocab_dir, _drafter_spec(kind, request))
    llm.engine.speculator.policy = _DraftsEvery(period)
    turn, before = list(SYSTEM), None
    for _ in range(3):
        out = llm.generate([turn], GREEDY)[0]
        assert out.token_ids == reference[tuple(turn)]
        if before is not None:
            committed = (len(before.prompt_token_ids) + len(before.token_ids) - 1) // BLOCK * BLOCK
            assert committed - 2 * BLOCK <= out.num_cached_tokens <= committed
        before, turn = out, turn + out.token_ids + [5, 5, 1]
        assert (out.spec.num_drafted > 0) == (period is not None)
    assert llm.engine.speculator.drafter_failures == 0
    llm.engine.allocator.check()


@pytest.mark.parametrize("chunk", [3, 4, 6], ids=["inside-block", "block-edge", "across-blocks"])
@pytest.mark.parametrize("kind", ["none", "eagle"])
def test_chunked_prefill_with_cache(small_vocab_dir, reference, chunk, kind, request):
    """Prefill chunks of 3 end inside blocks, of 4 exactly at their edges; the cached prefix then ends
    where a chunk did not."""
    llm = _llm(small_vocab_dir, _drafter_spec(kind, request), max_prefill_tokens=chunk)
    _run_scenario(llm, reference)


def test_cache_off_caches_nothing(small_vocab_dir, reference):
    llm = _llm(small_vocab_dir, cache=False)
    outs = _run_scenario(llm, reference)
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert llm.engine.prefix_cache is None and llm.engine.allocator.num_cached_blocks == 0


def test_eagle_drafter_reuses_its_own_kv_only_when_valid(small_vocab_dir, reference, eagle_dir):
    """EAGLE's pair at slot i reads token i+1: a cached block's head entries serve a prompt only when the
    token after the block matches too; a request that never drafts takes the target KV regardless."""
    llm = _llm(small_vocab_dir, f"eagle:{eagle_dir}")
    first = llm.generate([SYSTEM + [7, 9]], GREEDY)[0]
    assert first.token_ids == reference[tuple(SYSTEM + [7, 9])]
    # SYSTEM + [1]: blocks 0-2 match, and so does token 12 (SYSTEM's last) that block 2's last pair read.
    same_tail = llm.generate([SYSTEM + [1]], GREEDY)[0]
    assert same_tail.num_cached_tokens == 12 and same_tail.token_ids == reference[tuple(SYSTEM + [1])]
    # Diverging right after block 1 (token 8 differs): block 1's last head pair read SYSTEM[8], so a
    # drafting request takes one block, a plain one two.
    prompt = SYSTEM[:8] + [0, 0, 0]
    ref = _llm(small_vocab_dir, cache=False).generate([prompt], GREEDY)[0].token_ids
    drafting = llm.generate([prompt], GREEDY)[0]
    assert drafting.num_cached_tokens == 4 and drafting.token_ids == ref
    req = llm.engine.add_request(prompt, GREEDY, speculate=False)
    while req.finish_reason is None:
        llm.engine.step()
    assert req.num_cached_tokens == 8 and req.output_ids == ref
    assert llm.engine.speculator.drafter_failures == 0


def test_constrained_request_with_cache(llama_dir):
    prefix = "You are a helpful assistant. Answer with one of the choices given, nothing else.\n"
    params = SamplingParams(max_tokens=16, temperature=0.0, choice=["yes", "no", "maybe later"])
    prompts = [prefix + "Is it raining?", prefix + "Is it sunny today?"]
    plain = LLM(llama_dir, drafter=None, device="cpu", block_size=BLOCK, enable_prefix_caching=False)
    ref = [o.text for o in plain.generate(prompts, params)]
    llm = LLM(llama_dir, drafter="ngram", device="cpu", block_size=BLOCK, speculation="static")
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert [o.text for o in outs] == ref
    assert outs[1].num_cached_tokens > 0


def test_sampled_output_follows_target_with_cache(small_vocab_dir, near_draft_dir):
    """Every request after the first starts from cached blocks (target and draft KV): sampling exact."""
    n = 1500
    prompt = SYSTEM[:9]
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, temperature=1.0)
              for seed in range(n)]
    llm = _llm(small_vocab_dir, f"draft:{near_draft_dir}", max_num_seqs=64)
    llm.generate([prompt], params[0])  # caches the prompt's blocks, drafter entries included
    outs = llm.generate([prompt] * n, params)
    assert all(o.num_cached_tokens == 8 for o in outs)
    assert_follows_target(outs, small_vocab_dir, prompt, params[0])


def test_requests_sharing_a_prefix_never_see_each_others_tokens(small_vocab_dir, reference):
    """Two requests share SYSTEM's full blocks and diverge inside the next one: that block is each one's
    own, and the shared blocks' KV is bitwise unchanged by everything either writes."""
    llm = _llm(small_vocab_dir)
    engine = llm.engine
    a = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()  # a's prompt is prefilled, its full blocks cached
    b = engine.add_request(PROMPTS[2], GREEDY)
    engine.step()
    ta, tb = engine.allocator.tables[a.request_id], engine.allocator.tables[b.request_id]
    assert b.num_cached_tokens == 12 and (ta[:3] == tb[:3]).all() and ta[3] != tb[3]
    slots = torch.from_numpy((ta[:3, None].astype(np.int64) * BLOCK + np.arange(BLOCK)).reshape(-1))
    before = engine.cache.k[:, slots].clone(), engine.cache.v[:, slots].clone()
    while a.finish_reason is None or b.finish_reason is None:
        engine.step()
    assert torch.equal(engine.cache.k[:, slots], before[0]) and torch.equal(engine.cache.v[:, slots], before[1])
    assert a.output_ids == reference[tuple(PROMPTS[0])] and b.output_ids == reference[tuple(PROMPTS[2])]


def test_cached_blocks_never_keep_a_request_out(small_vocab_dir):
    """A pool full of cached blocks still admits a request that needs all of it (they are evicted)."""
    llm = _llm(small_vocab_dir, kv_cache_tokens=64, max_model_len=64)
    for p in PROMPTS:
        llm.generate([p], GREEDY)
    alloc = llm.engine.allocator
    assert alloc.num_cached_blocks > 0 and alloc.num_free_blocks == alloc.num_blocks
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=64 - 3 - 1 - 8, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    alloc.check()


# ---- any interleaving keeps the bookkeeping consistent -------------------------------------------------

_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
), min_size=1, max_size=30)


@pytest.fixture(scope="module")
def tight_llm(small_vocab_dir):
    """A 24-block pool: the interleavings below evict cached blocks often."""
    return _llm(small_vocab_dir, "ngram", kv_cache_tokens=96, max_model_len=40, max_num_seqs=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_any_interleaving_keeps_refcounts_consistent(tight_llm, reference, ops):
    engine = tight_llm.engine
    alloc, cache = engine.allocator, engine.prefix_cache
    live = []
    forget = cache._evicted

    def evicted(block: int) -> None:  # only a block no table holds may be evicted
        assert alloc.ref_count(block) == 0 and block not in alloc._evictable
        forget(block)

    alloc.on_evict = evicted
    for op, x, y in ops:
        if op == "add":
            live.append(engine.add_request(PROMPTS[x], SamplingParams(max_tokens=y, temperature=0.0, ignore_eos=True)))
        elif op == "step":
            for _ in range(x):
                engine.step()
        elif live:
            engine.abort(live[x % len(live)].request_id)
        alloc.check()
        for block, key in cache._key_of.items():  # every indexed block is marked cached, and vice versa
            assert cache._by_key[key].block == block and alloc._cached[block]
        assert int(alloc._cached.sum()) == len(cache._key_of)
    while engine.has_unfinished():
        engine.step()
        alloc.check()
    for r in live:  # greedy output is its prompt's, whatever ran beside it (cut short by max_tokens or an abort)
        engine.pop_finished(r.request_id)
        if r.finish_reason == "length":
            assert r.output_ids == reference[tuple(r.token_ids[:r.prompt_len].tolist())][:r.max_tokens]
    assert alloc.num_free_blocks == alloc.num_blocks
    alloc.on_evict = forget
    cache.clear()
    alloc.check()
    assert len(alloc._free) == alloc.num_blocks and alloc.num_cached_blocks == 0


def test_tensor_parallel_ranks_share_cached_blocks(small_vocab_dir, near_draft_dir):
    """Under tensor parallelism every rank runs rank 0's block tables: a cache hit needs no message of its
    own (no block is ever copied), and output equals one device's (the torch layers, as the ranks run)."""
    prompts = [SYSTEM + [7, 9], SYSTEM + [1], OTHER + [3], OTHER + [3, 3, 1, 1, 2]]
    one = LLM(small_vocab_dir, drafter=None, device="cpu", attention="sdpa", enable_prefix_caching=False)
    expected = [o.token_ids for o in one.generate(prompts, GREEDY)]
    with LLM(small_vocab_dir, drafter=f"draft:{near_draft_dir}", tensor_parallel_size=2, block_size=BLOCK,
             speculation="static") as llm:
        outs = [llm.generate([p], GREEDY)[0] for p in prompts]
        assert [o.token_ids for o in outs] == expected
        assert [o.num_cached_tokens for o in outs] == [0, 12, 0, 8]
