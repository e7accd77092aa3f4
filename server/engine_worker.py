"""The engine thread: the only caller of Engine methods, fed by a command queue.

The event loop never touches the engine. It hands commands (submit, cancel, call, stop) to this
thread through a queue; the thread drains the queue between steps (so a cancel lands within one
step), runs ``Engine.step()`` while anything is unfinished, and blocks on the queue — no spinning —
when idle. What a step produced goes back to the loop in ONE ``loop.call_soon_threadsafe`` per step,
straight after the step returns: the first token leaves as soon as prefill has sampled it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.grammar.hooks import ConstraintRule
from specserve.sampling import SamplingParams
from specserve.server.engine_load import EngineLoad, read_engine_load

log = logging.getLogger("specserve.server")


@dataclass(frozen=True)
class Summary:
    """A finished request, as ``response.done`` reports it.

    reason: the engine's finish reason ("stop" | "length" | "cancelled" | "error": the model failed on
    the request's step, the engine lives on), or "rejected" (add_request refused it; ``error`` says why);
    "error" also when the whole step failed (``error`` says how).
    timing (ms, None when not reached): queue_ms = receipt → admitted into the running batch;
    ttft_ms = receipt → first token sampled; e2e_ms = receipt → finished; engine_ttft_ms = what the
    engine alone reports (add_request → first token), the figure LLM.generate gives as ttft_s.
    """

    reason: str
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens, those whose KV came from the prefix cache (not prefilled)
    spec: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    error: str | None = None
    drafted: int = 0  # draft tokens proposed over the request's verify steps
    accepted: int = 0  # of which the target accepted (bonus tokens not counted)
    # reason "error" because the request's own grammar matcher gave up (llguidance's work limits on a
    # pathological constraint): the client's constraint is at fault, not the server (invalid_grammar).
    constraint_failed: bool = False


@dataclass(frozen=True)
class Update:
    """What one step produced for one request: new text, its tokens, and the summary if it ended."""

    request_id: str
    text: str
    num_tokens: int
    done: Summary | None = None
    token_ids: tuple[int, ...] = ()  # the step's tokens (the pacer splits ``text`` along them)
    logprobs: tuple = ()  # one verify.logprobs.TokenLogprob per token, when the request asked
    prompt_logprobs: tuple | None = None  # on a request's first update, when it asked: per prompt token (None first)


Sink = Callable[[Update], None]


@dataclass
class _Live:
    sink: Sink
    received: float  # perf_counter when the server received response.create
    started: bool = False  # its first update went out (with the prompt's log-probabilities, when asked)


class EngineWorker:
    """Owns an Engine on a daemon thread. All public methods are thread-safe and never block.

    threads: torch intra-op threads for the engine thread (None: what the creating thread uses).
    Updates are delivered by calling each request's sink on ``loop``.
    """

    def __init__(self, engine, loop, threads: int | None = None, name: str = "specserve-engine") -> None:
        self.engine = engine
        self.loop = loop
        self.threads = threads if threads is not None else torch.get_num_threads()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        # submit(after=leader): requests held until the leader has its first token (or has ended), then
        # added before the next step — n choices of one prompt whose prefill the leader's cached blocks save.
        self._followers: dict[str, list[tuple]] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0
        # Queue depth, running sequences and KV blocks after the latest step, for /metrics: written by
        # the engine thread, read by the loop (one reference swap, so a reader never sees half of one).
        self.load: EngineLoad = read_engine_load(engine)

    @property
    def alive(self) -> bool:
        """The engine thread runs (GET /health answers 503 once it has died)."""
        return self._thread.is_alive()

    # ---- called from any thread -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, speculate: bool,
               received: float, sink: Sink, drafter_parts: tuple[str, ...] | None = None,
               client: str | None = None, after: str | None = None) -> None:
        """after: hold the request until request ``after`` has its first output token (or has ended)."""
        args = (request_id, prompt_ids, params, speculate, received, sink, drafter_parts, client)
        self._commands.put(("submit", *args) if after is None else ("follow", after, args))

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    def cancel_all(self) -> None:
        """Cancel every request in flight (each sink hears its summary, reason "cancelled")."""
        self._commands.put(("cancel_all",))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps (e.g. to read KV statistics)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; requests still running are dropped (their sinks hear nothing)."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # per thread under OpenMP: set it where the work runs
        with torch.inference_mode():
            while True:
                out: list[tuple[Sink, Update]] = []
                if not self._drain(block=not self.engine.has_unfinished() and not self._followers, out=out):
                    self._deliver(out)
                    return
                if self._followers:  # (a leader's first token comes in a step: its followers join the next)
                    self._release_followers(out)
                if self.engine.has_unfinished():
                    self._step(out)
                self.load = read_engine_load(self.engine)  # before delivering: whoever hears of a step sees its load
                self._deliver(out)

    def _drain(self, block: bool, out: list) -> bool:
        """Apply queued commands (waiting for one when idle); False once told to stop."""
        while True:
            try:
                cmd = self._commands.get() if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "submit":
                self._submit(*cmd[1:], out=out)
            elif kind == "follow":
                self._followers.setdefault(cmd[1], []).append(cmd[2])
            elif kind == "cancel":
                self._cancel(cmd[1], out)
            elif kind == "cancel_all":
                for rid in list(self._live):
                    self._cancel(rid, out)
                for rid in [args[0] for held in self._followers.values() for args in held]:
                    self._cancel(rid, out)
            elif kind == "call":
                fn, future = cmd[1], cmd[2]
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except BaseException as exc:  # handed to the caller, never lost
                        future.set_exception(exc)

    def _submit(self, rid, prompt_ids, params, speculate, received, sink, drafter_parts, client, out) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=rid, speculate=speculate, drafter_parts=drafter_parts,
                                    client=client)
        except (ValueError, TypeError) as exc:  # what add_request says is wrong with the request
            out.append((sink, Update(rid, "", 0, Summary("rejected", len(prompt_ids), error=str(exc)))))
            return
        except Exception as exc:  # a bug: this request fails, the engine thread lives on
            log.exception("add_request failed for %s", rid)
            out.append((sink, Update(rid, "", 0, Summary("error", len(prompt_ids), error=f"{type(exc).__name__}: {exc}"))))
            return
        self._live[rid] = _Live(sink, received)

    def _release_followers(self, out) -> None:
        """Add the held requests whose leader has its first token or has ended."""
        for leader in list(self._followers):
            req = self.engine.requests.get(leader)
            if leader not in self._live or req is None or req.num_output > 0:
                for args in self._followers.pop(leader):
                    self._submit(*args, out=out)

    def _cancel(self, rid: str, out) -> None:
        for leader, held in self._followers.items():  # still held: it never reached the engine
            for args in held:
                if args[0] == rid:
                    held.remove(args)
                    out.append((args[5], Update(rid, "", 0, Summary("cancelled", len(args[1])))))
                    return
        live = self._live.get(rid)
        if live is None or not self.engine.abort(rid):
            return  # unknown or already finished: its summary has gone (or goes) out already
        req = self.engine.pop_finished(rid)
        del self._live[rid]
        out.append((live.sink, Update(rid, "", 0, self._summary(req, live))))

    def _step(self, out) -> None:
        try:
            deltas = self.engine.step()
        except Exception as exc:  # a bug in a model or drafter: fail what is in flight, keep serving
            log.exception("engine step failed; failing %d in-flight request(s)", len(self._live))
            self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}", out)
            return
        self.steps += 1
        for d in deltas:
            live = self._live.get(d.request_id)
            if live is None:
                continue
            # Prompt log-probabilities go out with the request's first update (an echo leads with them).
            prompt_logprobs = None
            if not live.started:
                live.started = True
                req = self.engine.requests.get(d.request_id)
                if req is not None and req.prompt_logprobs is not None:
                    prompt_logprobs = tuple(req.prompt_logprobs)
            summary = None
            if d.finished:
                summary = self._summary(self.engine.pop_finished(d.request_id), live)
                del self._live[d.request_id]
            out.append((live.sink, Update(d.request_id, d.text, len(d.token_ids), summary, tuple(d.token_ids),
                                          d.logprobs, prompt_logprobs)))

    def _fail_all(self, message: str, out) -> None:
        for rid, live in list(self._live.items()):
            try:
                if self.engine.abort(rid):
                    self.engine.pop_finished(rid)
            except Exception:
                log.exception("could not abort %s after an engine failure", rid)
            out.append((live.sink, Update(rid, "", 0, Summary("error", error=message))))
        self._live.clear()

    @staticmethod
    def _summary(req, live: _Live) -> Summary:
        def ms(t: float | None, since: float) -> float | None:
            return None if t is None else round((t - since) * 1e3, 3)

        stats = req.stats
        return Summary(
            reason=req.finish_reason or "cancelled",
            input_tokens=req.prompt_len,
            output_tokens=req.num_output,
            cached_tokens=req.num_cached_tokens,
            spec={
                "tau": round(stats.mean_accepted_length, 4),
                "steps": stats.num_steps,
                "accepted_per_position": list(stats.accepted_per_position),
                **({"accepted_by_drafter": dict(stats.accepted_by_drafter)} if stats.accepted_by_drafter else {}),
            },
            timing={
                "queue_ms": ms(req.scheduled_time, live.received),
                "ttft_ms": ms(req.first_token_time, live.received),
                "e2e_ms": ms(req.finish_time, live.received),
                "engine_ttft_ms": ms(req.first_token_time, req.arrival_time),
            },
            error=req.error,
            drafted=stats.num_drafted,
            accepted=stats.num_emitted - stats.num_steps,  # each verify step emits its accepted tokens + 1 bonus
            constraint_failed=any(isinstance(rule, ConstraintRule) and rule.state.failed for rule in req.rules),
        )

    def _deliver(self, out: list[tuple[Sink, Update]]) -> None:
        if not out:
            return
        try:
            self.loop.call_soon_threadsafe(_dispatch, out)
        except RuntimeError:  # the loop has closed: the server is gone, nobody is listening
            pass


def _dispatch(out: list[tuple[Sink, Update]]) -> None:
    """On the event loop: hand each update to its request's sink; one failing sink spares the rest."""
    for sink, update in out:
        try:
            sink(update)
        except Exception:
            log.exception("delivering an update for %s failed", update.request_id)
