"""Fault isolation in the step loop: a drafter that raises costs its requests their speculation, not
their output; a target forward that raises fails only the requests of that step."""

from __future__ import annotations

import logging

import pytest

from scripted_drafter import ScriptedDrafter
from specserve import LLM, SamplingParams
from specserve.drafters.base import register

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@register("fault_test_failing")
class FailingDrafter(ScriptedDrafter):
    """The scripted drafter, raising on the ``fail_on``-th call (1-based) of ``fail_in`` — or on every
    call from then on with ``always``. Records who it was handed and who it released."""

    def __init__(self, target, path=None, *, fail_in: str = "propose", fail_on: int = 1, always: bool = False,
                 mode: str = "mixed", seed: int = 0, references=(), max_budget: int = 6) -> None:
        super().__init__(target, path, mode=mode, seed=seed, references=references, max_budget=max_budget)
        self.fail_in, self.fail_on, self.always = fail_in, fail_on, always
        self.calls = {"propose": 0, "on_commit": 0}
        self.handed: list[tuple[str, set[str]]] = []  # (method, request ids) per call
        self.released: set[str] = set()

    def _maybe_fail(self, method: str, ids: set[str]) -> None:
        self.calls[method] += 1
        self.handed.append((method, ids))
        n = self.calls[method]
        if method == self.fail_in and (n == self.fail_on or (self.always and n >= self.fail_on)):
            raise RuntimeError(f"injected {method} failure #{n}")

    def propose(self, requests, budgets, depth=None):
        self._maybe_fail("propose", {r.request_id for r in requests})
        return super().propose(requests, budgets, depth)

    def on_commit(self, commits):
        self._maybe_fail("on_commit", {c.request_id for c in commits})
        super().on_commit(commits)

    def release(self, request_id):
        self.released.add(request_id)
        super().release(request_id)


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    outs = LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs]


def failing_llm(small_vocab_dir, reference, **options) -> LLM:
    refs = [p + r for p, r in zip(PROMPTS, reference)]
    return LLM(small_vocab_dir, drafter="fault_test_failing", device="cpu", speculation="static",
               drafter_options={"mode": "mixed", "seed": 3, "references": refs, "max_budget": 6, **options})


def assert_no_leak(llm: LLM) -> None:
    alloc = llm.engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks
    assert not llm.engine.requests and not llm.engine.speculator._drafter_off


@pytest.mark.parametrize("fail_in, fail_on", [("propose", 3), ("propose", 1), ("on_commit", 2)])
def test_drafter_failure_falls_back_to_plain_decoding(small_vocab_dir, reference, caplog, fail_in, fail_on):
    llm = failing_llm(small_vocab_dir, reference, fail_in=fail_in, fail_on=fail_on)
    with caplog.at_level(logging.ERROR, logger="specserve"):
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    drafter = llm.engine.drafter
    assert llm.engine.speculator.drafter_failures == 1
    failures = [r for r in caplog.records if "injected" in r.getMessage() or (r.exc_info and "injected" in str(r.exc_info[1]))]
    assert len(failures) == 1, caplog.text
    # The requests of the failed call are never handed to the drafter again, and it released them.
    k = [i for i, (m, _) in enumerate(drafter.handed) if m == fail_in][fail_on - 1]
    hit = drafter.handed[k][1]
    assert hit and all(not (ids & hit) for _, ids in drafter.handed[k + 1:])
    assert {o.request_id for o in outs} <= drafter.released
    assert_no_leak(llm)


def test_drafter_failing_every_call_is_asked_once_per_request(small_vocab_dir, reference):
    llm = failing_llm(small_vocab_dir, reference, fail_on=1, always=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    drafter = llm.engine.drafter
    assert drafter.calls["propose"] == llm.engine.speculator.drafter_failures == 1  # one batch, one call, then plain
    assert all(o.spec.num_drafted == 0 for o in outs)
    # A later request is tried once more (it is a new request), then decodes plainly too.
    again = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert again.token_ids == reference[0]
    assert drafter.calls["propose"] == llm.engine.speculator.drafter_failures == 2
    assert_no_leak(llm)


def test_forward_failure_fails_only_that_step(small_vocab_dir, reference, monkeypatch, caplog):
    llm = LLM(small_vocab_dir, drafter="ngram", device="cpu", speculation="static", max_num_seqs=2)
    engine = llm.engine
    run, calls = engine.runner.run, [0]

    def flaky(step, trees):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected forward failure")
        return run(step, trees)

    monkeypatch.setattr(engine.runner, "run", flaky)
    ids = [engine.add_request(p, GREEDY).request_id for p in PROMPTS]  # 2 run, 2 wait for a batch slot
    with caplog.at_level(logging.ERROR, logger="specserve"):
        while engine.has_unfinished():
            deltas = engine.step()
            for d in deltas:
                if d.finish_reason == "error":
                    assert d.finished and d.token_ids == []
    outs = [llm._output(engine.pop_finished(rid)) for rid in ids]
    assert [o.finish_reason for o in outs] == ["error", "error", "length", "length"]
    assert all("RuntimeError" in o.error for o in outs[:2])
    assert [o.token_ids for o in outs[2:]] == reference[2:]  # the waiting ones ran normally after
    assert engine.forward_failures == 1 and "target forward failed" in caplog.text
    # Newly arriving requests work, and nothing leaked.
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == reference[:2]
    assert_no_leak(llm)
