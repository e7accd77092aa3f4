"""The browser chat page, served at ``/`` on the websocket port.

One self-contained page (no external assets): it opens ``/v1/ws`` on the same origin (passing the
page's own ``?api_key=`` on, if any), sends the conversation as ``messages``, streams the reply, and
shows per reply the client-measured time to first token, tokens/s and τ (tokens per verify step),
with a stop button that sends ``response.cancel``. Model text is only ever set through
``textContent``, never parsed as HTML.

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

PAGE_HTML = r"""<!doctype html>
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
  .msg.assistant[data-status="streaming"] .content::after { content: "▍"; color: var(--accent); }
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
  content.className = "content"; content.textContent = text;
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
      live.el.querySelector(".content").textContent = live.text;
      updateStats(null);
      $("scroll").scrollTop = $("scroll").scrollHeight;
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
  if (!live.text) {
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
  live = {id: null, eventId: "page-" + (++nextEvent), el, text: "", tokens: 0, deltas: 0, firstTokens: 0, sentAt: performance.now(), firstAt: null, lastAt: null};
  const response = {messages: turns.map((t) => ({role: t.role, content: t.content})), truncation: "auto",
                    stream_pacing: $("smooth").checked ? "smooth" : "off",
                    temperature: Number($("temperature").value) || 0};
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) response.max_output_tokens = maxTokens;
  if (format) { response.text = {format}; el.dataset.schema = "1"; }
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
