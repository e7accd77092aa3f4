"""OpenAI tool calls: `tools`, `tool_choice`, `parallel_tool_calls` → what the model is asked for, and
its output → `message.tool_calls`.

- ``"none"`` (or no tools): plain text; the tools are not shown to the model.
- ``"auto"``: the tools go through the chat template (`tools=` of Hugging Face's apply_chat_template;
  without a template, a ``tools: [...]`` line); the output is plain text unless it holds the model's
  own tool-call syntax — Hermes-style ``<tool_call>{"name", "arguments"}</tool_call>`` (Qwen2.5/3) or
  a whole output that is one JSON object ``{"name", "parameters" | "arguments"}`` (Llama 3.1) — which
  becomes tool_calls.
- ``"required"`` and a named function: the output is constrained (grammar/, llguidance) by a JSON schema
  built from the tools' own schemas — a named function: its `parameters` schema alone (the output IS
  the arguments); required: ``{"name": const, "arguments": schema}`` for any tool (`anyOf`), an array
  of at least one of them when `parallel_tool_calls` (the default) allows several.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.server.protocol import ConstraintSpec, ProtocolError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for. mode: "none" | "auto" | "required" | "named"."""

    tools: list[dict]  # OpenAI's tool objects, validated
    mode: str
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def constraint(self, whitespace: str) -> ConstraintSpec | None:
        """The JSON schema the output must follow (None for none/auto)."""
        if self.mode == "named":
            return ConstraintSpec("json_schema", _parameters(self._tool(self.name)), "tool_choice", whitespace)
        if self.mode != "required":
            return None
        one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                           "arguments": _parameters(t)},
                          "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]}
        schema = {"type": "array", "items": one, "minItems": 1} if self.parallel else one
        return ConstraintSpec("json_schema", schema, "tools", whitespace)

    def template_tools(self) -> list[dict] | None:
        """The tools shown to the model through the chat template (None: not shown)."""
        return self.tools if self.mode != "none" else None

    def _tool(self, name: str) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)

    def calls(self, text: str) -> list[dict] | None:
        """The output as OpenAI `tool_calls` (None: plain content)."""
        if self.mode == "named":
            return [tool_call(self.name, text)]
        if self.mode == "required":  # the grammar made it valid (a complete output)
            # The arguments as generated (what a stream sends, fragment by fragment: RequiredStream).
            return [tool_call(c["name"], text[slice(*c["args"])]) for c in scan_required(text)]
        if self.mode == "auto":
            return parse_auto(text, {t["function"]["name"] for t in self.tools})
        return None


def tool_call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": arguments}}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_auto(text: str, names: set[str]) -> list[dict] | None:
    """Tool calls in a model's own syntax (Hermes `<tool_call>` blocks, or Llama 3.1's whole-output JSON);
    None when the text holds none (or names no known tool: then it stays content)."""
    blocks = _HERMES.findall(text)
    candidates = blocks if blocks else [text.strip().removeprefix("<|python_tag|>")]
    calls = []
    for block in candidates:
        try:
            value = json.loads(block)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        args = value.get("arguments", value.get("parameters", {}))
        calls.append(tool_call(value["name"], args if isinstance(args, str) else json.dumps(args, separators=(", ", ": "))))
    return calls or None


def _parameters(tool: dict) -> dict:
    """The schema a call's arguments are constrained by. An object schema that does not say whether other
    keys are allowed gets ``additionalProperties: false`` (the arguments hold the declared parameters, as
    under OpenAI's strict mode): JSON Schema's default lets a model append keys of its own invention,
    and a small one did, until max_tokens — the call never completed. A schema that says keeps its choice."""
    schema = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema = {**schema, "additionalProperties": False}
    return schema


def parse_tools(body: dict) -> ToolPlan | None:
    """Validate `tools`, `tool_choice`, `parallel_tool_calls` (ProtocolError naming the field)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError("invalid_type", "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ProtocolError("invalid_value", "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ProtocolError("invalid_type", f"tools must be a list of at most {MAX_TOOLS} tool objects", "tools")
    names = []
    for i, tool in enumerate(tools):
        here = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ProtocolError("invalid_value", f'{here} must be {{"type": "function", "function": {{name, parameters}}}}', here)
        for key in tool:
            if key not in ("type", "function"):
                raise ProtocolError("unknown_field", f"unknown field {here}.{key[:64]}", f"{here}.{key[:64]}")
        fn = tool["function"]
        for key in fn:
            if key not in ("name", "description", "parameters", "strict"):
                raise ProtocolError("unknown_field", f"unknown field {here}.function.{key[:64]}", f"{here}.function.{key[:64]}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ProtocolError("invalid_value", f"{here}.function.name must be 1-64 letters, digits, _ or -", f"{here}.function.name")
        if name in names:
            raise ProtocolError("invalid_value", f"{here}.function.name {name!r} is given twice", f"{here}.function.name")
        names.append(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ProtocolError("invalid_value", f"{here}.function.parameters must be a JSON schema of an object",
                                f"{here}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ProtocolError("invalid_type", f"{here}.function.description must be a string", f"{here}.function.description")
    mode, name = _choice(choice, names)
    return ToolPlan(list(tools), mode, name, parallel is not False)


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ProtocolError("invalid_value", f"tool_choice names {str(name)[:64]!r}, which is not among tools",
                                "tool_choice.function.name")
        return "named", name
    raise ProtocolError("invalid_value", 'tool_choice must be "none", "auto", "required" or '
                        '{"type": "function", "function": {"name": ...}}', "tool_choice")


def history_message(msg: dict, here: str) -> dict:
    """An assistant message's `tool_calls` or a `role: "tool"` result, as the chat template takes them."""
    out = {"role": msg["role"], "content": msg.get("content") or ""}
    if msg["role"] == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ProtocolError("missing_field", f"{here}.tool_call_id is required for a tool message", f"{here}.tool_call_id")
        out["tool_call_id"] = call_id
    calls = msg.get("tool_calls")
    if calls is not None:
        if msg["role"] != "assistant" or not isinstance(calls, list):
            raise ProtocolError("invalid_value", f"{here}.tool_calls is a list, on assistant messages only", f"{here}.tool_calls")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
                raise ProtocolError("invalid_value", f"{here}.tool_calls[{j}] must be {{id, type, function: {{name, arguments}}}}",
                                    f"{here}.tool_calls[{j}]")
            try:
                arguments = json.loads(fn["arguments"])  # templates render arguments as objects
            except ValueError:
                raise ProtocolError("invalid_value", f"{here}.tool_calls[{j}].function.arguments must be JSON text",
                                    f"{here}.tool_calls[{j}].function.arguments") from None
            out["tool_calls"].append({"id": call.get("id"), "type": "function",
                                      "function": {"name": fn["name"], "arguments": arguments}})
        if not out["content"]:  # the plain-text fallback shows the calls
            out["content"] = json.dumps([c["function"] for c in out["tool_calls"]])
    return out


def scan_required(text: str) -> list[dict]:
    """The calls in (a prefix of) a `required` output — one ``{"name", "arguments"}`` object, or an array
    of them — as far as they go: per call ``{"name": str | None (until its string is complete),
    "args": (start, end) | None, "done": bool}``, ``args`` the raw text span of its arguments value (end
    at the text's end while the value is incomplete; arguments are objects: parse_tools requires it). Raw spans let a stream send the arguments as they
    are generated, and make the whole response's arguments equal to what a stream sends."""
    return RequiredScanner().feed(text)


class RequiredScanner:
    """scan_required over a text that grows: each feed reads only the new text (an incomplete string's end
    is looked for from where the last feed stopped), so a stream's scans cost its length once, not once
    per delta."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[dict] = []
        self._stack: list[str] = []  # open containers: "{" / "["
        self._call_depth: int | None = None  # the depth of a call object: 1 alone, 2 inside the array
        self._key: str | None = None
        self._expect_key = False
        self._value_key: str | None = None
        self._value_start: int | None = None
        self._i = 0  # where the next feed resumes
        self._j = 0  # an incomplete string's end scanned so far (it opens at _i)

    def feed(self, more: str) -> list[dict]:
        """Read ``more`` (appended to the text so far); the calls as far as they go (scan_required's)."""
        self.text += more
        text, calls, stack, call_depth = self.text, self.calls, self._stack, self._call_depth
        key, expect_key, value_key, value_start = self._key, self._expect_key, self._value_key, self._value_start
        i, n = self._i, len(text)
        while i < n:
            ch = text[i]
            if ch == '"':  # a string: find its end (escapes skipped)
                j = self._j if i == self._i and self._j > i else i + 1
                while j < n and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                if j >= n:
                    self._j = j  # incomplete string: its end is looked for from here with more text
                    break
                literal = text[i:j + 1]
                depth = len(stack)
                if depth == call_depth and expect_key:
                    key, expect_key = json.loads(literal), False
                elif depth == call_depth and value_key == "name" and value_start is None:
                    calls[-1]["name"] = json.loads(literal)
                    value_key = None
                i = j + 1
                continue
            depth = len(stack)
            if ch in "{[":
                if call_depth is None:
                    call_depth = 1 if ch == "{" else 2
                stack.append(ch)
                if len(stack) == call_depth and ch == "{":
                    calls.append({"name": None, "args": None, "done": False})
                    expect_key = True
                elif depth == call_depth and value_key == "arguments" and value_start is None:
                    value_start = i
            elif ch in "}]":
                if stack:
                    stack.pop()
                if len(stack) == call_depth and value_start is not None:  # the arguments value closed
                    calls[-1]["args"] = (value_start, i + 1)
                    value_start, value_key = None, None
                elif len(stack) == call_depth - 1 and ch == "}" and calls:
                    calls[-1]["done"] = True
            elif ch == ":" and depth == call_depth and key is not None:
                value_key, key = key, None
            elif ch == "," and depth == call_depth:
                expect_key = True
            i += 1
        if value_start is not None:  # the arguments value is still open: its span so far
            calls[-1]["args"] = (value_start, n)
        self._call_depth, self._key, self._expect_key, self._value_key, self._value_start = (
            call_depth, key, expect_key, value_key, value_start)
        self._i = i
        return calls


class RequiredStream:
    """OpenAI tool-call deltas for a streamed `required` output, as it is generated: a call's first delta
    (``{index, id, type, function: {name, arguments}}``) once its name is complete, then its arguments'
    new text as ``function.arguments`` fragments."""

    def __init__(self) -> None:
        self.scanner = RequiredScanner()
        self.sent: list[int] = []  # per opened call: characters of its arguments sent

    def feed(self, text: str) -> list[dict]:
        calls = self.scanner.feed(text)
        text = self.scanner.text
        deltas = []
        for j, call in enumerate(calls):
            if call["name"] is None:
                break
            start, end = call["args"] if call["args"] is not None else (0, 0)
            if j == len(self.sent):
                opened = tool_call(call["name"], text[start:end])
                self.sent.append(end - start)
                deltas.append({"index": j, **opened})
            elif end - start > self.sent[j]:
                deltas.append({"index": j, "function": {"arguments": text[start + self.sent[j]:end]}})
                self.sent[j] = end - start
        return deltas
