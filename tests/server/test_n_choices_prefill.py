"""n choices prefill their prompt once (prefix caching on): choice 0 runs first and the others are held on
the engine thread until its first token, then take its cached blocks — through a real server on loopback
and the real `openai` client; held choices that are cancelled never reach the engine and leak nothing."""

from __future__ import annotations

import threading

import pytest

from server_utils import greedy_text, kv_blocks, openai_client, wait_until
from specserve import SamplingParams
from specserve.server.engine_worker import EngineWorker

PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number, iteratively, for n >= 0\n    a, b = 0, 1\n"


def _hits(srv) -> tuple[int, int]:
    return srv.engine_call(lambda e: (e.prefix_cache.queried_tokens, e.prefix_cache.hit_tokens))


@pytest.mark.parametrize("drafter", ["ngram", None])
def test_n_choices_take_choice_zeros_cached_prompt_and_equal_greedy(make_server, reference_llm, drafter):
    srv = make_server(llm_kwargs={"drafter": drafter})
    client = openai_client(srv)
    ids = reference_llm.encode(PROMPT)
    assert len(ids) > 32
    before = _hits(srv)
    resp = client.completions.create(model=srv.server.model_name, prompt=PROMPT, max_tokens=16, temperature=0, n=4,
                                     extra_body={"ignore_eos": True})
    queried, hit = (a - b for a, b in zip(_hits(srv), before))
    block = srv.engine_call(lambda e: e.prefix_cache.block_size)
    assert queried == 4 * len(ids)
    assert hit == 3 * ((len(ids) - 1) // block) * block  # choices 1-3: every full block before the last token
    assert [c.text for c in resp.choices] == [greedy_text(reference_llm, ids, 16, ignore_eos=True)] * 4
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 64
    assert wait_until(lambda: kv_blocks(srv)[0] == kv_blocks(srv)[1])  # nothing held (cached blocks count as free)


def test_held_choices_cancelled_before_their_leader_starts(llama_dir):
    """EngineWorker directly: a follower cancelled while held hears one cancelled summary and never runs;
    cancel_all ends held followers too."""
    import asyncio

    from specserve import LLM

    llm = LLM(llama_dir)
    loop = asyncio.new_event_loop()
    updates: dict[str, list] = {}
    done = threading.Event()

    def sink(update):
        updates.setdefault(update.request_id, []).append(update)
        if len([u for us in updates.values() for u in us if u.done is not None]) == 3:
            done.set()

    worker = EngineWorker(llm.engine, loop, threads=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = llm.encode(PROMPT)
    # Queued before the thread starts: the leader is added, then both followers held, then one cancelled.
    worker.submit("lead", ids, params, False, 0.0, sink)
    worker.submit("f1", ids, params, False, 0.0, sink, after="lead")
    worker.submit("f2", ids, params, False, 0.0, sink, after="lead")
    worker.cancel("f1")
    worker.start()
    try:
        deadline = loop.time() + 60
        while not done.is_set() and loop.time() < deadline:
            loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        worker.stop()
        loop.close()
    assert [u.done.reason for u in updates["f1"]] == ["cancelled"] and updates["f1"][0].num_tokens == 0
    assert updates["f2"][-1].done.reason == "length" and sum(u.num_tokens for u in updates["f2"]) == 8
    assert updates["lead"][-1].done.reason == "length"
    assert llm.engine.cache.allocator.num_free_blocks == llm.engine.cache.allocator.num_blocks
