"""The OpenAI-compatible HTTP API's requests, responses and errors (the handlers are in openai_api.py).

Requests are validated like websocket events, by the same field validators (protocol.py), and just as
strictly: an unknown field is an error (OpenAI answers "Unrecognized request argument" too). Fields
OpenAI defines that we do not implement (penalties, logprobs, tools, ...) are accepted only at their
neutral values, so a client that sends its defaults works and one that relies on them is told.

specserve extras (vLLM spells the first three the same): ``top_k``, ``min_p``, ``ignore_eos``,
``drafter`` (the server's drafter or ``"none"``), ``stream_pacing`` (``"off"`` | ``"smooth"``).

Structured output: ``response_format`` (``{"type": "json_schema", "json_schema": {name, schema, strict}}``,
``{"type": "json_object"}`` or ``{"type": "text"}``), or vLLM's ``guided_json`` (a schema, object or
JSON text), ``guided_regex``, ``guided_choice`` (strings), ``guided_grammar`` (Lark, llguidance's
dialect) and ``structured_outputs`` ({json | regex | choice | grammar}); at most one of them, plus
``json_whitespace`` ("compact" | "flexible"). Anything wrong with them is a 400 ``invalid_grammar``.
Omitted ``max_tokens`` means the rest of the context; a prompt plus ``max_tokens`` past the window is
a 400 naming both numbers.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with OpenAI's statuses: 400 invalid
request, 401 bad key, 403 origin, 404 model or route not found, 405, 413, 429 busy, 500.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from specserve.defaults import MAX_LOGPROBS
from specserve.server.prompts import FieldNames, ToolMessages
from specserve.server.tool_calls import ToolPlan, history_message, parse_tools
from specserve.server.protocol import (
    MAX_MESSAGES,
    PENALTY_FIELDS,
    ConstraintSpec,
    ProtocolError,
    _int,
    _json_type,
    _reject_constant,
    dumps,
    grammar_error,
    json_schema_spec,
    parse_json_whitespace,
    parse_options,
    parse_sampling,
)

CHAT_NAMES = FieldNames(input="prompt", messages="messages", max_tokens="max_tokens")
COMPLETION_NAMES = FieldNames(input="prompt", messages="messages", max_tokens="max_tokens")

#: HTTP status of each error code (anything else: 400 for invalid_request_error, 429 rate_limit_error, 500).
HTTP_STATUS = {
    "invalid_api_key": 401,
    "origin_not_allowed": 403,
    "model_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "message_too_large": 413,
}
TYPE_STATUS = {"invalid_request_error": 400, "rate_limit_error": 429, "server_error": 500}

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", *PENALTY_FIELDS)
#: Structured output: OpenAI's response_format, vLLM's guided_* fields and structured_outputs.
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_CONSTRAINTS = ("response_format", *_GUIDED, "structured_outputs", "json_whitespace")
_COMMON = ("model", "max_tokens", "n", "logprobs", "stream", "stream_options", "user", "drafter", "stream_pacing", *_SAMPLING,
           *_CONSTRAINTS)
#: Accepted only at these neutral values (the first one is what we behave as).
_NEUTRAL: dict[str, tuple] = {
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "service_tier": (None, "auto", "default"), "store": (None, False),
    "metadata": (None,), "modalities": (None, ["text"]), "reasoning_effort": (None,), "prediction": (None,),
    "audio": (None,), "suffix": (None, ""), "best_of": (None, 1),
}
_CHAT_ONLY = ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls")
_CHAT_NEUTRAL = ("functions", "function_call", "service_tier", "store", "metadata", "modalities", "reasoning_effort", "prediction", "audio")
_COMPLETION_NEUTRAL = ("suffix",)
MAX_N = 16  # choices per request (n)
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class CompletionRequest:
    chat: bool
    model: str | None
    input: str | list[int] | None  # completions
    messages: list[dict] | None  # chat completions
    sampling: dict[str, Any]  # websocket field names; max_output_tokens None = the rest of the context
    stream: bool
    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats (vLLM's): usage so far in every chunk
    drafter: str | None  # None: the server's choice
    stream_pacing: str
    constraint: ConstraintSpec | None = None  # structured output, not yet compiled (submit.make_params does)
    n: int = 1  # choices: n sequences of the prompt, seeds seed + i
    logprobs: int | None = None  # top log-probabilities per generated token (None: no logprobs)
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its log-probabilities) first
    tools: ToolPlan | None = None  # chat: tools and tool_choice (tool_calls.py)

    @property
    def names(self) -> FieldNames:
        return CHAT_NAMES if self.chat else COMPLETION_NAMES


def parse_body(raw: bytes) -> dict:
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ProtocolError("invalid_json", "the request body nests JSON too deeply") from None
    except ValueError as exc:
        raise ProtocolError("invalid_json", f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_type", f"the request body must be a JSON object, got {_json_type(obj)}")
    return obj


def parse_request(body: dict, chat: bool, defaults: dict) -> CompletionRequest:
    """Validate a chat completion (``chat``) or completion body; ``defaults``: the sampling defaults."""
    neutral = _CHAT_NEUTRAL if chat else _COMPLETION_NEUTRAL
    allowed = (*_COMMON, *(_CHAT_ONLY if chat else ("prompt", "echo", "best_of")), *neutral)
    for key in body:
        if key not in allowed:
            shown = key if len(key) <= 64 else key[:64] + "..."
            raise ProtocolError("unknown_field", f"Unrecognized request argument supplied: {shown}", shown)
    for key in neutral:
        if key in body and not any(_same(body[key], v) for v in _NEUTRAL[key]):
            raise ProtocolError("invalid_value", f"{key} is not supported by this server; leave it out", key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("invalid_type", f"model must be a string, got {_json_type(model)}", "model")
    if chat:
        if "messages" not in body:
            raise ProtocolError("missing_field", "messages is required: a list of {role, content} objects", "messages")
        messages, prompt = _messages(body["messages"]), None
        tools = parse_tools(body)
        if tools is not None and tools.template_tools():
            messages = ToolMessages(messages)
            messages.tools = tools.template_tools()
    else:
        tools = None
        if "prompt" not in body:
            raise ProtocolError("missing_field", "prompt is required: a string or a list of token ids", "prompt")
        messages, prompt = None, _prompt(body["prompt"])
    n = 1 if body.get("n") is None else _int(body["n"], "n", 1, MAX_N)
    if not chat and body.get("best_of") is not None and not _same(body["best_of"], 1):
        raise ProtocolError("invalid_value", "best_of is not supported (it ranks hidden candidates): use n, and "
                            "logprobs to rank the choices yourself", "best_of")
    logprobs, echo = _logprobs(body, chat)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ProtocolError("invalid_type", "stream must be a boolean", "stream")
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    sampling = {**defaults, **parse_sampling({k: body[k] for k in _SAMPLING if k in body and body[k] is not None}, "", None)}
    sampling["max_output_tokens"] = _max_tokens(body, chat)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
        if echo:
            sampling["prompt_logprobs"] = logprobs
    drafter = body.get("drafter")
    if drafter is not None and (not isinstance(drafter, str) or not drafter):
        raise ProtocolError("invalid_type", 'drafter must be the server\'s drafter name or "none"', "drafter")
    options = parse_options({k: body[k] for k in ("stream_pacing",) if k in body and body[k] is not None}, "")
    return CompletionRequest(chat, model, prompt, messages, sampling, stream, include_usage, continuous_usage, drafter,
                             options.get("stream_pacing", "off"), _tool_constraint(body, tools), n, logprobs, echo, tools)


def _tool_constraint(body: dict, tools: ToolPlan | None) -> ConstraintSpec | None:
    """The structured-output field, or the tool-call grammar (required / a named function): not both."""
    spec = _constraint(body)
    if tools is None or not tools.constrained:
        return spec
    if spec is not None:
        raise grammar_error(f"tool_choice {tools.mode!r} constrains the output already: leave out {spec.param}", spec.param)
    return tools.constraint(parse_json_whitespace(body, "json_whitespace"))


def _logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(top log-probabilities per token or None, echo). Chat: `logprobs` true/false and `top_logprobs`
    0..20 (only with logprobs true); completions: `logprobs` 0..20 and `echo`."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ProtocolError("invalid_type", "echo must be a boolean", "echo")
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise ProtocolError("invalid_type", "logprobs must be a boolean (top_logprobs says how many alternatives)",
                                "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            top = _int(top, "top_logprobs", 0, MAX_LOGPROBS)
            if not value:
                raise ProtocolError("invalid_value", "top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if value else None, False
    if value is None:
        return None, bool(echo)
    return _int(value, "logprobs", 0, MAX_LOGPROBS), bool(echo)


def _constraint(body: dict) -> ConstraintSpec | None:
    """The one structured-output field given (response_format, guided_*, structured_outputs), or None."""
    whitespace = parse_json_whitespace(body, "json_whitespace")
    found: list[ConstraintSpec] = []
    given: list[str] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt, whitespace)
        if spec is not None:  # {"type": "text"} constrains nothing
            given.append("response_format")
            found.append(spec)
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            given.append(key)
            found.append(_guided(kind, body[key], key, whitespace))
    if body.get("structured_outputs") is not None:
        value = body["structured_outputs"]
        given.append("structured_outputs")
        if not isinstance(value, dict):
            raise grammar_error("structured_outputs must be an object with one of json, regex, choice, grammar",
                                "structured_outputs")
        for key in value:
            if key not in _STRUCTURED_OUTPUTS:
                raise grammar_error(f"structured_outputs.{key[:64]} is not supported; give one of "
                                    f"{', '.join(_STRUCTURED_OUTPUTS)}", f"structured_outputs.{key[:64]}")
        present = [k for k in _STRUCTURED_OUTPUTS if value.get(k) is not None]
        if len(present) != 1:
            raise grammar_error("structured_outputs takes exactly one of json, regex, choice, grammar", "structured_outputs")
        key = present[0]
        found.append(_guided(_STRUCTURED_OUTPUTS[key], value[key], f"structured_outputs.{key}", whitespace))
    if len(found) > 1:
        raise grammar_error(f"give at most one of response_format, {', '.join(_GUIDED)} and structured_outputs; "
                            f"got {', '.join(given)}", given[1])
    return found[0] if found else None


def _response_format(fmt: Any, whitespace: str) -> ConstraintSpec | None:
    if not isinstance(fmt, dict):
        raise grammar_error(f"response_format must be an object {{type, ...}}, got {_json_type(fmt)}", "response_format")
    kind = fmt.get("type")
    allowed = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema")}
    if not isinstance(kind, str) or kind not in allowed:
        raise grammar_error('response_format.type must be "json_schema", "json_object" or "text"', "response_format.type")
    for key in fmt:
        if key not in allowed[kind]:
            raise grammar_error(f"unknown field response_format.{key[:64]} for type {kind!r}", f"response_format.{key[:64]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_schema", {"type": "object"}, "response_format", whitespace)
    path = "response_format.json_schema"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise grammar_error(f"{path} is required: an object {{name, schema, strict}}", path)
    for key in spec:
        if key not in ("name", "schema", "strict", "description"):
            raise grammar_error(f"unknown field {path}.{key[:64]}; allowed: name, schema, strict, description",
                                f"{path}.{key[:64]}")
    return json_schema_spec(spec, path, whitespace)


def _guided(kind: str, value: Any, param: str, whitespace: str) -> ConstraintSpec:
    """vLLM's guided_json (a schema or its JSON text), guided_regex, guided_choice and guided_grammar."""
    if kind == "json_schema":
        if not isinstance(value, (dict, str)):
            raise grammar_error(f"{param} must be a JSON schema (an object, or its JSON text)", param)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise grammar_error(f"{param} must be a non-empty list of non-empty strings", param)
        value = list(value)
    elif not isinstance(value, str) or not value:
        raise grammar_error(f"{param} must be a non-empty string", param)
    return ConstraintSpec(kind, value, param, whitespace)


def _same(value, neutral) -> bool:
    if neutral is None:
        return value is None
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, neutral))
    return value == neutral if numbers else (type(value) is type(neutral) and value == neutral)


def _max_tokens(body: dict, chat: bool) -> int | None:
    given = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    for key, value in given.items():
        _int(value, key, 1, None)
    if len(set(given.values())) > 1:
        raise ProtocolError("invalid_value", "max_tokens and max_completion_tokens disagree: give one of them",
                            "max_completion_tokens")
    return next(iter(given.values()), None)


def _stream_options(value, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)."""
    if value is None:
        return False, False
    if not stream:
        raise ProtocolError("invalid_value", "stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(value, dict):
        raise ProtocolError("invalid_type", "stream_options must be an object", "stream_options")
    out = []
    for key in value:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise ProtocolError("unknown_field", f"Unrecognized stream option: {key[:64]}", f"stream_options.{key[:64]}")
    for key in ("include_usage", "continuous_usage_stats"):
        flag = value.get(key, False)
        if not isinstance(flag, bool):
            raise ProtocolError("invalid_type", f"stream_options.{key} must be a boolean", f"stream_options.{key}")
        out.append(flag)
    return out[0], out[1]


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise ProtocolError("invalid_type", "messages must be a list of {role, content} objects", "messages")
    if not 0 < len(value) <= MAX_MESSAGES:
        raise ProtocolError("invalid_value", f"messages must hold 1..{MAX_MESSAGES} messages", "messages")
    out = []
    for i, msg in enumerate(value):
        here = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ProtocolError("invalid_type", f"{here} must be an object with role and content", here)
        for key in msg:
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
                raise ProtocolError("unknown_field", f"{here}.{key[:64]} is not supported", f"{here}.{key[:64]}")
        role = msg.get("role")
        if role not in ROLES:
            raise ProtocolError("invalid_value", f"{here}.role must be one of {', '.join(ROLES)}", f"{here}.role")
        if role == "tool" or msg.get("tool_calls") is not None:
            content = msg.get("content")
            out.append(history_message({**msg, "content": None if content is None else _content(content, f"{here}.content")},
                                       here))
            continue
        out.append({"role": role, "content": _content(msg.get("content"), f"{here}.content")})
    return out


def _content(value: Any, path: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ProtocolError("invalid_value", f"{path}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}",
                                    f"{path}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    if value is None:
        raise ProtocolError("missing_field", f"{path} is required", path)
    raise ProtocolError("invalid_type", f"{path} must be a string or a list of text parts", path)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise ProtocolError("invalid_value", "prompt is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise ProtocolError("invalid_value", "one prompt per request: send several requests for several prompts", "prompt")
    if isinstance(value, list) and not value:
        raise ProtocolError("invalid_value", "prompt is empty", "prompt")
    raise ProtocolError("invalid_type", "prompt must be a string or a list of token ids", "prompt")


# ---- responses ----------------------------------------------------------------------------------------


def error_body(err: ProtocolError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_status(err: ProtocolError) -> int:
    return HTTP_STATUS.get(err.code) or TYPE_STATUS.get(err.type, 400)


class Shapes:
    """Builds one response's objects: the whole response, its stream chunks, the usage chunk."""

    def __init__(self, rid: str, chat: bool, model: str) -> None:
        self.rid, self.chat, self.model = rid, chat, model
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        # A text chunk is the same JSON every time but for its text: render the rest once (the stream's
        # hot path; json.dumps of the whole dict per token cost more than the text itself).
        marker = "\u0000TEXT\u0000"
        template = self.chunk(text=marker)
        self._text_head, self._text_tail = template.split(dumps(marker))

    def _base(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def text_chunk(self, text: str, usage: dict | None = None) -> str:
        """A chunk carrying ``text`` (and, when asked for, the usage so far)."""
        if usage is not None:
            return self.chunk(text=text, usage=usage)
        return self._text_head + dumps(text) + self._text_tail

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              usage: dict | None = None, index: int = 0, logprobs: dict | None = None,
              tool_calls: list | None = None) -> str:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._base("text_completion"), "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return dumps(out)

    def final_chunk(self, finish_reason: str, spec: dict, usage: dict | None, timing: dict | None = None,
                    index: int = 0) -> list[str]:
        """The chunk with the finish reason, and the usage chunk when asked for; the last one carries ``spec``
        and ``timing`` (ms: queue_ms, ttft_ms, e2e_ms from receipt; engine_ttft_ms as LLM.generate reports)."""
        base = self._base("chat.completion.chunk" if self.chat else "text_completion")
        if self.chat:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}
        chunks = [{**base, "choices": [choice]}]
        if usage is not None:
            chunks.append({**base, "choices": [], "usage": usage})
        chunks[-1]["spec"] = spec
        if timing:
            chunks[-1]["timing"] = timing
        return [dumps(c) for c in chunks]

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None = None,
               tool_calls: list | None = None) -> dict:
        """One choice of a whole response."""
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text if tool_calls is None else None}
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self, choices: list[dict], usage: dict, spec: dict, timing: dict | None = None) -> dict:
        out = {**self._base(self.object), "choices": choices, "usage": usage, "spec": spec}
        if timing:
            out["timing"] = timing
        return out


def usage_of(summary, more=()) -> dict:
    """Usage of a response; ``more``: the other choices' summaries (n > 1: the prompt counts once)."""
    completion = summary.output_tokens + sum(m.output_tokens for m in more)
    return {"prompt_tokens": summary.input_tokens, "completion_tokens": completion,
            "total_tokens": summary.input_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": summary.cached_tokens}}


def spec_of(summary) -> dict:
    return summary.spec or {"tau": 0.0, "steps": 0, "accepted_per_position": []}
