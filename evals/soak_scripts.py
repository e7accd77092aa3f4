"""The scripts of `specserve bench soak`'s clients: what a well-behaved client does and what a hostile one does.

A client runs actions until the deadline, each picked at random (its own seeded ``random.Random``) by
weight. Every action checks what it was answered: a greedy answer equals its solo reference, a seeded
sampled one reproduces (only where the project promises it: see ``Soak.check_seeds``), a hostile
input gets its documented error code, a cancelled response ends ``cancelled`` (or finished before the
cancel landed), and the connection goes on serving afterwards. Well-behaved clients' latencies are
recorded per phase; hostile clients' are not.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from specserve.evals.soak_clients import (
    Tally,
    WsConn,
    WsResponse,
    http_post,
    http_send_and_leave,
    http_stream,
    http_whole,
)

FINISHED = ("completed", "incomplete")  # a response.done status that ran to its end (EOS, stop or length)
CHOICES = ["yes", "no", "maybe"]
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}  # each chunk's token count is known


@dataclass(frozen=True)
class Reference:
    """A request and the text it must produce: greedy (``seed`` None) or seeded sampled, answered solo."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    text: str = ""
    ids: tuple[int, ...] = ()  # the prompt's token ids (sent instead of its text now and then)

    def ws(self, as_ids: bool = False, **extra) -> dict:
        return {"input": list(self.ids) if as_ids else self.prompt, "max_output_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": self.seed, "stop": list(self.stop), **extra}

    def http(self, stream: bool = True, **extra) -> dict:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "seed": self.seed, "stream": stream, **extra}
        if self.stop:
            body["stop"] = list(self.stop)
        return body | {"stream_options": STREAM_OPTIONS} if stream else body


@dataclass
class Soak:
    """What every script needs: where the server is, the references, its limits, the shared tally."""

    ws_url: str
    http_url: str  # http://127.0.0.1:PORT (no trailing slash)
    tally: Tally
    greedy: list[Reference]
    seeded: list[Reference]
    check_seeds: bool  # seeded sampling reproduces only under static speculation (or no drafter): README
    drafter: str | None  # the server's drafter spec (sessions may switch between it and "none")
    context_length: int
    max_message_bytes: int
    max_responses_per_connection: int
    vocab_size: int
    deadline: float = 0.0
    # Ids of responses other connections have open right now: a hostile client tries to cancel them.
    others: set[str] = field(default_factory=set)

    @property
    def completions(self) -> str:
        return self.http_url + "/v1/completions"


# ---- checks shared by the scripts ----------------------------------------------------------------------


def check_answer(soak: Soak, where: str, ref: Reference, status: str | None, text: str, speculated: bool = True) -> None:
    """A well-formed request ran to its end and, where it is deterministic, produced its reference."""
    t = soak.tally
    if status not in FINISHED:
        t.violation("answer", f"{where}: a valid request ended {status!r}")
        return
    if ref.seed is None:
        t.checks["greedy"] += 1
        if text != ref.text:
            t.violation("mismatch", f"{where}: greedy {ref.prompt!r} gave {text[:60]!r}, solo {ref.text[:60]!r}")
    elif soak.check_seeds and speculated:
        t.checks["seeded"] += 1
        if text != ref.text:
            t.violation("seed", f"{where}: seed {ref.seed} on {ref.prompt!r} gave {text[:60]!r}, solo {ref.text[:60]!r}")
    else:
        t.checks["seeded, not checked"] += 1


async def ws_reference(soak: Soak, conn: WsConn, ref: Reference, where: str, measure: bool, speculated: bool = True,
                       **options) -> None:
    resp, err = await conn.create(ref.ws(**options))
    if resp is None:
        soak.tally.violation("answer", f"{where}: a valid request was refused: {err}")
        return
    soak.others.add(resp.id)
    try:
        done = await conn.finish(resp)
    finally:
        soak.others.discard(resp.id)
    if done is not None:
        check_answer(soak, where, ref, done.get("status"), resp.seen.text, speculated)
        if measure:
            soak.tally.latency(resp.seen, "ws " + ("seeded" if ref.seed is not None else "greedy"), done.get("timing"))


async def http_reference(soak: Soak, http, ref: Reference, where: str, measure: bool, stream: bool = True,
                         **extra) -> None:
    request = http_stream if stream else http_whole
    result = await request(http, soak.completions, ref.http(stream, **extra), soak.tally, where)
    if result is None:
        return
    if result.status != 200 or result.error is not None:
        soak.tally.violation("answer", f"{where}: a valid request failed: HTTP {result.status} {result.error}")
        return
    status = "completed" if result.finish_reason in ("stop", "length") else f"finish_reason {result.finish_reason}"
    check_answer(soak, where, ref, status, result.seen.text, extra.get("drafter") != "none")
    if measure and stream:  # a whole answer has no first token to time
        soak.tally.latency(result.seen, "http greedy")


async def wait_tokens(resp: WsResponse, n: int) -> None:
    """Until ``resp`` has streamed ``n`` tokens or ended (bounded by its script's wait for the end)."""
    start = time.perf_counter()
    while resp.seen.tokens < n and resp.done is None and time.perf_counter() - start < 60:
        await asyncio.sleep(0.002)


def pacing(rng: random.Random) -> str:
    """Smooth pacing now and then: its pacer holds text back, and must still deliver every piece exactly once."""
    return "smooth" if rng.random() < 0.25 else "off"


def long_request(soak: Soak, rng: random.Random, tokens: int = 96) -> dict:
    """A greedy response long enough to be interrupted (ignore_eos: it runs to max_output_tokens). Not longer:
    hostile clients are to misbehave, not to be the load that well-behaved latency is compared without."""
    return {"input": rng.choice(soak.greedy).prompt, "max_output_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream_pacing": pacing(rng)}


# ---- well-behaved actions -------------------------------------------------------------------------------


async def good_ws_greedy(soak, conn, http, rng, where):
    await ws_reference(soak, conn, rng.choice(soak.greedy), where, measure=True, as_ids=rng.random() < 0.3,
                       stream_pacing=pacing(rng))


async def good_http_greedy(soak, conn, http, rng, where):
    await http_reference(soak, http, rng.choice(soak.greedy), where, measure=True, stream=rng.random() < 0.7)


async def good_http_chat(soak, conn, http, rng, where):
    """A streamed chat completion, sampled without a seed: it must run to its end."""
    body = {"messages": [{"role": "user", "content": rng.choice(soak.greedy).prompt}], "max_tokens": 24,
            "temperature": 0.8, "stream": True, "stream_options": STREAM_OPTIONS}
    result = await http_stream(http, soak.http_url + "/v1/chat/completions", body, soak.tally, where)
    if result is not None and (result.status != 200 or result.error or result.finish_reason not in ("stop", "length")):
        soak.tally.violation("answer", f"{where}: a chat completion ended {result.status} {result.error} {result.finish_reason}")
    elif result is not None:
        soak.tally.latency(result.seen, "http chat")


async def good_ws_seeded(soak, conn, http, rng, where):
    await ws_reference(soak, conn, rng.choice(soak.seeded), where, measure=True)


async def good_ws_chat(soak, conn, http, rng, where):
    """A chat turn, sampled without a seed: nothing to compare, but it must run to its end."""
    ref = rng.choice(soak.greedy)
    resp, err = await conn.create({"messages": [{"role": "user", "content": ref.prompt}], "max_output_tokens": 24,
                                   "temperature": 0.8, "stream_pacing": pacing(rng)})
    if resp is None:
        soak.tally.violation("answer", f"{where}: a chat turn was refused: {err}")
        return
    done = await conn.finish(resp)
    if done is not None and done.get("status") not in FINISHED:
        soak.tally.violation("answer", f"{where}: a chat turn ended {done.get('status')!r}")
    soak.tally.latency(resp.seen, "ws chat", (done or {}).get("timing"))


async def good_ws_choice(soak, conn, http, rng, where):
    """Structured output: the answer is exactly one of the choices."""
    resp, err = await conn.create({"input": rng.choice(soak.greedy).prompt, "max_output_tokens": 8, "temperature": 0.7,
                                   "text": {"format": {"type": "choice", "choices": CHOICES}}})
    if resp is None:
        soak.tally.violation("answer", f"{where}: a choice request was refused: {err}")
        return
    done = await conn.finish(resp)
    if done is not None and (done.get("status") != "completed" or resp.seen.text not in CHOICES):
        soak.tally.violation("answer", f"{where}: choice request ended {done.get('status')!r} with {resp.seen.text!r}")
    soak.tally.latency(resp.seen, "ws choice", (done or {}).get("timing"))


GOOD = {"ws greedy": (good_ws_greedy, 4), "http greedy": (good_http_greedy, 2), "ws seeded": (good_ws_seeded, 2),
        "ws chat": (good_ws_chat, 1), "http chat": (good_http_chat, 1), "ws choice": (good_ws_choice, 1)}


# ---- hostile actions ------------------------------------------------------------------------------------


async def bad_cancel(soak, conn, http, rng, where):
    """Cancel after a random number of tokens (0: as soon as it is created), sometimes twice."""
    resp, err = await conn.create(long_request(soak, rng))
    if resp is None:
        soak.tally.violation("answer", f"{where}: refused: {err}")
        return
    await wait_tokens(resp, rng.choice((0, 1, 2, 5, 20)))
    for _ in range(rng.choice((1, 1, 2))):
        await conn.send({"type": "response.cancel", "response_id": resp.id})  # answered by its response.done
    done = await conn.finish(resp)
    if done is not None and done.get("status") not in ("cancelled", *FINISHED):
        soak.tally.violation("answer", f"{where}: a cancelled response ended {done.get('status')!r}")


async def bad_disconnect(soak, conn, http, rng, where):
    """A fresh connection starts responses and vanishes mid-stream: abruptly (no close frame) or cleanly.
    Now and then it goes before its first response is even answered: a long chat, tokenized off the loop."""
    other = await WsConn.open(soak.ws_url, soak.tally, where + "-gone")
    if rng.random() < 0.3:
        turns = [{"role": ("user", "assistant")[i % 2], "content": "x = 1\n" * 400} for i in range(9)]
        await other.send({"type": "response.create", "response": {"messages": turns, "truncation": "auto",
                                                                 "max_output_tokens": 32}})
        await asyncio.sleep(rng.uniform(0, 0.02))
        other.abort()
        await other.close()
        return
    responses = []
    for _ in range(rng.randint(1, 3)):
        resp, _err = await other.create(long_request(soak, rng))
        responses.append(resp)
    if responses[0] is not None:
        await wait_tokens(responses[0], rng.choice((0, 1, 8)))
    if rng.random() < 0.5:
        other.abort()
    await other.close()


async def bad_http_disconnect(soak, conn, http, rng, where):
    """An HTTP client that goes away after a few chunks, or at a random moment (before its answer, perhaps)."""
    ref = rng.choice(soak.greedy)
    stream = rng.random() < 0.7
    body = {"prompt": ref.prompt, "max_tokens": 96, "temperature": 0, "ignore_eos": True, "stream": stream,
            "stream_pacing": pacing(rng)}
    if stream and rng.random() < 0.5:
        await http_stream(http, soak.completions, body, soak.tally, where, stop_after_chunks=rng.randint(1, 4))
        return
    if rng.random() < 0.3:
        await http_send_and_leave(soak.http_url, "/v1/completions", body)
        return
    request = (http_stream if stream else http_whole)(http, soak.completions, body, soak.tally, where)
    task = asyncio.ensure_future(request)
    await asyncio.sleep(rng.uniform(0, 0.05))
    task.cancel()  # aiohttp closes the connection under the request
    await asyncio.gather(task, return_exceptions=True)


async def bad_slow_reader(soak, conn, http, rng, where):
    """Stop reading for a while with several responses streaming: they finish, or fail with slow_consumer
    (the server's bound on a connection's unsent output) — either way each gets exactly one response.done."""
    other = await WsConn.open(soak.ws_url, soak.tally, where + "-slow", max_queue=1, rcvbuf=4096)
    try:
        responses = []
        for _ in range(rng.randint(2, soak.max_responses_per_connection)):
            resp, err = await other.create(long_request(soak, rng, 192))
            if resp is None:
                soak.tally.violation("answer", f"{where}: refused: {err}")
            else:
                responses.append(resp)
        other.reading.clear()
        await asyncio.sleep(rng.uniform(0.5, 4.0))
        other.reading.set()
        for resp in responses:
            done = await other.finish(resp)
            if done is None:
                continue
            code = (done.get("error") or {}).get("code")
            soak.tally.checks["slow reader's response " + (code or done.get("status", "?"))] += 1
            if done.get("status") not in FINISHED and code != "slow_consumer":
                soak.tally.violation("answer", f"{where}: a slow reader's response ended {done.get('status')!r} {code}")
    finally:
        await other.close()


#: Frames that do not parse (answered by an error without an event_id) and their codes.
MALFORMED = [("{not json", "invalid_json"), (b"\x00\x01binary", "binary_not_supported"), ("[1, 2]", "invalid_event"),
             ('{"type": "response.create", "response": {"input": "x", "temperature": NaN}}', "invalid_json"),
             ("[" * 5000 + "]" * 5000, "invalid_json"), ('{"type": 7}', "invalid_type"), ('"just a string"', "invalid_event")]


async def bad_malformed(soak, conn, http, rng, where):
    """Garbage frames and unknown events, then a normal request on the same connection: still right."""
    for frame, code in rng.sample(MALFORMED, 3):
        await conn.send_raw(frame)
        soak.tally.expect_error(f"{where} {str(frame)[:30]!r}", ((await conn.anonymous_error()) or {}).get("error"), code)
    if soak.others:  # someone else's response: not this connection's to cancel (its owner must not see a cancel)
        victim = rng.choice(sorted(soak.others))
        reply = await conn.request({"type": "response.cancel", "response_id": victim})
        soak.tally.expect_error(f"{where} cancel of another connection's response", (reply or {}).get("error"),
                                "response_not_found")
    for event, code in [({"type": "response.frobnicate"}, "unknown_event_type"),
                        ({"type": "response.create", "response": {"input": "x", "bogus": 1}}, "unknown_field"),
                        ({"type": "response.cancel", "response_id": "resp_nope"}, "response_not_found"),
                        ({"type": "session.update", "session": {"drafter": "no-such-drafter"}}, "drafter_unavailable")]:
        reply = await conn.request(event)
        soak.tally.expect_error(f"{where} {event['type']}", (reply or {}).get("error"), code)
    for body, code in ((b"{not json", "invalid_json"), ({"prompt": "x", "bogus": 1}, "unknown_field")):
        status, err = await http_post(http, soak.completions, body, soak.tally)
        soak.tally.expect_error(f"{where} HTTP {status}", err, code)
    await ws_reference(soak, conn, rng.choice(soak.greedy), where, measure=False)


async def bad_oversized(soak, conn, http, rng, where):
    """A frame over the limit is refused and the connection goes on; past twice the limit it is closed (1009)."""
    limit = soak.max_message_bytes
    big = json.dumps({"type": "response.create", "response": {"input": "a" * (limit + limit // 2)}})
    await conn.send_raw(big)
    soak.tally.expect_error(f"{where} oversized frame", ((await conn.anonymous_error()) or {}).get("error"),
                            "message_too_large")
    status, err = await http_post(http, soak.completions, {"prompt": "a" * (limit + 1), "max_tokens": 1}, soak.tally)
    soak.tally.expect_error(f"{where} HTTP {status} oversized body", err, "message_too_large")
    other = await WsConn.open(soak.ws_url, soak.tally, where + "-huge")
    try:
        await other.send_raw("a" * (3 * limit))
        await asyncio.wait_for(other.closed.wait(), 60)
        if other.close_code != 1009:
            soak.tally.violation("answer", f"{where}: a frame past twice the limit closed with {other.close_code}, not 1009")
    except TimeoutError:
        soak.tally.violation("answer", f"{where}: a frame past twice the limit did not close the connection")
    finally:
        await other.close()


async def bad_too_long(soak, conn, http, rng, where):
    """Prompts past the context window: token ids, a long text (tokenized off the loop), and over HTTP."""
    ids = [rng.randrange(soak.vocab_size) for _ in range(soak.context_length + 8)]
    for response in ({"input": ids}, {"input": "a " * 12_000}):
        _resp, err = await conn.create(response)
        soak.tally.expect_error(f"{where} long prompt", err, "context_length_exceeded")
    _resp, err = await conn.create({"input": "x", "max_output_tokens": soak.context_length})
    soak.tally.expect_error(f"{where} max_output_tokens past the window", err, "invalid_value")
    status, err = await http_post(http, soak.completions, {"prompt": ids, "max_tokens": 4}, soak.tally)
    soak.tally.expect_error(f"{where} HTTP {status} long prompt", err, "context_length_exceeded")


#: Sampling values the protocol refuses, and their codes.
BAD_SAMPLING = [({"temperature": -1}, "invalid_value"), ({"top_p": 0}, "invalid_value"), ({"top_k": -3}, "invalid_value"),
                ({"min_p": 2}, "invalid_value"), ({"seed": -1}, "invalid_value"), ({"temperature": "hot"}, "invalid_type"),
                ({"max_output_tokens": 0}, "invalid_value"), ({"stop": ["s"] * 17}, "invalid_value"),
                ({"temperature": 1e-9}, "invalid_value"), ({"top_k": 2**40}, "invalid_value")]


async def bad_sampling(soak, conn, http, rng, where):
    for fields, code in rng.sample(BAD_SAMPLING, 3):
        _resp, err = await conn.create({"input": "def f(x):", **fields})
        soak.tally.expect_error(f"{where} {fields}", err, code)
    fields, code = rng.choice(BAD_SAMPLING)
    body = {"prompt": "def f(x):", "max_tokens": 4, **{("max_tokens" if k == "max_output_tokens" else k): v for k, v in fields.items()}}
    status, err = await http_post(http, soak.completions, body, soak.tally)
    soak.tally.expect_error(f"{where} HTTP {status} {fields}", err, code)


#: Structured output that does not compile (each an invalid_grammar).
BAD_FORMATS = [{"type": "json_schema", "name": "x", "schema": {"type": "nope"}},
               {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 3}}}},
               {"type": "grammar", "definition": "start: nope"}, {"type": "grammar", "syntax": "regex", "definition": "[a-"},
               {"type": "choice", "choices": []}, {"type": "json_schema", "name": "x", "schema": "{}"}]


async def bad_grammar(soak, conn, http, rng, where):
    for fmt in rng.sample(BAD_FORMATS, 2):
        _resp, err = await conn.create({"input": "def f(x):", "max_output_tokens": 8, "text": {"format": fmt}})
        soak.tally.expect_error(f"{where} {json.dumps(fmt)[:60]}", err, "invalid_grammar")
    body = {"prompt": "def f(x):", "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}
    status, err = await http_post(http, soak.completions, body, soak.tally)
    soak.tally.expect_error(f"{where} HTTP {status} response_format", err, "invalid_grammar")


def heavy_grammar(rng, words: int) -> dict:
    """A Lark alternation of ``words`` random words (a new grammar each time: no cache hit, a real compile).
    1,500 words are ~27 kB, under the soak's 64 KiB frames (definitions past 65,536 characters are refused
    before compiling: tests/grammar) and llguidance's 2,000 items per row (past that the matcher gives up
    at the first token), and take ~0.04 s to compile."""
    salt = rng.randrange(1 << 30)
    return {"type": "grammar", "definition": "start: " + " | ".join(f'"w{salt:x}{i}"' for i in range(words))}


async def bad_heavy_grammar(soak, conn, http, rng, where):
    """Pathological constraints: a big valid one is compiled off the engine thread and answered within
    its grammar; one whose matcher gives up after a token ends that response (failed), never the server."""
    resp, err = await conn.create({"input": "def f(x):", "max_output_tokens": 16, "temperature": 0,
                                   "text": {"format": heavy_grammar(rng, 1500)}})
    if resp is None:
        soak.tally.violation("answer", f"{where}: a big valid grammar was refused: {err}")
    else:
        done = await conn.finish(resp)
        if done is not None and (done.get("status") not in ("completed", "incomplete") or not resp.seen.text.startswith("w")):
            soak.tally.violation("answer", f"{where}: a big grammar ended {done.get('status')!r} with {resp.seen.text!r}")
    resp, err = await conn.create({"input": "x", "max_output_tokens": 3,
                                   "text": {"format": {"type": "grammar", "definition": 'start: "a"{99999}'}}})
    if resp is not None:
        done = await conn.finish(resp)
        if done is not None and done.get("status") not in ("failed", "completed", "incomplete"):
            soak.tally.violation("answer", f"{where}: a give-up grammar ended {done.get('status')!r}")
    else:
        soak.tally.expect_error(f"{where} give-up grammar", err, "invalid_grammar")


async def bad_drafter_switch(soak, conn, http, rng, where):
    """Switch the session's drafter off and back on between requests, and per request over HTTP: greedy
    output never depends on speculation, so every answer still equals its reference."""
    for drafter in ("none", soak.drafter):
        if drafter is None:
            continue
        reply = await conn.request({"type": "session.update", "session": {"drafter": drafter}})
        got = ((reply or {}).get("session") or {}).get("drafter", "missing")
        if (reply or {}).get("type") != "session.updated" or got != (None if drafter == "none" else drafter):
            soak.tally.violation("answer", f"{where}: switching to drafter {drafter!r} answered {reply}")
        await ws_reference(soak, conn, rng.choice(soak.greedy), where, measure=False, speculated=drafter != "none")
    await http_reference(soak, http, rng.choice(soak.greedy), where, measure=False, drafter="none")


async def bad_burst(soak, conn, http, rng, where):
    """More responses than a connection may hold: the extra ones are refused, the rest cancelled at once."""
    other = await WsConn.open(soak.ws_url, soak.tally, where + "-burst")
    try:
        limit = soak.max_responses_per_connection
        created = []
        for i in range(limit + 2):
            resp, err = await other.create(long_request(soak, rng, 64))
            if resp is not None:
                created.append(resp)
            elif i >= limit:
                soak.tally.expect_error(f"{where} response {i + 1} of a burst", err, "too_many_responses")
            else:
                soak.tally.violation("answer", f"{where}: response {i + 1} of a burst refused: {err}")
        for resp in created:
            await other.send({"type": "response.cancel", "response_id": resp.id})
        await other.settle()
    finally:
        await other.close()


HOSTILE = {"cancel": (bad_cancel, 3), "disconnect": (bad_disconnect, 2), "http disconnect": (bad_http_disconnect, 2),
           "slow reader": (bad_slow_reader, 1), "malformed": (bad_malformed, 2), "oversized": (bad_oversized, 1),
           "too long": (bad_too_long, 1), "bad sampling": (bad_sampling, 1), "bad grammar": (bad_grammar, 1),
           "heavy grammar": (bad_heavy_grammar, 1),
           "drafter switch": (bad_drafter_switch, 2), "burst": (bad_burst, 1)}


# ---- clients ---------------------------------------------------------------------------------------------


async def client(soak: Soak, label: str, actions: dict, seed: int, once: bool = False) -> None:
    """Run weighted random ``actions`` until the deadline (``once``: each action once, in order: the warm-up)."""
    import aiohttp

    rng = random.Random(seed)
    names = list(actions)
    weights = [actions[n][1] for n in names]
    async with aiohttp.ClientSession() as http:
        conn = await WsConn.open(soak.ws_url, soak.tally, label)
        try:
            plan = iter(names) if once else None
            while True:
                if once:
                    name = next(plan, None)
                    if name is None:
                        break
                elif time.perf_counter() >= soak.deadline:
                    break
                else:
                    name = rng.choices(names, weights)[0]
                soak.tally.kinds[name] += 1
                await actions[name][0](soak, conn, http, rng, f"{label} {name}")
                await conn.settle()  # every response it created has ended
                conn.forget_finished()
                if conn.closed.is_set():
                    soak.tally.violation("answer", f"{label}: the server closed the connection ({conn.close_code})")
                    conn = await WsConn.open(soak.ws_url, soak.tally, label)
        finally:
            await conn.close()
