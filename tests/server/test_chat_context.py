"""Chats that never dead-end: ``truncation: "auto"`` leaves out the oldest turns (never the system
message) so prompt + max_output_tokens fits, clamps the reply when even the newest turn is long, and
says what it did; and every token of a response is counted in some delta."""

from __future__ import annotations

from specserve.server.prompts import messages_to_text

from server_utils import greedy_text
from wsclient import Conn

SYSTEM = {"role": "system", "content": "You answer in code."}


def conversation(turns: int) -> list[dict]:
    messages = [SYSTEM]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: " + "def f(x): return x " * 6})
        messages.append({"role": "assistant", "content": f"answer {i}: " + "class A: pass " * 6})
    messages.append({"role": "user", "content": "and now?"})
    return messages


def tokens(llm, messages) -> int:
    text, _ = messages_to_text(llm.tokenizer, messages)
    return len(llm.encode(text))


def test_the_oldest_turns_are_left_out_to_keep_room_for_the_reply(server, reference_llm):
    messages = conversation(12)
    assert tokens(reference_llm, messages) + 100 > 512  # it would not fit
    with Conn(server.ws_url) as c:
        reply = c.request({"type": "response.create", "response": {
            "messages": messages, "max_output_tokens": 100, "truncation": "auto", "temperature": 0, "ignore_eos": True}})
        assert reply["type"] == "response.created", reply
        dropped = reply["response"]["dropped_messages"]
        done = c.wait_done(reply["response"]["id"])
    assert dropped > 0 and dropped % 2 == 0  # whole turns: a question with its answer
    kept = [SYSTEM] + messages[1 + dropped:]
    assert kept[1]["role"] == "user"
    assert reply["response"]["input_tokens"] == tokens(reference_llm, kept) <= 512 - 100
    assert tokens(reference_llm, [SYSTEM] + messages[dropped - 1:]) > 512 - 100  # no more was dropped than needed
    assert reply["response"]["max_output_tokens"] == 100 and done["usage"]["output_tokens"] == 100
    text, _ = messages_to_text(reference_llm.tokenizer, kept)
    assert c.text(reply["response"]["id"]) == greedy_text(reference_llm, text, 100, ignore_eos=True)


def test_a_long_newest_turn_clamps_the_reply(server, reference_llm):
    long_question = {"role": "user", "content": "def f(x): return x + 1 " * 20}
    messages = conversation(2)[:-1] + [long_question]
    with Conn(server.ws_url) as c:
        reply = c.request({"type": "response.create", "response": {
            "messages": messages, "max_output_tokens": 256, "truncation": "auto", "ignore_eos": True}})
        done = c.wait_done(reply["response"]["id"])
    kept = [SYSTEM, long_question]
    room = 512 - tokens(reference_llm, kept)
    assert 0 < room < 256
    assert reply["response"]["dropped_messages"] == 4 and reply["response"]["max_output_tokens"] == room
    assert done["usage"]["output_tokens"] == room and done["incomplete_details"] == {"reason": "context_length"}


def test_without_truncation_a_conversation_past_the_window_is_refused(server):
    with Conn(server.ws_url) as c:
        err = c.request({"type": "response.create", "response": {"messages": conversation(30)}})
    assert err["type"] == "error" and err["error"]["code"] == "context_length_exceeded"


def test_the_last_steps_tokens_are_in_a_delta_even_without_text(server, reference_llm):
    full = greedy_text(reference_llm, "def f(x):", 30, ignore_eos=True)
    stop = full[12:15]  # the stop string's own tokens bring no text
    with Conn(server.ws_url) as c:
        for extra in ({"stop": [stop]}, {}):
            rid = c.create(input="def f(x):", max_output_tokens=30, temperature=0, ignore_eos=True, **extra)
            done = c.wait_done(rid)
            assert sum(d["tokens"] for d in c.deltas[rid]) == done["usage"]["output_tokens"], extra
