"""The browser chat page, served at ``/`` on the websocket port.

One self-contained page (no external assets): it opens ``/v1/ws`` on the same origin (passing the
page's own ``?api_key=`` on, if any), sends the conversation as ``messages``, streams the reply, and
shows per reply the client-measured time to first token, tokens/s and τ (tokens per verify step),
with a stop button that sends ``response.cancel``.

Replies are rendered as Markdown (code blocks with a Copy button, lists, headings, links, ...) by a small
renderer in the page (MARKDOWN_JS below, which says why it is not a vendored library), re-rendered as
deltas arrive. It never parses model text as HTML: it builds elements with ``createElement`` and puts
text in as text nodes, and keeps only http(s) and mailto links. User messages and replies under a JSON
schema are plain text (``textContent``). A finished reply's raw text is its ``data-text`` attribute;
the renderer is ``window.renderMarkdown(container, text, streaming)``.

Its settings start from the session's defaults (specserve/defaults.py). Replies stream paced
(``stream_pacing: "smooth"``, a checkbox) and ask for ``truncation: "auto"``: when the context cannot
hold the conversation plus a reply, the server leaves out the oldest turns and the page greys them
out and says so. A message the server refused is marked "not sent"; every finished reply says how it
ended: "stopped", "failed: reason" or "cut at N tokens".

"Structured output" (a collapsible box above the message box) takes a JSON schema: when it is not empty,
every message goes out with ``text: {format: {type: "json_schema", schema}}`` and the reply is one
JSON value valid against it. A schema that is not JSON is refused on the page; one the server cannot
compile comes back as an ``invalid_grammar`` error and the message is marked "not sent".
"""

from __future__ import annotations

from aiohttp import web

_PAGE_TEMPLATE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>specserve chat</title>
<style>
  :root { --bg:#f7f7f8; --panel:#fff; --ink:#1d1d1f; --muted:#6b6b76; --line:#e3e3e8; --accent:#2f6fed; --err:#c62828; }
  * { box-sizing: border-box; }
  html, body { height: 100%; margin: 0; }
  body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; background: var(--bg); color: var(--ink);
         display: flex; flex-direction: column; }
  header { display: flex; gap: 12px; align-items: center; padding: 10px 16px; background: var(--panel);
           border-bottom: 1px solid var(--line); flex-wrap: wrap; }
  header h1 { font-size: 16px; margin: 0; font-weight: 600; }
  #model { color: var(--muted); font-size: 13px; }
  #status { display: inline-flex; align-items: center; gap: 6px; font-size: 13px; color: var(--muted); }
  #status::before { content: ""; width: 8px; height: 8px; border-radius: 50%; background: #bbb; }
  #status[data-state="ready"]::before { background: #2e7d32; }
  #status[data-state="closed"]::before { background: var(--err); }
  .settings { margin-left: auto; display: flex; gap: 10px; align-items: center; font-size: 13px; color: var(--muted); }
  .settings input[type=number] { width: 70px; padding: 3px 5px; border: 1px solid var(--line); border-radius: 6px; }
  main { flex: 1; overflow-y: auto; padding: 16px; }
  #messages { max-width: 820px; margin: 0 auto; display: flex; flex-direction: column; gap: 12px; }
  .msg { padding: 10px 14px; border-radius: 12px; max-width: 90%; background: var(--panel); border: 1px solid var(--line); }
  .msg.user { align-self: flex-end; background: #e8f0fe; border-color: #d2e1fc; }
  .msg.assistant { align-self: flex-start; }
  .content { white-space: pre-wrap; word-wrap: break-word; }
  .content.empty { color: var(--muted); font-style: italic; }
  .msg.assistant[data-status="streaming"] .content:not(.md)::after,
  .msg.assistant[data-status="streaming"] .md:empty::after,
  .msg.assistant[data-status="streaming"] .md > :is(p, h1, h2, h3, h4, h5, h6, blockquote):last-child::after,
  .msg.assistant[data-status="streaming"] .md > :is(ul, ol):last-child > li:last-child:not(:has(> :is(p, ul, ol)))::after,
  .msg.assistant[data-status="streaming"] .md > :is(ul, ol):last-child > li:last-child > p:last-child::after,
  .msg.assistant[data-status="streaming"] .md > .codeblock:last-child code::after { content: "▍"; color: var(--accent); }
  /* Markdown replies */
  .content.md { white-space: normal; min-width: 0; }
  .content.plain { font: 13px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
  .md > :first-child { margin-top: 0; }
  .md > :last-child { margin-bottom: 0; }
  .md p, .md ul, .md ol, .md blockquote, .md .table, .md .codeblock, .md hr { margin: 0 0 .65em; }
  .md h1, .md h2, .md h3, .md h4, .md h5, .md h6 { margin: .9em 0 .4em; line-height: 1.3; font-weight: 600; }
  .md h1 { font-size: 1.4em; } .md h2 { font-size: 1.25em; } .md h3 { font-size: 1.1em; } .md h4, .md h5, .md h6 { font-size: 1em; }
  .md ul, .md ol { padding-left: 1.6em; }
  .md li > ul, .md li > ol { margin: .15em 0 .3em; }
  .md li > p { margin: 0 0 .4em; }
  .md li.task { list-style: none; }
  .md li.task > input { margin: 0 .45em 0 -1.4em; vertical-align: -1px; }
  .md a { color: var(--accent); text-decoration: underline; text-underline-offset: 2px; }
  .md blockquote { padding: 0 0 0 12px; border-left: 3px solid var(--line); color: var(--muted); }
  .md hr { border: 0; border-top: 1px solid var(--line); }
  .md code { font: 13px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
  .md :not(pre) > code { padding: 1px 5px; border-radius: 5px; background: #eff0f3; border: 1px solid #e2e3e8; white-space: break-spaces; }
  .md .codeblock { border: 1px solid #dcdfe4; border-radius: 8px; overflow: hidden; background: #f6f8fa; }
  .md .codebar { display: flex; align-items: center; justify-content: space-between; gap: 8px; padding: 3px 6px 3px 12px;
                 background: #eceff3; border-bottom: 1px solid #dcdfe4; font-size: 12px; color: var(--muted); min-height: 28px; }
  .md .codebar .copy { padding: 2px 10px; border-radius: 6px; border: 1px solid #d0d4da; background: #fff; color: var(--ink);
                       font-size: 12px; font-weight: 500; }
  .md .codebar .copy:hover { background: #f3f4f6; }
  .md pre { margin: 0; padding: 10px 12px; overflow-x: auto; white-space: pre; tab-size: 4; }
  .md .table { overflow-x: auto; }
  .md table { border-collapse: collapse; font-size: 14px; }
  .md th, .md td { border: 1px solid var(--line); padding: 4px 10px; text-align: left; vertical-align: top; }
  .md th { background: #f3f4f6; font-weight: 600; }
  .stats { margin-top: 6px; font-size: 12px; color: var(--muted); font-variant-numeric: tabular-nums; display: flex; gap: 12px; }
  .stats [data-k="status"] { color: var(--err); }
  .msg[data-status="incomplete"] .stats [data-k="status"] { color: var(--muted); }
  .msg.dropped { opacity: .45; }
  .msg.user.unsent { border-style: dashed; }
  .msg .unsent-label { margin-top: 4px; font-size: 12px; color: var(--err); }
  .note { align-self: center; font-size: 12px; color: var(--muted); font-style: italic; }
  #error { max-width: 820px; margin: 0 auto; color: var(--err); font-size: 13px; min-height: 1em; }
  footer { padding: 10px 16px 16px; background: var(--bg); }
  form { max-width: 820px; margin: 0 auto; display: flex; gap: 8px; }
  textarea { flex: 1; resize: none; height: 64px; padding: 10px 12px; font: inherit; border: 1px solid var(--line);
             border-radius: 10px; background: var(--panel); }
  button { padding: 0 18px; border-radius: 10px; border: 0; font: inherit; font-weight: 600; cursor: pointer;
           background: var(--accent); color: #fff; }
  button:disabled { opacity: .4; cursor: default; }
  button.secondary { background: #e3e3e8; color: var(--ink); }
  #structured { max-width: 820px; margin: 0 auto 8px; font-size: 13px; color: var(--muted); }
  #structured summary { cursor: pointer; user-select: none; }
  #structured[data-active="1"] summary::after { content: " · on"; color: var(--accent); font-weight: 600; }
  #schema { width: 100%; height: 110px; margin-top: 6px; resize: vertical; font: 13px/1.4 ui-monospace, monospace; }
</style>
</head>
<body>
<header>
  <h1>specserve</h1><span id="model"></span><span id="status" data-state="connecting">connecting</span>
  <div class="settings">
    <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1"></label>
    <label>max tokens <input id="max-tokens" type="number" min="1" step="1"></label>
    <label title="what drafts for this chat: the server's drafter, one part of a hybrid drafter, or none">drafter <select id="drafter"></select></label>
    <label title="spread each step's tokens over the step"><input id="smooth" type="checkbox" checked> smooth</label>
    <button id="clear" class="secondary" type="button">New chat</button>
  </div>
</header>
<main id="scroll"><div id="messages"></div></main>
<footer>
  <div id="error" role="alert"></div>
  <details id="structured">
    <summary>Structured output</summary>
    <textarea id="schema" spellcheck="false"
      placeholder='JSON schema every reply must follow, e.g. {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]} (empty: plain text)'></textarea>
  </details>
  <form id="composer">
    <textarea id="prompt" placeholder="Message (Enter to send, Shift+Enter for a new line)" autofocus></textarea>
    <button id="send" type="submit" disabled>Send</button>
    <button id="stop" type="button" class="secondary" disabled>Stop</button>
  </form>
</footer>
<script>
"use strict";
/*MARKDOWN_JS*/
const $ = (id) => document.getElementById(id);
const turns = [];              // [{role, content, el}] of the conversation the model still sees
let ws = null, session = null, live = null, retryMs = 500, nextEvent = 0, settingsFilled = false;

function wsUrl() {
  const key = new URLSearchParams(location.search).get("api_key");
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return scheme + "//" + location.host + "/v1/ws" + (key ? "?api_key=" + encodeURIComponent(key) : "");
}

function setStatus(state, text) { $("status").dataset.state = state; $("status").textContent = text; }
function showError(text) { $("error").textContent = text || ""; }
function refreshButtons() {
  const ready = ws && ws.readyState === WebSocket.OPEN && session;
  $("send").disabled = !ready || live !== null;
  $("stop").disabled = live === null || !live.id;
}

function connect() {
  setStatus("connecting", "connecting");
  ws = new WebSocket(wsUrl());
  ws.onopen = () => { retryMs = 500; };
  ws.onmessage = (msg) => onEvent(JSON.parse(msg.data));
  ws.onclose = (e) => {
    session = null;
    setStatus("closed", "disconnected" + (e.reason ? ": " + e.reason : ""));
    if (live) finish({status: "failed", error: {message: "the connection was lost"}});
    refreshButtons();
    setTimeout(connect, retryMs); retryMs = Math.min(retryMs * 2, 8000);
  };
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  const content = document.createElement("div");
  content.className = role === "assistant" ? "content md" : "content"; content.textContent = text;
  el.appendChild(content);
  if (role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "stats";
    for (const k of ["ttft", "tps", "tau", "status"]) { const s = document.createElement("span"); s.dataset.k = k; stats.appendChild(s); }
    el.appendChild(stats);
  }
  $("messages").appendChild(el);
  $("scroll").scrollTop = $("scroll").scrollHeight;
  return el;
}

// A reply's text into its message: Markdown (re-rendered as it streams), or plain text under a JSON schema.
// The scroll follows the end unless the reader has scrolled up.
function showText(reply, streaming) {
  const scroll = $("scroll"), follow = scroll.scrollHeight - scroll.scrollTop - scroll.clientHeight < 48;
  const content = reply.el.querySelector(".content");
  if (reply.plain) content.textContent = reply.text;
  else renderMarkdown(content, reply.text, streaming);
  if (follow) scroll.scrollTop = scroll.scrollHeight;
}

// Deltas can come faster than frames: render at most once a frame.
function paint(reply) {
  if (reply.frame) return;
  reply.frame = requestAnimationFrame(() => { reply.frame = 0; if (!reply.done) showText(reply, true); });
}

function setStat(el, k, text) { el.querySelector('[data-k="' + k + '"]').textContent = text; }

function updateStats(final) {
  const now = performance.now(), el = live.el;
  if (live.firstAt !== null) {
    const ttft = live.firstAt - live.sentAt;
    el.dataset.ttftMs = ttft.toFixed(1);
    setStat(el, "ttft", "TTFT " + ttft.toFixed(0) + " ms");
    const span = ((final ? live.lastAt : now) - live.firstAt) / 1000;
    const later = live.tokens - live.firstTokens;  // tokens after the first delta, over the time since it
    if (span > 0 && later > 0) {
      el.dataset.tps = (later / span).toFixed(1);
      setStat(el, "tps", (later / span).toFixed(1) + " tok/s");
    }
  }
  const tau = final && final.spec && final.spec.steps ? final.spec.tau : (live.deltas > 1 ? (live.tokens - live.firstTokens) / (live.deltas - 1) : null);
  if (tau !== null && isFinite(tau)) { el.dataset.tau = tau.toFixed(2); setStat(el, "tau", "τ " + tau.toFixed(2)); }
}

function fillDrafters(s) {
  // One option per choice the server offers; the session's current one selected ("none": plain decoding).
  const menu = $("drafter");
  menu.replaceChildren(...s.available_drafters.map((name) => {
    const option = document.createElement("option");
    option.value = name;
    option.textContent = name === "none" ? "none (plain)" : name;
    return option;
  }));
  menu.value = s.drafter || "none";
  menu.disabled = s.available_drafters.length < 2;
}

function onEvent(ev) {
  switch (ev.type) {
    case "session.created":
    case "session.updated":
      session = ev.session;
      $("model").textContent = session.model + (session.drafter ? " · drafter " + session.drafter : " · no drafter");
      fillDrafters(session);
      $("max-tokens").max = session.limits.max_output_tokens;
      if (!settingsFilled) {  // the server's defaults, once: later changes are the user's
        $("temperature").value = session.defaults.temperature;
        $("max-tokens").value = session.defaults.max_output_tokens;
        settingsFilled = true;
      }
      setStatus("ready", "connected");
      break;
    case "response.created":
      if (live && !live.id && ev.event_id === live.eventId) {
        live.id = ev.response.id; live.el.dataset.responseId = live.id;
        if (ev.response.dropped_messages) leaveOut(ev.response.dropped_messages, ev.response.max_output_tokens);
      }
      break;
    case "response.output_text.delta":
      if (!live || ev.response_id !== live.id) break;
      if (live.firstAt === null) { live.firstAt = performance.now(); live.firstTokens = ev.tokens; }
      live.lastAt = performance.now();
      live.tokens += ev.tokens; live.deltas += 1;
      live.text += ev.delta;
      paint(live);
      updateStats(null);
      break;
    case "response.done":
      if (live && ev.response.id === live.id) finish(ev.response);
      break;
    case "error":
      showError(ev.error.code + ": " + ev.error.message);
      if (live && !live.id && ev.event_id === live.eventId) {  // refused: the message was not sent
        live.el.remove();
        const user = turns.pop().el;
        user.classList.add("unsent"); user.dataset.unsent = "1";
        const label = document.createElement("div");
        label.className = "unsent-label"; label.textContent = "not sent: " + ev.error.message;
        user.appendChild(label);
        live = null;
      }
      break;
  }
  refreshButtons();
}

// The server left out the oldest turns to fit the context: so does the page (greyed out, with a note).
function leaveOut(count, maxTokens) {
  let n = 0;
  while (n < count && turns.length) { turns.shift().el.classList.add("dropped"); n++; }
  const note = document.createElement("div");
  note.className = "note";
  note.textContent = count + " older message" + (count > 1 ? "s were" : " was") + " left out to fit the " +
    session.limits.context_length + "-token context (reply room " + maxTokens + " tokens)";
  $("messages").insertBefore(note, live.el.previousSibling);
}

// How a reply ended, in words ("" when it completed).
function statusText(response) {
  if (response.status === "cancelled") return "stopped";
  if (response.status === "failed") return "failed: " + (response.error ? response.error.message : "unknown error");
  if (response.status === "incomplete") return "cut at " + (response.usage ? response.usage.output_tokens : live.tokens) + " tokens";
  return "";
}

function finish(response) {
  if (live.lastAt === null) live.lastAt = performance.now();
  updateStats(response);
  live.el.dataset.status = response.status;
  setStat(live.el, "status", statusText(response));
  if (response.usage) live.el.dataset.outputTokens = response.usage.output_tokens;
  cancelAnimationFrame(live.frame);
  live.done = true;
  if (live.text) {
    showText(live, false);
    live.el.dataset.text = live.text;
  } else {
    const content = live.el.querySelector(".content");
    content.textContent = "(no text)";
    content.classList.add("empty");
  }
  if (live.text) turns.push({role: "assistant", content: live.text, el: live.el});
  else turns.pop();  // a reply with no text: its question leaves the conversation too
  live = null;
  refreshButtons();
  $("prompt").focus();
}

// The structured-output schema: null when the box is empty; throws (with a message) when it is not JSON.
function schemaFormat() {
  const source = $("schema").value.trim();
  if (!source) return null;
  let schema;
  try { schema = JSON.parse(source); } catch (e) { throw new Error("the schema is not valid JSON: " + e.message); }
  if (schema === null || typeof schema !== "object" || Array.isArray(schema)) throw new Error("the schema must be a JSON object");
  return {type: "json_schema", name: "page", schema};
}

function send() {
  const text = $("prompt").value.trim();
  if (!text || live || !session) return;
  let format;
  try { format = schemaFormat(); } catch (e) { showError("invalid_grammar: " + e.message); return; }
  showError("");
  $("prompt").value = "";
  turns.push({role: "user", content: text, el: addMessage("user", text)});
  const el = addMessage("assistant", "");
  el.dataset.status = "streaming";
  live = {id: null, eventId: "page-" + (++nextEvent), el, text: "", tokens: 0, deltas: 0, firstTokens: 0, sentAt: performance.now(),
          firstAt: null, lastAt: null, plain: !!format, frame: 0, done: false};
  const response = {messages: turns.map((t) => ({role: t.role, content: t.content})), truncation: "auto",
                    stream_pacing: $("smooth").checked ? "smooth" : "off",
                    temperature: Number($("temperature").value) || 0};
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) response.max_output_tokens = maxTokens;
  if (format) {  // the reply is JSON: plain text, not Markdown
    response.text = {format}; el.dataset.schema = "1";
    el.querySelector(".content").className = "content plain";
  }
  ws.send(JSON.stringify({type: "response.create", event_id: live.eventId, response}));
  refreshButtons();
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
$("stop").addEventListener("click", () => {
  if (live && live.id) ws.send(JSON.stringify({type: "response.cancel", response_id: live.id}));
});
$("drafter").addEventListener("change", () => {
  ws.send(JSON.stringify({type: "session.update", session: {drafter: $("drafter").value}}));
});
$("schema").addEventListener("input", () => { $("structured").dataset.active = $("schema").value.trim() ? "1" : ""; });
$("clear").addEventListener("click", () => {
  if (live) return;
  turns.length = 0; $("messages").textContent = ""; showError("");
});
connect();
</script>
</body>
</html>
"""

# The Markdown renderer, inlined into the page's script (kept apart here only to be read on its own).
MARKDOWN_JS = r"""// ---- Markdown ------------------------------------------------------------------------------------
// The assistant's replies are Markdown. They are rendered by this small renderer, not by a vendored
// library. The alternative was marked (MIT) + DOMPurify (Apache-2.0 / MPL-2.0): about 60 KB minified
// to inline here or to serve from new static routes and package data, two upstreams to keep patched,
// and an HTML-string pipeline (Markdown → HTML → sanitizer → innerHTML) whose safety rests on the
// sanitizer's configuration. Here safety holds by construction: nothing is ever parsed as HTML. Every
// element is made with createElement, and model text goes in only as text nodes (append(string) /
// textContent), so `<script>` or `<img onerror=...>` in a reply shows as those characters. Links keep
// only http:, https: and mailto: targets (any other shows as its text); Markdown images become links
// (the page loads nothing).
//
// Covered: fenced code blocks (``` or ~~~, optional language) with a Copy button, ATX and setext
// headings, paragraphs with every newline a line break, ordered / unordered / nested / task lists,
// block quotes, rules, GFM tables; inline code, **bold**, *italic*, ~~strike~~, backslash escapes,
// [links](url), <autolinks> and bare http(s) URLs. Not covered (shown as text): raw HTML, indented
// (4-space) code blocks, reference-style links, footnotes.
//
// renderMarkdown(container, text, streaming) renders `text` into `container`, reusing the elements of
// top-level blocks that did not change since the container's last render, and updating an open code
// block in place (its Copy button stays put while it grows). `streaming` marks `text` as a prefix of a
// reply still arriving: an unclosed ``` fence shows as a code block in progress, a last line that is
// only markup so far ("-", "``", "1.") waits for its next token, and an opened **, *, ` or [ on the
// last line already shows bold / italic / code / the link's text. The last render, with streaming
// false, equals a render of the whole text at once.
//
// Every scan is bounded or remembered, and no regular expression here can backtrack far, so that a
// degenerate reply ("[[[[...", "*a *a *a ...", deep nesting) renders in time about linear in its length.
const renderMarkdown = (() => {
  "use strict";
  const PUNCT = /[\p{P}\p{S}]/u, SPACE = /\s/u, ESCAPABLE = /[!-\/:-@\[-`{-~]/;
  const FENCE = /^(`{3,}|~{3,})(.*)$/, FENCE_CLOSE = /^(`{3,}|~{3,})[ \t]*$/;
  const HEADING = /^(#{1,6})(?:[ \t]+(.*))?$/, HR = /^([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const ITEM = /^(?:([-*+])|(\d{1,9})([.)]))(?:([ \t]+)(.*))?$/, SETEXT = /^(=+|-+)[ \t]*$/;
  const TABLE_DELIM = /^\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;
  // The longest link title and target looked for; quotes and lists nested deeper than MAX_DEPTH are text.
  const MAX_TITLE = 1000, MAX_URL = 2048, MAX_DEPTH = 12;
  const AUTOLINK = /<((?:https?:\/\/|mailto:)[^\s<>]*)>/iy, BARE_URL = /https?:\/\/[^\s<>`]+/iy;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  }
  const blank = (line) => /^[ \t]*$/.test(line);
  const unindent = (line) => line.replace(/^[ \t]+/, "");
  function rtrim(s) {  // (not /[ \t]+$/: that is quadratic in a long run of inner spaces)
    let e = s.length;
    while (e > 0 && (s[e - 1] === " " || s[e - 1] === "\t")) e--;
    return s.slice(0, e);
  }
  function headingText(s) {  // less a closing run of #s ("## Title ##")
    s = rtrim(s);
    let e = s.length;
    while (e > 0 && s[e - 1] === "#") e--;
    return e === 0 ? "" : e < s.length && (s[e - 1] === " " || s[e - 1] === "\t") ? rtrim(s.slice(0, e)) : s;
  }
  // Columns of leading whitespace (a tab runs to the next multiple of 4).
  function indentOf(line) {
    let col = 0;
    for (const ch of line) {
      if (ch === " ") col++; else if (ch === "\t") col += 4 - (col % 4); else break;
    }
    return col;
  }
  // `line` less `n` columns of leading whitespace (a tab cut in two leaves spaces).
  function dedent(line, n) {
    let col = 0, i = 0;
    for (; i < line.length && col < n; i++) {
      if (line[i] === " ") col++;
      else if (line[i] === "\t") {
        const w = 4 - (col % 4);
        if (col + w > n) return " ".repeat(col + w - n) + line.slice(i + 1);
        col += w;
      } else break;
    }
    return line.slice(i);
  }

  // ---- blocks: lines → [{type, ...}] (plain data: two equal blocks render the same) ----
  function fenceOpen(line) {
    const m = FENCE.exec(unindent(line));
    if (!m || (m[1][0] === "`" && m[2].includes("`"))) return null;
    return {ind: indentOf(line), ch: m[1][0], len: m[1].length, lang: m[2].trim().split(/\s+/)[0]};
  }
  function listItem(line) {
    const t = unindent(line), m = ITEM.exec(t);
    if (!m || HR.test(t)) return null;
    const ind = indentOf(line), marker = m[1] || m[2] + m[3], content = m[5] || "";
    const pad = m[4] ? Math.min(indentOf(m[4]), 4) : 1;
    return {ind, ci: ind + marker.length + pad, ordered: !m[1], start: m[2] ? parseInt(m[2], 10) : 1,
            content, empty: blank(content)};
  }
  // Whether `line` ends a paragraph (an empty list item does not: "-" alone could be a setext underline).
  function interrupts(line) {
    const t = unindent(line);
    if (fenceOpen(line) || HEADING.test(t) || HR.test(t) || t[0] === ">") return true;
    const item = listItem(line);
    return item !== null && !item.empty;
  }
  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    const cells = [];
    let cell = "";
    for (let k = 0; k < s.length; k++) {
      if (s[k] === "\\" && s[k + 1] === "|") { cell += "\\|"; k++; }  // the inline pass unescapes it
      else if (s[k] === "|") { cells.push(cell.trim()); cell = ""; }
      else cell += s[k];
    }
    cells.push(cell.trim());
    return cells;
  }
  function tableStart(lines, i) {
    const head = lines[i], delim = lines[i + 1];
    if (delim === undefined || !head.includes("|") || !delim.includes("|") || !TABLE_DELIM.test(delim.trim())) return null;
    const cells = splitRow(head), aligns = splitRow(delim).map((d) =>
      d.startsWith(":") && d.endsWith(":") ? "center" : d.endsWith(":") ? "right" : d.startsWith(":") ? "left" : "");
    return cells.length === aligns.length ? {cells, aligns} : null;
  }

  function parseList(lines, i, first, depth) {
    const items = [];
    let cur = {mi: first.ind, ci: first.ci, lines: [first.content]}, loose = false, blanks = 0, j = i + 1;
    for (; j < lines.length; j++) {
      const line = lines[j];
      if (blank(line)) { blanks++; continue; }
      const ind = indentOf(line);
      if (ind >= Math.min(cur.ci, cur.mi + 2)) {  // the item's own content (lenient: 2 columns in will do)
        for (; blanks > 0; blanks--) cur.lines.push("");
        cur.lines.push(dedent(line, Math.min(ind, cur.ci)));
        continue;
      }
      const item = listItem(line);
      if (item && item.ordered === first.ordered) {  // the next item
        if (blanks) loose = true;
        items.push(cur);
        cur = {mi: item.ind, ci: item.ci, lines: [item.content]};
        blanks = 0;
        continue;
      }
      if (!blanks && !interrupts(line) && !tableStart(lines, j)) { cur.lines.push(unindent(line)); continue; }  // lazy
      break;
    }
    items.push(cur);
    const parsed = items.map((it) => {
      let task = null;
      const m = /^\[([ xX])\][ \t]+/.exec(it.lines[0]);
      if (m) { task = m[1] !== " "; it.lines[0] = it.lines[0].slice(m[0].length); }
      const blocks = parseBlocks(it.lines, depth + 1);
      if (blocks.some((b, k) => k > 0 && b.gap)) loose = true;
      return {task, blocks};
    });
    return {block: {type: "list", ordered: first.ordered, start: first.start, loose, items: parsed}, next: j - blanks};
  }

  function parseBlocks(lines, depth = 0) {
    const blocks = [];
    let i = 0, gap = false;
    const push = (b) => { b.gap = gap; gap = false; blocks.push(b); };
    while (i < lines.length) {
      const line = lines[i], t = unindent(line);
      let f, m, item, table;
      if (blank(line)) { gap = blocks.length > 0; i++; continue; }
      if ((f = fenceOpen(line))) {
        const code = [];
        let open = true;
        for (i++; i < lines.length; i++) {
          const close = FENCE_CLOSE.exec(unindent(lines[i]));
          if (close && close[1][0] === f.ch && close[1].length >= f.len) { open = false; i++; break; }
          code.push(dedent(lines[i], f.ind));
        }
        if (open && code.length && code[code.length - 1] === "") code.pop();  // the text so far ended with "\n"
        push({type: "code", lang: f.lang, code: code.join("\n"), open});
      } else if ((m = HEADING.exec(t))) {
        push({type: "heading", level: m[1].length, text: headingText(m[2] || "")});
        i++;
      } else if (HR.test(t)) {
        push({type: "hr"});
        i++;
      } else if (t[0] === ">" && depth < MAX_DEPTH) {
        const inner = [];
        for (; i < lines.length && /^[ \t]*>/.test(lines[i]); i++) inner.push(lines[i].replace(/^[ \t]*> ?/, ""));
        push({type: "quote", blocks: parseBlocks(inner, depth + 1)});
      } else if (depth < MAX_DEPTH && (item = listItem(line))) {
        const r = parseList(lines, i, item, depth);
        push(r.block);
        i = r.next;
      } else if ((table = tableStart(lines, i))) {
        const rows = [], n = table.cells.length;
        for (i += 2; i < lines.length && !blank(lines[i]) && lines[i].includes("|") && !interrupts(lines[i]); i++) {
          const cells = splitRow(lines[i]).slice(0, n);
          while (cells.length < n) cells.push("");
          rows.push(cells);
        }
        push({type: "table", aligns: table.aligns, head: table.cells, rows});
      } else {
        const para = [t];
        let setext = 0;
        for (i++; i < lines.length && !blank(lines[i]); i++) {
          const s = SETEXT.exec(unindent(lines[i]));
          if (s) { setext = s[1][0] === "=" ? 1 : 2; i++; break; }
          if (interrupts(lines[i]) || tableStart(lines, i)) break;
          para.push(unindent(lines[i]));
        }
        const text = para.map(rtrim).join("\n");
        push(setext ? {type: "heading", level: setext, text} : {type: "para", text});
      }
    }
    return blocks;
  }

  // ---- inlines: text → DocumentFragment ----
  // Where the run of exactly n backticks that closes a code span starts (-1: none). A search that found
  // none is remembered (for the same text, from further on there is none either): linear, not quadratic.
  let ticksText = null, ticksNone = new Map();
  function closingTicks(text, from, n) {
    if (text !== ticksText) { ticksText = text; ticksNone = new Map(); }
    if (from >= (ticksNone.get(n) ?? Infinity)) return -1;
    for (let k = text.indexOf("`", from); k >= 0; k = text.indexOf("`", k)) {
      let m = 1;
      while (text[k + m] === "`") m++;
      if (m === n) return k;
      k += m;
    }
    ticksNone.set(n, Math.min(from, ticksNone.get(n) ?? Infinity));
    return -1;
  }
  function codeSpanText(s) {
    s = s.replace(/\n/g, " ");
    return s.length > 2 && s[0] === " " && s[s.length - 1] === " " && s.trim() ? s.slice(1, -1) : s;
  }
  function safeHref(raw) {
    const url = raw.replace(/\\([!-\/:-@\[-`{-~])/g, "$1").trim();
    if (!/^(?:https?:\/\/|mailto:)/i.test(url)) return null;
    try {
      const parsed = new URL(url);
      return ["http:", "https:", "mailto:"].includes(parsed.protocol) ? parsed.href : null;
    } catch (e) {
      return null;
    }
  }
  function anchor(raw, content, title) {
    const href = safeHref(raw);
    if (!href) return null;
    const a = el("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer";
    if (title) a.title = title;
    a.append(content);
    return a;
  }
  function trimUrl(url) {  // a bare URL stops before trailing punctuation and unbalanced ")"
    for (;;) {
      const last = url[url.length - 1];
      if (/[?!.,:;*_~'"]/.test(last)) url = url.slice(0, -1);
      else if (last === ")" && url.split("(").length < url.split(")").length) url = url.slice(0, -1);
      else return url;
    }
  }

  // [label](url "title") or ![alt](url) at text[i] === "[": {node, end} or null. `pending`: the text is
  // a reply still arriving and this is its last line: a link whose "(url" is not finished shows its label.
  // Where the "]" that closes the "[" at text[i] is (-1: none): brackets nest; escaped ones and those in
  // code spans do not count. One pass pairs them all, once per text.
  let bracketsText = null, brackets = null;
  function closingBracket(text, i) {
    if (text !== bracketsText) {
      bracketsText = text;
      brackets = new Map();
      const open = [];
      for (let k = 0; k < text.length; k++) {
        const c = text[k];
        if (c === "\\") { k++; continue; }
        if (c === "`") {
          let n = 1;
          while (text[k + n] === "`") n++;
          const end = closingTicks(text, k + n, n);
          k = (end >= 0 ? end + n : k + n) - 1;
        } else if (c === "[") open.push(k);
        else if (c === "]" && open.length) brackets.set(open.pop(), k);
      }
    }
    return brackets.get(i) ?? -1;
  }

  function parseLink(text, i, pending, image) {
    const k = closingBracket(text, i);
    if (k < 0) return pending ? {node: inline(text.slice(i + 1), true, true), end: text.length} : null;
    const label = text.slice(i + 1, k), labelNodes = () => inline(label, false, true);
    const unfinished = () => pending ? {node: labelNodes(), end: text.length} : null;
    if (k + 1 === text.length) return unfinished();
    if (text[k + 1] !== "(") return null;
    let j = k + 2, url, title = "";
    while (/[ \t\n]/.test(text[j] || "")) j++;
    if (text[j] === "<") {
      const e = text.slice(j, j + MAX_URL).indexOf(">") + j;
      if (e < j && text.length - j > MAX_URL) return null;
      if (e < j) return unfinished();
      url = text.slice(j + 1, e);
      j = e + 1;
    } else {
      let parens = 0;
      const s = j;
      for (; j < text.length; j++) {
        if (j - s > MAX_URL) return null;
        const c = text[j];
        if (c === "\\") { j++; continue; }
        if (c <= " " || (c > "~" && SPACE.test(c))) break;
        if (c === "(" && ++parens > 32) return null;  // as cmark: at most 32 nested parentheses
        else if (c === ")" && parens-- === 0) break;
      }
      url = text.slice(s, Math.min(j, text.length));
    }
    while (/[ \t\n]/.test(text[j] || "")) j++;
    if (text[j] === '"' || text[j] === "'" || (text[j] === "(" && url)) {
      const e = text.slice(0, j + MAX_TITLE).indexOf(text[j] === "(" ? ")" : text[j], j + 1);
      if (e < 0) return text.length - j > MAX_TITLE ? null : unfinished();
      title = text.slice(j + 1, e);
      for (j = e + 1; /[ \t\n]/.test(text[j] || ""); j++);
    }
    if (j >= text.length) return unfinished();
    if (text[j] !== ")") return null;
    const content = image ? document.createTextNode(label || url) : labelNodes();
    const a = anchor(url, content, title);
    if (a && image) a.className = "image-link";
    return {node: a || content, end: j + 1};  // an unsafe target: the label, as text
  }

  // CommonMark's delimiter-run rules for *, _ and ~~ (opens / closes), then its "process emphasis"
  // algorithm over the runs: a match adds a tag to the opener's `opens` and the closer's `closes`.
  function emphasis(delims) {
    delims.forEach((d, k) => { d.prev = delims[k - 1] || null; d.next = delims[k + 1] || null; d.active = true; });
    const remove = (d) => {
      d.active = false;
      if (d.prev) d.prev.next = d.next;
      if (d.next) d.next.prev = d.prev;
    };
    const bottom = {};
    let closer = delims[0] || null;
    while (closer) {
      if (!closer.close) { closer = closer.next; continue; }
      const key = closer.ch + (closer.open ? 1 : 0) + (closer.orig % 3);
      let opener = closer.prev;
      for (; opener && opener !== bottom[key]; opener = opener.prev) {
        const odd = (closer.open || opener.close) && closer.orig % 3 !== 0 && (opener.orig + closer.orig) % 3 === 0;
        if (opener.ch === closer.ch && opener.open && !odd) break;
      }
      if (opener && opener !== bottom[key]) {
        const use = closer.ch === "~" ? 2 : opener.n >= 2 && closer.n >= 2 ? 2 : 1;
        const tag = closer.ch === "~" ? "del" : use === 2 ? "strong" : "em";
        opener.n -= use; closer.n -= use;
        opener.opens.push(tag); closer.closes.push(tag);
        for (let d = opener.next; d && d !== closer; d = d.next) remove(d);
        if (opener.n === 0) remove(opener);
        if (closer.n === 0) { const next = closer.next; remove(closer); closer = next; }
      } else {
        bottom[key] = closer.prev;
        const next = closer.next;
        if (!closer.open) remove(closer);
        closer = next;
      }
    }
  }

  // `pending`: the text is the end of a reply still arriving (see parseLink). `noLinks`: inside a link's label.
  function inline(text, pending, noLinks) {
    const toks = [], delims = [], lastLine = text.lastIndexOf("\n");
    let buf = "";
    const flush = () => { if (buf) { toks.push({t: "text", s: buf}); buf = ""; } };
    const node = (n) => { flush(); toks.push({t: "node", n}); };
    for (let i = 0; i < text.length;) {
      const c = text[i];
      if (c === "\\" && text[i + 1] === "\n") { node(el("br")); i += 2; continue; }
      if (c === "\\" && i + 1 < text.length && ESCAPABLE.test(text[i + 1])) { buf += text[i + 1]; i += 2; continue; }
      if (c === "\n") { node(el("br")); i++; continue; }
      if (c === "`") {
        let n = 1;
        while (text[i + n] === "`") n++;
        const end = closingTicks(text, i + n, n);
        if (end >= 0) { node(el("code", null, codeSpanText(text.slice(i + n, end)))); i = end + n; continue; }
        if (pending && i > lastLine) { node(el("code", null, text.slice(i + n))); break; }  // in progress
        buf += "`".repeat(n); i += n;
        continue;
      }
      if (!noLinks && (c === "[" || (c === "!" && text[i + 1] === "["))) {
        const link = parseLink(text, c === "!" ? i + 1 : i, pending && i > lastLine, c === "!");
        if (link) { node(link.node); i = link.end; continue; }
        buf += c; i++;
        continue;
      }
      if (!noLinks && c === "<") {
        AUTOLINK.lastIndex = i;
        const m = AUTOLINK.exec(text), a = m && anchor(m[1], m[1]);
        if (a) { node(a); i += m[0].length; continue; }
      }
      if (!noLinks && (c === "h" || c === "H") && (i === 0 || /[\s(*_~]/.test(text[i - 1]))) {
        BARE_URL.lastIndex = i;
        const m = BARE_URL.exec(text), url = m && trimUrl(m[0]), a = url && anchor(url, url);
        if (a) { node(a); i += url.length; continue; }
      }
      if (c === "*" || c === "_" || c === "~") {
        let n = 1;
        while (text[i + n] === c) n++;
        const before = i > 0 ? text[i - 1] : " ", after = i + n < text.length ? text[i + n] : " ";
        const left = !SPACE.test(after) && (!PUNCT.test(after) || SPACE.test(before) || PUNCT.test(before));
        const right = !SPACE.test(before) && (!PUNCT.test(before) || SPACE.test(after) || PUNCT.test(after));
        if (c === "~" && n !== 2) { buf += c.repeat(n); i += n; continue; }
        flush();
        const d = {t: "delim", ch: c, n, orig: n, pos: i, opens: [], closes: [], sure: left && !right,
                   open: c === "_" ? left && (!right || PUNCT.test(before)) : left,
                   close: c === "_" ? right && (!left || PUNCT.test(after)) : right};
        toks.push(d); delims.push(d);
        i += n;
        continue;
      }
      buf += c; i++;
    }
    flush();
    emphasis(delims);
    if (pending) {  // the last openers on the last line with no closer yet: bold / italic to the end, for now
      for (const d of delims.filter((d) => d.active && d.open && d.sure && d.pos > lastLine).slice(-2)) {
        if (d.ch === "~") { d.opens.push("del"); d.n = 0; continue; }
        if (d.n >= 2) { d.opens.push("strong"); d.n -= 2; }
        if (d.n === 1) { d.opens.push("em"); d.n = 0; }
      }
    }
    // Tokens → nodes; runs of text become one text node each.
    const root = document.createDocumentFragment(), stack = [root];
    let run = "";
    const add = (n) => {
      if (run) { stack[stack.length - 1].append(run); run = ""; }
      if (n) stack[stack.length - 1].append(n);
    };
    for (const tk of toks) {
      if (tk.t === "text") run += tk.s;
      else if (tk.t === "node") add(tk.n);
      else {
        if (tk.closes.length) add(null);
        for (let k = 0; k < tk.closes.length && stack.length > 1; k++) stack.pop();
        run += tk.ch.repeat(tk.n);
        for (let k = tk.opens.length - 1; k >= 0; k--) {
          const e = el(tk.opens[k]);
          add(e);
          stack.push(e);
        }
      }
    }
    add(null);
    return root;
  }

  // ---- blocks → elements ----
  function codeBlock(b) {
    const wrap = el("div", "codeblock"), bar = el("div", "codebar"), copy = el("button", "copy", "Copy");
    copy.type = "button";
    copy.title = "Copy the code";
    bar.append(el("span", "lang"), copy);
    const pre = el("pre");
    pre.append(el("code"));
    wrap.append(bar, pre);
    fillCode(wrap, b);
    return wrap;
  }
  function fillCode(wrap, b) {  // everything in a code block that depends on its text
    wrap.dataset.state = b.open ? "open" : "closed";
    wrap.querySelector(".lang").textContent = b.lang;
    const code = wrap.querySelector("code");
    if (code.textContent !== b.code) code.textContent = b.code;
  }
  function renderBlocks(blocks, pending, tight) {
    const frag = document.createDocumentFragment();
    blocks.forEach((b, k) => {
      const last = pending && k === blocks.length - 1;
      if (tight && b.type === "para") {  // a tight list item: its text without a <p>
        if (k > 0 && blocks[k - 1].type === "para") frag.append(el("br"));
        frag.append(inline(b.text, last));
      } else frag.append(renderBlock(b, last));
    });
    return frag;
  }
  function renderBlock(b, pending) {
    switch (b.type) {
      case "code": return codeBlock(b);
      case "hr": return el("hr");
      case "para": case "heading": {
        const e = el(b.type === "para" ? "p" : "h" + b.level);
        e.append(inline(b.text, pending));
        return e;
      }
      case "quote": {
        const q = el("blockquote");
        q.append(renderBlocks(b.blocks, pending, false));
        return q;
      }
      case "list": {
        const list = el(b.ordered ? "ol" : "ul");
        if (b.ordered && b.start !== 1) list.start = b.start;
        b.items.forEach((item, k) => {
          const li = el("li");
          if (item.task !== null) {
            const box = el("input");
            box.type = "checkbox";
            box.defaultChecked = item.task;
            box.disabled = true;
            li.className = "task";
            li.append(box, " ");
          }
          li.append(renderBlocks(item.blocks, pending && k === b.items.length - 1, !b.loose));
          list.append(li);
        });
        return list;
      }
      case "table": {
        const wrap = el("div", "table"), table = el("table"), head = el("tr");
        const cell = (tag, text, k) => {
          const c = el(tag);
          if (b.aligns[k]) c.style.textAlign = b.aligns[k];
          c.append(inline(text, false));
          return c;
        };
        b.head.forEach((text, k) => head.append(cell("th", text, k)));
        const thead = el("thead");
        thead.append(head);
        table.append(thead);
        if (b.rows.length) {
          const body = el("tbody");
          for (const row of b.rows) {
            const tr = el("tr");
            row.forEach((text, k) => tr.append(cell("td", text, k)));
            body.append(tr);
          }
          table.append(body);
        }
        wrap.append(table);
        return wrap;
      }
    }
    throw new Error("unknown block " + b.type);
  }

  // A reply still arriving: hold back what is only markup so far (it may become a list, a fence, a rule,
  // a closing ** ...) so that it does not flash as raw characters for one token.
  function streamingView(text) {
    if (text.endsWith("\n")) return text;
    const cut = text.lastIndexOf("\n") + 1;
    if (/^[\s*_`~#>+\-=|:.\d]*$/.test(text.slice(cut))) return text.slice(0, cut);
    let end = text.length;  // less trailing markers: a ** or ` whose other half, or a [ whose link, is coming
    for (;;) {
      const c = text[end - 1];
      if (end > 0 && "*_~`[".includes(c)) end--;
      else if (c === "!" && text[end] === "[") end--;
      else return text.slice(0, end);
    }
  }

  return function render(container, text, streaming = false) {
    let source = String(text).replace(/\r\n?/g, "\n");
    if (streaming) source = streamingView(source);
    const blocks = parseBlocks(source.split("\n"));
    let before = container.mdBlocks || [];
    if (before.length > container.childNodes.length || before.some((r, k) => container.childNodes[k] !== r.node)) before = [];
    if (!before.length) container.replaceChildren();
    const after = blocks.map((b, k) => {
      const pending = streaming && k === blocks.length - 1, key = (pending ? "…" : "") + JSON.stringify(b), old = before[k];
      if (old && old.key === key) return old;
      if (old && old.type === "code" && b.type === "code") { fillCode(old.node, b); return {key, type: b.type, node: old.node}; }
      return {key, type: b.type, node: renderBlock(b, pending)};
    });
    after.forEach((r, k) => {
      const cur = container.childNodes[k];
      if (cur !== r.node) cur ? container.replaceChild(r.node, cur) : container.append(r.node);
    });
    while (container.childNodes.length > after.length) container.lastChild.remove();
    container.mdBlocks = after;
  };
})();
window.renderMarkdown = renderMarkdown;

// Copy a code block's text: the async clipboard API where the page may use it (https or localhost),
// else a hidden textarea and execCommand("copy") (plain http). Resolves to whether it worked.
async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try { await navigator.clipboard.writeText(text); return true; } catch (e) { /* denied or unfocused: the fallback */ }
  }
  const area = document.createElement("textarea"), focused = document.activeElement;
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.cssText = "position:fixed;top:0;left:0;width:1px;height:1px;opacity:0";
  document.body.appendChild(area);
  area.focus();
  area.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
  area.remove();
  if (focused && focused.focus) focused.focus();
  return ok;
}
document.addEventListener("click", (e) => {
  const button = e.target instanceof Element ? e.target.closest(".codeblock .copy") : null;
  if (!button) return;
  copyText(button.closest(".codeblock").querySelector("code").textContent).then((ok) => {
    button.textContent = ok ? "Copied" : "Copy failed";
    clearTimeout(button.resetTimer);
    button.resetTimer = setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
});
"""

PAGE_HTML = _PAGE_TEMPLATE.replace("/*MARKDOWN_JS*/", MARKDOWN_JS.strip())

_SECURITY_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Content-Security-Policy",
     "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
     "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
)


_BODY = None


def page_response() -> web.Response:
    """The chat page as an HTTP 200 response."""
    global _BODY
    if _BODY is None:
        _BODY = PAGE_HTML.encode("utf-8")
    return web.Response(body=_BODY, headers={"Content-Type": "text/html; charset=utf-8", **dict(_SECURITY_HEADERS)})
