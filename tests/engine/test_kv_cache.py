"""The paged KV cache after speculative steps holds exactly what plain decoding would; no block leaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import scripted_drafter  # noqa: F401
from scripted_drafter import MODES
from specserve import LLM, SamplingParams
from specserve.kv_cache import BlockAllocator

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    out = LLM(small_vocab_dir, device="cpu").generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    return PROMPT + out.token_ids




@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 10**6), budget=st.integers(1, 10),
       steps=st.one_of(st.integers(1, 8), st.just(None)))
def test_cache_after_speculative_steps_equals_plain(small_vocab_dir, reference, mode, seed, budget, steps):
    """After `steps` verify steps (None: until the request finishes), the committed entries hold exactly
    the K/V plain prefill of the same tokens writes — bitwise, on the CPU kernels. A finished request's
    blocks are back in the free list but not yet reused, so its entries are read through the block table
    it held."""
    spec = LLM(small_vocab_dir, drafter="scripted", device="cpu", drafter_options={
        "mode": mode, "seed": seed, "references": [reference], "max_budget": budget}, speculation="static")
    engine = spec.engine
    req = engine.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), "r")
    table = None
    for _ in range((steps if steps is not None else 40) + 1):  # prefill + `steps` verify steps
        engine.step()
        if req.finish_reason:
            break
        table = engine.allocator.tables["r"].copy()
    assert steps is not None or req.finish_reason == "length"
    event("finished" if req.finish_reason else "running")
    committed = req.num_cached
    assert req.token_ids.tolist() == reference[: req.num_tokens]
    assert committed == req.num_tokens - 1  # every token but the root (pending, or never fed once finished)
    bs = engine.allocator.block_size
    index = np.arange(committed)
    phys = torch.from_numpy(table[index // bs].astype(np.int64) * bs + index % bs)
    k_spec, v_spec = engine.cache.k[:, phys], engine.cache.v[:, phys]
    if req.finish_reason:
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks

    plain = LLM(small_vocab_dir, device="cpu")
    ref_req = plain.engine.add_request(reference[:committed], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), "p")
    plain.engine.step()
    assert ref_req.num_cached == committed
    k_ref, v_ref = plain.engine.cache.read("p", committed)
    assert spec.model.kernels is not None  # batch-invariant kernels: the entries are equal bit for bit
    assert torch.equal(k_spec, k_ref) and torch.equal(v_spec, v_ref)


def test_finished_and_cancelled_requests_free_every_block(small_vocab_dir):
    llm = LLM(small_vocab_dir, drafter="ngram", device="cpu", kv_cache_tokens=4096, block_size=8, speculation="static")
    engine, alloc = llm.engine, llm.engine.cache.allocator
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=1)
    ids = [engine.add_request([1, 2, 3, 1, 2, 3], params).request_id for _ in range(6)]
    engine.step()
    engine.step()
    assert alloc.num_free_blocks < alloc.num_blocks
    assert engine.abort(ids[0]) and engine.abort(ids[3])
    assert not engine.abort(ids[0])  # already finished
    assert not engine.abort("no-such-request")
    queued = engine.add_request([4, 5], params).request_id
    assert engine.abort(queued)  # cancelled while still waiting
    while engine.has_unfinished():
        engine.step()
    assert alloc.num_free_blocks == alloc.num_blocks
    assert {engine.requests[i].finish_reason for i in (ids[0], ids[3], queued)} == {"cancelled"}


def test_admission_waits_for_blocks_instead_of_failing(small_vocab_dir):
    # Room for about two requests at once: the rest queue and run as blocks free up.
    llm = LLM(small_vocab_dir, device="cpu", kv_cache_tokens=96, block_size=8)
    outs = llm.generate([[1, 2, 3]] * 5, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 30 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    with pytest.raises(ValueError, match="KV slots"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))


def test_block_allocator_accounting():
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    assert alloc.blocks_for(9) == 3
    alloc.allocate("a", 9)
    alloc.allocate("b", 16)
    assert alloc.num_free_blocks == 3
    assert not alloc.can_allocate(13)
    with pytest.raises(MemoryError):
        alloc.allocate("c", 13)
    with pytest.raises(ValueError):
        alloc.allocate("a", 1)
    alloc.free("a")
    alloc.free("a")  # freeing twice is harmless
    assert alloc.num_free_blocks == 6
    alloc.free("b")
    assert alloc.num_free_blocks == 10
    assert sorted(alloc._free) == list(range(10))


def test_admission_is_fair_across_clients(small_vocab_dir):
    """Issue 19: a client's burst of requests no longer holds another client's request behind all of it.
    With two places in the batch, client A queues six requests, then B one: the second place goes to B
    (A has one running, B none), not to A's next; requests without a client stay first come, first served."""
    llm = LLM(small_vocab_dir, device="cpu", max_num_seqs=2)
    engine = llm.engine
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 30, 30, 30, 30, 30)]
    for i, p in enumerate(params):
        engine.add_request([1, 2, 3], p, request_id=f"a{i}", client="A")
    engine.add_request([4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), request_id="b", client="B")
    admitted = []
    while engine.has_unfinished():
        before = {r.request_id for r in engine.scheduler.running}
        engine.step()
        admitted += [r.request_id for r in engine.scheduler.running if r.request_id not in before]
    assert admitted[:3] == ["a0", "b", "a1"], admitted
    for rid in admitted:
        engine.pop_finished(rid)
    for i in range(3):  # no clients: first come, first served
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), request_id=f"f{i}")
    order = []
    while engine.has_unfinished():
        before = {r.request_id for r in engine.scheduler.running}
        engine.step()
        order += [r.request_id for r in engine.scheduler.running if r.request_id not in before]
    assert order == ["f0", "f1", "f2"]


def test_a_burst_leaves_the_newcomer_slots_free(small_vocab_dir):
    """A client's burst fills the batch up to the newcomers' slots only: a client arriving later with nothing
    running is admitted at the next step, not after one of the burst's (long) requests ends."""
    llm = LLM(small_vocab_dir, device="cpu", max_num_seqs=8)
    engine = llm.engine
    assert engine.scheduler.newcomer_slots == 1
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(10):
        engine.add_request([1, 2, 3], long, request_id=f"a{i}", client="A")
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 7  # the eighth slot waits for a newcomer
    engine.add_request([4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), request_id="b", client="B")
    engine.step()
    assert "b" in {r.request_id for r in engine.scheduler.running}
    for i in range(10):  # requests without a client are each their own: they fill the whole batch
        engine.abort(f"a{i}")
    while engine.has_unfinished():
        engine.step()
    for i in range(8):
        engine.add_request([1, 2, 3], long, request_id=f"n{i}")
    engine.step()
    assert len(engine.scheduler.running) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_cpu_cache_starts_every_key_vector_on_a_cache_line(dtype):
    """numpy's calloc returns big blocks 16 bytes past a page boundary; the kernels' 32-byte loads of such a cache
    straddle two cache lines at every other load (1.7-1.9x slower attention, BENCHMARKS.md)."""
    from specserve.kv_cache import PagedKVCache

    cache = PagedKVCache(BlockAllocator(num_blocks=64, block_size=16), num_layers=3, num_kv_heads=3, head_dim=64,
                         device=torch.device("cpu"), dtype=dtype)
    for tensor in (cache.k, cache.v):
        assert tensor.shape == (3, 64 * 16, 3, 64) and tensor.is_contiguous()
        assert tensor.data_ptr() % 64 == 0
        assert not tensor.any()  # zeroed
    if dtype == torch.float32:
        for k, v in cache.layer_arrays():
            assert k.ctypes.data % 64 == 0 and v.ctypes.data % 64 == 0
