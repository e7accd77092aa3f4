"""Paced streaming (``stream_pacing: "smooth"``): spread each engine step's burst of tokens over time.

Speculation emits several tokens per step (τ on average), so a chat window would see text arrive in
jerks: a few tokens at once, then nothing for a step. The pacer releases a burst's tokens one by one
at the request's measured token rate (a gap of step interval / tokens per step, both moving averages),
queued behind whatever of the previous burst is still held, and compressed when needed so that the
last token of a burst leaves no later than the next step's expected arrival: pacing adds at most one
step to any token's latency (the first token is never held: there is no rate to pace at yet).

``PaceSchedule`` is the arithmetic (pure, tested with a fake clock); ``Pacer`` drives it on the event
loop with ``call_at`` and hands out text pieces in order; ``split_text`` cuts a step's text into
per-token pieces.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

PACING_MODES = ("off", "smooth")

#: Weight of the newest step in the moving averages: steady enough to ride out one odd step, quick
#: enough to follow a batch growing or shrinking.
EMA_WEIGHT = 0.25


class PaceSchedule:
    """Release times for the tokens of successive bursts of one response."""

    def __init__(self) -> None:
        self.last_arrival: float | None = None
        self.step_s: float | None = None  # moving average of the time between bursts
        self.tokens_per_step: float | None = None  # moving average of a burst's size
        self.last_release: float | None = None

    @property
    def gap_s(self) -> float | None:
        """The measured token rate as a gap between tokens."""
        if self.step_s is None or not self.tokens_per_step:
            return None
        return self.step_s / self.tokens_per_step

    def plan(self, now: float, n: int) -> list[float]:
        """Release times for ``n`` tokens arriving at ``now`` (non-decreasing, none before ``now``)."""
        if n <= 0:
            return []
        if self.last_arrival is not None:
            self._measure(now - self.last_arrival, n)
        self.last_arrival = now
        gap = self.gap_s
        if gap is None:  # the first burst (the prefill's token): nothing to pace at yet
            times = [now] * n
        else:
            deadline = now + self.step_s  # when the next burst is expected
            start = now if self.last_release is None else max(now, self.last_release + gap)
            room = deadline - start
            # The last token leaves at start + (n - 1) * step <= start + (n - 1) / n * room < deadline.
            step = min(gap, room / n) if room > 0 else 0.0
            times = [start + i * step for i in range(n)]
        self.last_release = times[-1]
        return times

    def _measure(self, interval: float, n: int) -> None:
        if self.step_s is None:
            self.step_s, self.tokens_per_step = interval, float(n)
            return
        self.step_s += EMA_WEIGHT * (interval - self.step_s)
        self.tokens_per_step += EMA_WEIGHT * (n - self.tokens_per_step)


def split_text(text: str, weights: Sequence[int]) -> list[str]:
    """Cut ``text`` into ``len(weights)`` consecutive pieces sized in proportion to ``weights`` (each
    token's own decoded length), so that each piece is about one token's text. Pieces may be empty."""
    n = len(weights)
    if n <= 1:
        return [text] * n
    total = sum(max(0, w) for w in weights)
    if total <= 0:
        weights, total = [1] * n, n
    pieces, start, acc = [], 0, 0
    for w in weights[:-1]:
        acc += max(0, w)
        end = round(len(text) * acc / total)
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


class Pacer:
    """Hands a response's text pieces to ``emit(text, tokens)`` at paced times, in order.

    clock: the current time (the loop's ``time``); call_at(when, fn): schedule ``fn`` (the loop's
    ``call_at``, returning something with ``cancel()``). ``finish(then)`` runs ``then`` once every held
    piece has gone out; ``cancel()`` drops what is held.
    """

    def __init__(self, emit: Callable[[str, int], None], clock: Callable[[], float],
                 call_at: Callable[[float, Callable[[], None]], object]) -> None:
        self.emit = emit
        self.clock = clock
        self.call_at = call_at
        self.schedule = PaceSchedule()
        self._held: deque[tuple[float, str, int]] = deque()  # (release time, text, tokens)
        self._timer = None
        self._then: Callable[[], None] | None = None
        self._carry = 0  # tokens whose piece was empty, sent along with the next piece

    @property
    def holding(self) -> int:
        return len(self._held)

    def push(self, pieces: Sequence[str]) -> None:
        """One engine step's tokens, one text piece per token."""
        times = self.schedule.plan(self.clock(), len(pieces))
        for when, piece in zip(times, pieces):
            self._held.append((when, piece, 1))
        self._release()

    def push_tokens(self, tokens: int) -> None:
        """Tokens that brought no text (held back by the detokenizer): counted with the next piece."""
        if self._held:
            when, text, n = self._held.pop()
            self._held.append((when, text, n + tokens))
        else:
            self._carry += tokens

    def finish(self, then: Callable[[], None]) -> None:
        self._then = then
        self._release()

    def cancel(self) -> None:
        self._held.clear()
        self._then = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self) -> None:
        if self._timer is not None:  # called by push/finish while a timer waits: it is replaced below
            self._timer.cancel()
            self._timer = None
        now = self.clock()
        while self._held and self._held[0][0] <= now:
            _, text, tokens = self._held.popleft()
            tokens += self._carry
            self._carry = 0
            if text:
                self.emit(text, tokens)
            else:
                self._carry = tokens
        if self._held:
            self._timer = self.call_at(self._held[0][0], self._release)
            return
        if self._carry and self._then is not None:  # tokens with no text left at the end: count them
            self.emit("", self._carry)
            self._carry = 0
        if self._then is not None:
            then, self._then = self._then, None
            then()


def token_weights(tokenizer, token_ids) -> list[int]:
    """Each token's own decoded length (what :func:`split_text` cuts by); 1 each without a tokenizer."""
    if tokenizer is None:
        return [1] * len(token_ids)
    return [len(tokenizer.decode([t], skip_special_tokens=True)) for t in token_ids]
