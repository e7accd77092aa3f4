"""The chat page end to end in a real headless Chromium: stream a reply, show its stats, stop a reply,
send a JSON schema with a message; and the page's Markdown renderer (window.renderMarkdown) on chosen
Markdown, on the page alone: blocks and inlines, code blocks and their Copy button, model HTML kept as
text, replies rendered from streamed prefixes, and a streamed reply rendered end to end."""

from __future__ import annotations

import json
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specserve import LLM
from specserve.server.page import page_response
from specserve.server.prompts import messages_to_text

from cdp import CHROMIUM, Chromium
from server_utils import greedy_text, kv_blocks, wait_until

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"needs Debian's chromium at {CHROMIUM} (.ci/run installs it)")

LAST = "(() => { const m = document.querySelectorAll('.msg.assistant'); return m[m.length - 1]; })()"


def fresh_render(page, text: str) -> str:
    """The innerHTML of `text` rendered at once into a new container."""
    return page.eval(f"(() => {{ const d = document.createElement('div'); renderMarkdown(d, {json.dumps(text)}); "
                     "return d.innerHTML; })()")


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
        text = page.eval(f"{LAST}.dataset.text")  # the raw reply; the message shows it rendered as Markdown
        prompt, _ = messages_to_text(reference.tokenizer, [{"role": "user", "content": "hello there"}])
        assert text == greedy_text(reference, prompt, 24)
        assert page.eval(f"{LAST}.querySelector('.content').innerHTML") == fresh_render(page, text)
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
        reply = json.loads(page.eval(f"{LAST}.querySelector('.content').textContent"))  # JSON: plain text
        assert page.eval(f"{LAST}.querySelector('.content').className") == "content plain"
        assert page.eval(f"{LAST}.querySelector('.content').children.length") == 0
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


# ---- the Markdown renderer ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page_only():
    """Chromium on the chat page alone, served with its real headers (CSP included) and no model behind
    it: its websocket finds no server and retries, which the renderer's tests do not need."""
    response = page_response()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] != "/":
                self.send_error(404)
                return
            self.send_response(200)
            for key, value in response.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(response.body)))
            self.end_headers()
            self.wfile.write(response.body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with Chromium(f"http://127.0.0.1:{httpd.server_port}/") as page:
            page.wait_for("typeof window.renderMarkdown === 'function'")
            page.origin = f"http://127.0.0.1:{httpd.server_port}"
            yield page
    finally:
        httpd.shutdown()
        httpd.server_close()


def rendered(page, text: str, query: str = "d.innerHTML", streaming: bool = False, keep: bool = False):
    """Render `text` into a reply-like container `d` in the page (so that any element in it is live) and
    return the JavaScript expression `query` over it; the container is removed unless `keep`."""
    return page.eval(f"""(() => {{
        const m = document.createElement('div'); m.className = 'msg assistant';
        const d = document.createElement('div'); d.className = 'content md'; m.append(d);
        document.getElementById('messages').append(m);
        renderMarkdown(d, {json.dumps(text)}, {json.dumps(streaming)});
        const result = ({query});
        {'' if keep else 'm.remove();'}
        return result;
    }})()""")


def test_markdown_blocks_and_inlines(page_only):
    text = ("# Title\n\nSome **bold**, *italic*, ~~gone~~ and `x = 1` code.\nA second line.\n\n"
            "- apple\n- banana\n  - nested\n\n3. three\n4. four\n\n> quoted\n\n---\n\n"
            "| name | n |\n|------|--:|\n| a | 2 |\n\n"
            "[docs](https://example.com/a?b=1) and <mailto:me@example.com>\n\nSetext\n---\n")
    got = rendered(page_only, text, """(() => {
        const q = (s) => d.querySelector(s), all = (s) => [...d.querySelectorAll(s)];
        return {
          top: [...d.children].map((e) => e.tagName + (e.className ? '.' + e.className : '')),
          h1: q('h1').textContent, strong: q('p strong').textContent, em: q('p em').textContent, del: q('p del').textContent,
          code: q('p > code').textContent, br: all('p:nth-of-type(1) br').length, p1: q('p').textContent,
          ul: all('ul:not(li ul) > li').map((li) => li.firstChild.textContent),
          nested: all('li ul > li').map((li) => li.textContent),
          ol: all('ol > li').map((li) => li.textContent), start: q('ol').getAttribute('start'),
          quote: q('blockquote').textContent.trim(), th: all('th').map((c) => c.textContent),
          td: all('td').map((c) => [c.textContent, c.style.textAlign]),
          links: all('a').map((a) => [a.textContent, a.getAttribute('href'), a.rel, a.target]),
          h2: q('h2').textContent,
        }; })()""")
    assert got["top"] == ["H1", "P", "UL", "OL", "BLOCKQUOTE", "HR", "DIV.table", "P", "H2"]
    assert (got["h1"], got["strong"], got["em"], got["del"], got["code"]) == ("Title", "bold", "italic", "gone", "x = 1")
    assert got["br"] == 1 and got["p1"] == "Some bold, italic, gone and x = 1 code.A second line."
    assert got["ul"] == ["apple", "banana"] and got["nested"] == ["nested"]
    assert got["ol"] == ["three", "four"] and got["start"] == "3"
    assert got["quote"] == "quoted" and got["th"] == ["name", "n"] and got["td"] == [["a", ""], ["2", "right"]]
    assert got["links"] == [["docs", "https://example.com/a?b=1", "noopener noreferrer", "_blank"],
                            ["mailto:me@example.com", "mailto:me@example.com", "noopener noreferrer", "_blank"]]
    assert got["h2"] == "Setext"

    # Exact output for the common shapes of a chat reply (tight and loose lists, nesting, emphasis rules).
    assert rendered(page_only, "1. **Step**: run `ls`\n2. Done *now*") == \
        "<ol><li><strong>Step</strong>: run <code>ls</code></li><li>Done <em>now</em></li></ol>"
    assert rendered(page_only, "- one\n\n- two\n  more") == "<ul><li><p>one</p></li><li><p>two<br>more</p></li></ul>"
    assert rendered(page_only, "***both*** snake_case_name 2 * 3 \\*lit\\* **a *b* c**") == \
        "<p><em><strong>both</strong></em> snake_case_name 2 * 3 *lit* <strong>a <em>b</em> c</strong></p>"
    assert rendered(page_only, "see https://example.com/x). and ``a ` b``") == \
        '<p>see <a href="https://example.com/x" target="_blank" rel="noopener noreferrer">https://example.com/x</a>). ' \
        "and <code>a ` b</code></p>"
    assert rendered(page_only, "- [ ] todo\n- [x] done",
                    "[...d.querySelectorAll('li.task > input[type=checkbox][disabled]')].map((e) => e.checked)") == [False, True]


def test_code_block_copy_button_copies_the_exact_code(page_only):
    code = "def f(x):\n\treturn '<b>' + x  # & \"quotes\"\n\n    indented  "
    text = f"Here:\n\n```python\n{code}\n```\n\nand after."
    got = rendered(page_only, text, """({
        code: d.querySelector('.codeblock > pre > code').textContent, lang: d.querySelector('.codeblock .lang').textContent,
        button: d.querySelector('.codeblock button.copy').textContent, state: d.querySelector('.codeblock').dataset.state,
        others: d.querySelectorAll('pre').length })""", keep=True)
    assert got == {"code": code, "lang": "python", "button": "Copy", "state": "closed", "others": 1}
    page = page_only
    page.call("Browser.grantPermissions", permissions=["clipboardReadWrite", "clipboardSanitizedWrite"], origin=page.origin)
    copy = "document.querySelector('.msg.assistant:last-child .codeblock .copy')"

    # navigator.clipboard (127.0.0.1 is a secure context)
    page.eval("navigator.clipboard.writeText('before')")
    page.click(".msg.assistant:last-child .codeblock .copy")
    page.wait_for(f"{copy}.textContent === 'Copied'")
    assert page.eval("navigator.clipboard.readText()") == code

    # No clipboard API (plain http on another host): a selected textarea and execCommand('copy').
    page.eval("navigator.clipboard.writeText('before')")
    page.eval(f"""(() => {{
        window.copies = [];
        const exec = document.execCommand.bind(document);
        document.execCommand = (command, ...rest) => {{
          const e = document.activeElement;
          window.copies.push([command, e.tagName, e.value.slice(e.selectionStart, e.selectionEnd)]);
          return exec(command, ...rest);
        }};
        Object.defineProperty(navigator, 'clipboard', {{value: undefined, configurable: true}});
        {copy}.textContent = 'Copy';
    }})()""")
    page.click(".msg.assistant:last-child .codeblock .copy")
    page.wait_for(f"{copy}.textContent === 'Copied'")
    assert page.eval("window.copies") == [["copy", "TEXTAREA", code]]
    assert page.eval("document.querySelectorAll('body > textarea').length") == 0  # the helper is gone
    page.eval("delete navigator.clipboard; delete document.execCommand")
    assert page.eval("navigator.clipboard.readText()") == code
    page.eval("document.querySelector('.msg.assistant:last-child').remove()")


def test_html_in_model_text_stays_text(page_only):
    text = ('<script>window.pwned = 1</script>\n\n<img src=x onerror="window.pwned = 2">\n\n'
            '[click](javascript:window.pwned=3) [up](JaVaScRiPt:alert(1)) [tab](java\tscript:alert(1)) '
            '[data](data:text/html,<script>alert(1)</script>) <javascript:alert(1)> ![pic](x onerror=alert(1)) '
            '![pic2](javascript:alert(1)) `<b>code</b>` **<i>bold</i>** <a href="javascript:alert(1)">a</a>\n\n'
            '```html\n<script>alert(1)</script><img src=x onerror=alert(1)>\n```\n\n'
            '- <iframe src="javascript:alert(1)"></iframe>\n\n# <style>body{display:none}</style>\n\n'
            '[fine](https://example.com/"><script>alert(1)</script>)')
    got = rendered(page_only, text, """({
        elements: [...d.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()).filter((t) =>
          !['p', 'br', 'code', 'strong', 'div', 'span', 'button', 'pre', 'ul', 'li', 'h1', 'a'].includes(t)),
        anchors: [...d.querySelectorAll('a')].map((a) => [a.getAttribute('href'), a.textContent]),
        attributes: [...new Set([...d.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name)))].sort(),
        text: d.textContent })""", keep=True)
    assert got["elements"] == []
    assert got["anchors"] == [["https://example.com/%22%3E%3Cscript%3Ealert(1)%3C/script%3E", "fine"]]  # a safe target, encoded
    assert got["attributes"] == ["class", "data-state", "href", "rel", "target", "title", "type"]
    for literal in ("<script>window.pwned = 1</script>", '<img src=x onerror="window.pwned = 2">', "click", "<b>code</b>",
                    "<i>bold</i>", '<a href="javascript:alert(1)">a</a>', "<script>alert(1)</script><img src=x onerror=alert(1)>",
                    '<iframe src="javascript:alert(1)"></iframe>', "<style>body{display:none}</style>"):
        assert literal in got["text"], literal
    page_only.wait_for("new Promise((ok) => setTimeout(() => ok(true), 300))")  # any handler would have run by now
    assert page_only.eval("window.pwned") is None
    assert page_only.eval("document.querySelectorAll('img, iframe, body style, script:not(body > script)').length") == 0
    page_only.eval("document.querySelector('.msg.assistant:last-child').remove()")

    # User messages are plain text: no Markdown, no HTML.
    got = page_only.eval("""(() => {
        const m = addMessage('user', '**not bold** <b>x</b> `y`'), c = m.querySelector('.content');
        const r = {text: c.textContent, n: c.children.length};
        m.remove();
        return r; })()""")
    assert got == {"text": "**not bold** <b>x</b> `y`", "n": 0}


STREAMED = ("Sure! Here is **a plan** with `code`:\n\n1. Install *the tool*:\n\n   ```bash\n   pip install specserve\n   ```\n"
            "2. Run it — see [the docs](https://example.com/docs \"Docs\").\n\n- **Tip**: use `--port`\n- ~~old~~ new\n\n"
            "```python\ndef add(a, b):\n    return a + b  # **not bold**\n```\n\n> Note: done.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
            "## Summary\nThat's it.")


def test_rendering_streamed_prefixes_ends_equal_to_rendering_the_whole(page_only):
    """The page re-renders a reply on every delta (streaming: true), then once more when it ends: what it
    ends with equals rendering the whole text at once, whatever the deltas were; and while it streams, an
    unclosed fence is a code block in progress (at the top level its Copy button stays the same element as
    it grows), and emphasis, code and link markers never show as raw characters."""
    rng = random.Random(0)
    for text in (STREAMED, "plain text only", "```\nunclosed fence\nstill code", "*a* **b", "- x\n- y\n\n  z"):
        for chunks in ("chars", "random"):
            cuts = (list(range(1, len(text) + 1)) if chunks == "chars"
                    else sorted(set(rng.sample(range(1, len(text)), min(12, len(text) - 1)) + [len(text)])))
            got = page_only.eval(f"""(() => {{
                const text = {json.dumps(text)}, d = document.createElement('div'), views = [];
                for (const cut of {json.dumps(cuts)}) {{
                  renderMarkdown(d, text.slice(0, cut), true);
                  const prose = d.cloneNode(true);
                  prose.querySelectorAll('.codeblock').forEach((e) => e.remove());
                  views.push({{cut, text: prose.textContent,
                               open: d.querySelector('.codeblock[data-state=open] code')?.textContent ?? null,
                               button: d.querySelector(':scope > .codeblock[data-state=open] .copy')}});
                }}
                renderMarkdown(d, text, false);
                const whole = document.createElement('div');
                renderMarkdown(whole, text);
                const kept = views.filter((v, k) => k > 0 && v.button && views[k - 1].button);
                return {{streamed: d.innerHTML, whole: whole.innerHTML, views: views.map(({{cut, text, open}}) => ({{cut, text, open}})),
                         kept: kept.length, sameButton: kept.every((v) => v.button === views[views.indexOf(v) - 1].button)}};
            }})()""")
            assert got["streamed"] == got["whole"], (text, chunks)
            if text == STREAMED and chunks == "chars":
                views = {v["cut"]: v for v in got["views"]}
                for v in got["views"]:
                    assert "*" not in v["text"] and "`" not in v["text"] and "[" not in v["text"], v  # outside code blocks
                cut = STREAMED.index("return a + b") + len("return a")
                assert views[cut]["open"] == "def add(a, b):\n    return a"
                assert got["kept"] > 20 and got["sameButton"]
                cut = STREAMED.index("a plan") + len("a pl")
                assert views[cut]["text"].endswith("Here is a pl")


def test_streamed_reply_renders_markdown_end_to_end(server, tmp_path):
    """A real reply streamed from the server: the model's output is held to a Markdown-shaped regex (the
    page's own request, with text.format added on its way out), the page renders it while it streams
    and ends with exactly what rendering the whole text gives."""
    shape = (r"# [a-z]{3,8}\n\nThe \*\*[a-z]{3,8}\*\* and `[a-z]{3,8}`:\n\n- [a-z]{3,8}\n- [a-z]{3,8}\n\n"
             r"```python\n[a-z]{3,8} = [0-9]{1,3}\n```")
    with Chromium(server.http_url) as page:
        page.wait_for("document.getElementById('status').dataset.state === 'ready'")
        page.eval(f"""(() => {{
            const send = WebSocket.prototype.send;
            WebSocket.prototype.send = function (data) {{
              const event = JSON.parse(data);
              if (event.type === 'response.create')
                event.response.text = {{format: {{type: 'grammar', syntax: 'regex', definition: {json.dumps(shape)}}}}};
              return send.call(this, JSON.stringify(event));
            }};
            window.seen = [];  // what the reply showed while it streamed
            new MutationObserver(() => {{
              const m = document.querySelector('.msg.assistant');
              if (m && m.dataset.status === 'streaming') window.seen.push(m.querySelector('.content').innerHTML);
            }}).observe(document.getElementById('messages'), {{subtree: true, childList: true, characterData: true}});
        }})()""")
        page.set_value("#max-tokens", "200")
        page.type("#prompt", "show me some markdown")
        page.click("#send")
        page.wait_for(f"{LAST}?.dataset.status && {LAST}.dataset.status !== 'streaming'", timeout=240)
        assert page.eval(f"{LAST}.dataset.status") == "completed"
        text = page.eval(f"{LAST}.dataset.text")
        assert re.fullmatch(shape, text), text
        content = f"{LAST}.querySelector('.content')"
        final = page.eval(f"{content}.innerHTML")
        assert final == fresh_render(page, text)
        got = page.eval(f"""(() => {{ const d = {content}; return {{
            h1: d.querySelector('h1')?.textContent, strong: d.querySelector('p strong')?.textContent,
            code: d.querySelector('p code')?.textContent, items: [...d.querySelectorAll('ul > li')].map((li) => li.textContent),
            block: d.querySelector('.codeblock pre > code')?.textContent, copy: !!d.querySelector('.codeblock button.copy') }}; }})()""")
        lines = text.split("\n")
        assert got == {"h1": lines[0][2:], "strong": re.search(r"\*\*(\w+)\*\*", text)[1],
                       "code": re.search(r"`(\w+)`", text)[1], "items": [lines[4][2:], lines[5][2:]], "block": lines[8], "copy": True}
        seen = page.eval("window.seen")
        assert len(seen) >= 3  # re-rendered as deltas came
        # Rendered while still streaming: some earlier view already holds rendered Markdown. (Not a particular
        # partial view, such as the list before the code block: deltas that arrive within one frame are drawn
        # together, so which partial views appear depends on how fast the server streams.)
        assert any(re.search(r"<(h1|strong|li)>", html) and html != final for html in seen)
        assert all("**" not in re.sub("<[^>]+>", "", html) for html in seen)
        page.screenshot(tmp_path / "reply.png")  # to look at when this test is debugged


def test_degenerate_replies_render_quickly(page_only):
    """A small model can loop: replies of ~20,000 characters of one pattern render (at once, then as a
    reply in progress) in well under a second each here, where a quadratic scan would take many; and
    nesting deeper than the renderer follows is text, not a stack overflow."""
    cases = {"stars": "'*a '.repeat(7000)", "mixed": "'*a_ '.repeat(5000)", "closers": "'a* '.repeat(7000)",
             "brackets": "'['.repeat(20000)", "links": "'[a]('.repeat(5000)", "ticked": "'[`'.repeat(10000)",
             "ticks": "'` `` '.repeat(3000)", "autolinks": "'<https://a'.repeat(2000)",
             "spaces": "'# ' + ' '.repeat(20000) + 'x'",
             "lines": "'a  \\n'.repeat(5000)", "items": "'- a\\n'.repeat(5000)", "quotes": "'> '.repeat(5000) + 'q'",
             "nested": "Array.from({length: 300}, (_, k) => ' '.repeat(2 * k) + '- x').join('\\n')",
             "fences": "'```\\nx\\n'.repeat(3000)", "table": "'|a|b|\\n|-|-|\\n' + '|1|2|\\n'.repeat(3000)"}
    got = page_only.eval("(() => { const out = {}; const d = document.createElement('div');" + "".join(
        f"{{ const t = {expr}, s = performance.now(); renderMarkdown(d, t); renderMarkdown(d, t + 'x', true); "
        f"out[{json.dumps(name)}] = [t.length, performance.now() - s, d.querySelectorAll('blockquote, ul').length]; }}"
        for name, expr in cases.items()) + " return out; })()")
    for name, (length, ms, depth) in got.items():
        assert length >= 6000 and ms < 1500, (name, length, ms)
    assert 1 <= got["quotes"][2] <= 13 and 1 <= got["nested"][2] <= 13
