"""The chat page end to end in a real headless Chromium: stream a reply, show its stats, stop a reply,
send a JSON schema with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve import LLM
from specserve.server.prompts import messages_to_text

from cdp import CHROMIUM, Chromium
from server_utils import greedy_text, kv_blocks, wait_until

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"needs Debian's chromium at {CHROMIUM} (.ci/run installs it)")

LAST = "(() => { const m = document.querySelectorAll('.msg.assistant'); return m[m.length - 1]; })()"


def test_chat_page_streams_shows_stats_and_stops(make_server, noeos_dir):
    srv = make_server(model_dir=noeos_dir, llm_kwargs={"drafter": "ngram"})
    reference = LLM(noeos_dir)
    with Chromium(srv.http_url) as page:
        page.wait_for("document.getElementById('status').dataset.state === 'ready'")
        assert "ngram" in page.eval("document.getElementById('model').textContent")

        # Turn 1: greedy, 24 tokens; the streamed text is exactly what LLM.generate gives.
        page.set_value("#temperature", "0")
        page.set_value("#max-tokens", "24")
        page.type("#prompt", "hello there")
        page.click("#send")
        page.wait_for(f"{LAST}?.dataset.status === 'incomplete'")
        text = page.eval(f"{LAST}.querySelector('.content').textContent")
        prompt, _ = messages_to_text(reference.tokenizer, [{"role": "user", "content": "hello there"}])
        assert text == greedy_text(reference, prompt, 24)
        stats = page.eval(f"(() => {{ const e = {LAST}; return {{...e.dataset, shown: e.querySelector('.stats').textContent}}; }})()")
        assert float(stats["ttftMs"]) > 0 and float(stats["tps"]) > 0 and float(stats["tau"]) >= 1.0
        assert stats["outputTokens"] == "24"
        assert "TTFT" in stats["shown"] and "tok/s" in stats["shown"] and "τ" in stats["shown"]
        assert page.eval("document.getElementById('send').disabled") is False

        # Turn 2: a long reply (the model has no EOS), sent with Enter, stopped with the button.
        page.set_value("#max-tokens", "1500")
        page.type("#prompt", "go on")
        for kind in ("keyDown", "keyUp"):
            page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)
        page.wait_for(f"document.querySelectorAll('.msg.assistant').length === 2 && "
                      f"{LAST}.querySelector('.content').textContent.length > 0 && !document.getElementById('stop').disabled")
        page.click("#stop")
        page.wait_for(f"{LAST}.dataset.status === 'cancelled'")
        assert int(page.eval(f"{LAST}.dataset.outputTokens")) < 1500
        assert page.eval("document.getElementById('stop').disabled") is True
        assert page.eval("document.querySelectorAll('.msg.user').length") == 2
        assert page.eval("document.getElementById('error').textContent") == ""
    assert wait_until(lambda: kv_blocks(srv)[0] == kv_blocks(srv)[1] and srv.server.in_flight == 0)


def test_ten_turn_chat_with_the_embedded_model_never_dead_ends():
    """The issue's dead end: 512-token context, replies of up to 64 tokens, ten turns. Older turns are left
    out (and greyed out, with a note), every turn is answered and labelled, a refused message says so."""
    from specserve.server import BackgroundServer, ServerConfig

    with BackgroundServer(LLM(), ServerConfig(port=0, threads=1)) as srv, Chromium(srv.http_url) as page:
        page.wait_for("document.getElementById('status').dataset.state === 'ready'")
        assert page.eval("document.getElementById('temperature').value") == "1"  # the shared default
        page.set_value("#max-tokens", "64")
        questions = ["def fibonacci(n):", "write a stack class", "add a pop method", "read a file", "sort a list",
                     "parse json", "write a unittest", "what does yield do?", "make it async", "summarize"]
        for i, question in enumerate(questions, start=1):
            page.type("#prompt", question)
            page.click("#send")
            page.wait_for(f"document.querySelectorAll('.msg.assistant').length === {i} && "
                          f"{LAST}.dataset.status !== 'streaming'", timeout=60)
            status = page.eval(f"{LAST}.dataset.status")
            assert status in ("completed", "incomplete"), (i, status)
            shown = page.eval(f"{LAST}.querySelector('[data-k=\"status\"]').textContent")
            tokens = page.eval(f"{LAST}.dataset.outputTokens")
            assert shown == ("" if status == "completed" else f"cut at {tokens} tokens")
            assert "tok/s" in page.eval(f"{LAST}.querySelector('.stats').textContent")
        assert page.eval("document.getElementById('error').textContent") == ""
        assert page.eval("document.querySelectorAll('.note').length") >= 1
        assert "left out to fit the 512-token context" in page.eval("document.querySelector('.note').textContent")
        assert page.eval("document.querySelectorAll('.msg.dropped').length") >= 2
        # A message the context cannot hold even alone: refused, and marked as not sent.
        page.type("#prompt", "def f(x): return x + 1 " * 300)
        page.click("#send")
        page.wait_for("document.querySelector('.msg.user.unsent') !== null")
        assert "not sent: " in page.eval("document.querySelector('.msg.user.unsent').textContent")
        assert "context_length_exceeded" in page.eval("document.getElementById('error').textContent")
        assert page.eval("document.querySelectorAll('.msg.assistant').length") == 10
        # ... and the chat goes on.
        page.type("#prompt", "one more")
        page.click("#send")
        page.wait_for(f"document.querySelectorAll('.msg.assistant').length === 11 && {LAST}.dataset.status !== 'streaming'",
                      timeout=60)


def test_structured_output_from_the_page(server):
    """A schema in the "Structured output" box: the reply parses as JSON valid against it; a schema the
    server cannot compile is an invalid_grammar error (the message is not sent), one that is not JSON never
    leaves the page; then the chat goes on."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    with Chromium(server.http_url) as page:
        page.wait_for("document.getElementById('status').dataset.state === 'ready'")
        page.set_value("#max-tokens", "64")
        page.click("#structured summary")
        page.wait_for("document.getElementById('structured').open")
        page.type("#schema", json.dumps(schema))
        page.type("#prompt", "give me a and b")
        page.click("#send")
        page.wait_for(f"{LAST}?.dataset.status && {LAST}.dataset.status !== 'streaming'")
        assert page.eval(f"{LAST}.dataset.status") == "completed"
        reply = json.loads(page.eval(f"{LAST}.querySelector('.content').textContent"))
        assert set(reply) == {"a", "b"} and 0 <= reply["a"] <= 999 and isinstance(reply["b"], bool)

        page.set_value("#schema", '{"type": "nope"}')  # JSON, but no schema: the server refuses it
        page.type("#prompt", "again")
        page.click("#send")
        page.wait_for("document.querySelector('.msg.user.unsent') !== null")
        assert "invalid_grammar" in page.eval("document.getElementById('error').textContent")
        assert page.eval("document.querySelectorAll('.msg.assistant').length") == 1

        page.set_value("#schema", "{oops")  # not JSON: refused on the page, the typed message stays
        page.type("#prompt", "once more")
        page.click("#send")
        assert "not valid JSON" in page.eval("document.getElementById('error').textContent")
        assert page.eval("document.getElementById('prompt').value") == "once more"
        assert page.eval("document.querySelectorAll('.msg.user').length") == 2

        page.set_value("#schema", "")  # empty: plain text again
        page.click("#send")
        page.wait_for(f"document.querySelectorAll('.msg.assistant').length === 2 && {LAST}.dataset.status !== 'streaming'")
        assert page.eval(f"{LAST}.dataset.schema") is None and page.eval("document.getElementById('error').textContent") == ""
