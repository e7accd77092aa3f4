"""Paced streaming: the schedule's arithmetic and the pacer's order under a fake clock, then a real
server streaming a speculating drafter's bursts paced, text still exact."""

from __future__ import annotations

import heapq
import random
import statistics
import time

import pytest

from specserve import SamplingParams
from specserve.drafters.base import register
from specserve.server.pacing import Pacer, PaceSchedule, split_text

from scripted_drafter import ScriptedDrafter
from wsclient import Conn


@register("scripted_slow")
class SlowScriptedDrafter(ScriptedDrafter):
    """The scripted drafter with a step as long as a slow real one's on CPU (50 ms): the tiny test model's
    sub-millisecond steps would have the event loop release a whole burst in one iteration. (At 15 ms a
    step the pacer's ~3 ms ticks merged in the outbox once the suite's other worker loaded both cores.)"""

    def propose(self, requests, budgets, depth=None):
        time.sleep(0.05)
        return super().propose(requests, budgets, depth)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.mean(values)


def run_schedule(bursts: list[int], step: float, jitter: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    schedule, now, releases, arrivals = PaceSchedule(), 0.0, [], []
    for i, n in enumerate(bursts):
        if i:
            now += step * (1 + rng.uniform(-jitter, jitter))
        times = schedule.plan(now, n)
        releases.append(times)
        arrivals.append(now)
    return arrivals, releases


def test_the_first_burst_is_not_held():
    assert PaceSchedule().plan(5.0, 3) == [5.0, 5.0, 5.0]


def test_steady_bursts_come_out_evenly_spaced():
    arrivals, releases = run_schedule([1] + [4] * 40, step=0.020)
    flat = [t for burst in releases[5:] for t in burst]
    assert cv(gaps(flat)) < 0.05
    assert statistics.mean(gaps(flat)) == pytest.approx(0.005, rel=0.05)  # the measured rate: 4 tokens / 20 ms


@pytest.mark.parametrize("sizes", [[1, 2, 3, 4, 5], [3, 4, 5], [1, 6]])
def test_no_token_waits_past_the_next_expected_step(sizes):
    rng = random.Random(1)
    bursts = [1] + [rng.choice(sizes) for _ in range(200)]
    arrivals, releases = run_schedule(bursts, step=0.020, jitter=0.1)
    schedule = PaceSchedule()
    last = float("-inf")
    for arrival, times, n in zip(arrivals, releases, bursts):
        expected_step = schedule.step_s  # what the schedule believed before this burst
        schedule.plan(arrival, n)
        assert all(t >= arrival for t in times) and times == sorted(times) and times[0] >= last
        last = times[-1]
        if expected_step is not None:
            # the last token of a burst leaves before the next step is expected (the moving average
            # after this burst: arrival + step_s)
            assert times[-1] < arrival + schedule.step_s + 1e-12


def test_pacing_lowers_the_gap_variation_of_bursty_speculation():
    rng = random.Random(2)
    bursts = [1] + [rng.choice([2, 3, 4, 5]) for _ in range(300)]
    arrivals, releases = run_schedule(bursts, step=0.020, jitter=0.05)
    raw = [a for a, n in zip(arrivals, bursts) for _ in range(n)]
    paced = [t for burst in releases for t in burst]
    assert cv(gaps(raw[20:])) > 1.0 and cv(gaps(paced[20:])) < 0.5
    added = [p - r for p, r in zip(paced, raw)]
    assert max(added) < 0.020 * 1.2  # at most about one step


def test_split_text_follows_token_lengths():
    assert split_text("abcdef", [1, 2, 3]) == ["a", "bc", "def"]
    assert "".join(split_text("héllo wörld", [2, 0, 7, 2])) == "héllo wörld"
    assert split_text("ab", [0, 0]) == ["a", "b"]
    assert split_text("x", [3]) == ["x"]


class FakeLoop:
    """A clock and call_at whose time only moves when the test says."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list = []
        self._seq = 0

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, fn):
        timer = _Timer(when, fn)
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, timer))
        return timer

    def advance(self, to: float) -> None:
        while self._timers and self._timers[0][0] <= to:
            when, _, timer = heapq.heappop(self._timers)
            self.now = when
            if not timer.cancelled:
                timer.fn()
        self.now = to


class _Timer:
    def __init__(self, when, fn) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


def test_pacer_emits_in_order_and_finishes_after_the_held_text():
    loop = FakeLoop()
    out: list[tuple[float, str, int]] = []
    done: list[float] = []
    pacer = Pacer(lambda text, n: out.append((loop.now, text, n)), loop.time, loop.call_at)
    pacer.push(["a"])  # prefill's token: straight out
    assert out == [(0.0, "a", 1)]
    loop.advance(0.010)
    pacer.push(["b", "c", "d", "e"])  # a verify step's burst: spread over the next ~10 ms
    assert out[-1][1] == "b" and pacer.holding == 3
    pacer.push_tokens(1)  # a token without text rides along with the burst's last piece
    pacer.finish(lambda: done.append(loop.now))
    assert not done
    loop.advance(0.020)
    assert [t for _, t, _ in out] == ["a", "b", "c", "d", "e"]
    assert sum(n for *_, n in out) == 6
    assert done and done[0] < 0.020 and all(b[0] >= a[0] for a, b in zip(out, out[1:]))


def test_pacer_cancel_drops_what_it_holds():
    loop = FakeLoop()
    out: list[str] = []
    pacer = Pacer(lambda text, n: out.append(text), loop.time, loop.call_at)
    pacer.push(["a"])
    loop.advance(0.01)
    pacer.push(["b", "c", "d"])
    pacer.cancel()
    loop.advance(1.0)
    assert out == ["a", "b"]


def test_a_paced_websocket_stream_is_exact_and_token_by_token(make_server, reference_llm):
    prompt = "class Point:"
    ids = reference_llm.encode(prompt)
    free = reference_llm.generate([ids], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    srv = make_server(llm_kwargs={"drafter": "scripted_slow", "drafter_options": {
        "mode": "all_right", "references": [ids + free.token_ids], "max_budget": 4}})
    with Conn(srv.ws_url) as c:
        rid = c.create(input=prompt, max_output_tokens=60, temperature=0, ignore_eos=True, stream_pacing="smooth")
        done = c.wait_done(rid)
    deltas = c.deltas[rid]
    assert c.text(rid) == free.text
    assert sum(d["tokens"] for d in deltas) == done["usage"]["output_tokens"] == 60
    assert done["spec"]["tau"] > 3  # the steps came in bursts of ~5 ...
    # ... and went out about one token at a time
    assert statistics.mean(d["tokens"] for d in deltas) < 1.5
