"""The websocket protocol: parse and validate client events, build server events.

Every frame is one JSON object with a ``type``. Client events (validated here, strictly: unknown
fields are errors so that typos never pass silently):

- ``response.create {event_id?, response: {input | messages, max_output_tokens, temperature, top_p,
  top_k, min_p, seed, stop, ignore_eos, stream_pacing, truncation, metadata, text, json_whitespace,
  logprobs, top_logprobs}}`` (``text: {format: ...}``: structured output as OpenAI's Responses API spells
  it, see :func:`parse_text_format`; ``logprobs``/``top_logprobs``: :func:`parse_logprobs`)
- ``response.cancel {event_id?, response_id}``
- ``session.update {event_id?, session: {drafter?, defaults?}}`` (defaults: the sampling fields,
  ``stream_pacing`` and ``truncation``)

Server events: ``session.created``, ``session.updated``, ``response.created``,
``response.output_text.delta``, ``response.done`` and ``error`` (builders below).

Anything wrong raises :class:`ProtocolError`, which carries the ``error`` event's ``type``, ``code``,
``param`` (the offending field's path, e.g. ``response.temperature``) and a message saying what is
allowed. The connection stays open after every ProtocolError.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from specserve.defaults import MAX_LOGPROBS

# ---- error types and codes ----------------------------------------------------------------------

INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"

#: code -> error type. Every ``error`` event and failed ``response.done`` uses one of these codes.
ERROR_CODES: dict[str, str] = {
    "invalid_json": INVALID_REQUEST,  # frame is not JSON (or uses NaN/Infinity, or nests too deeply)
    "binary_not_supported": INVALID_REQUEST,  # binary frame: only JSON text frames are spoken
    "invalid_event": INVALID_REQUEST,  # JSON, but not an object with a string "type"
    "unknown_event_type": INVALID_REQUEST,
    "unknown_field": INVALID_REQUEST,
    "missing_field": INVALID_REQUEST,
    "invalid_type": INVALID_REQUEST,
    "invalid_value": INVALID_REQUEST,  # right type, out of range or otherwise not allowed
    "message_too_large": INVALID_REQUEST,
    "response_not_found": INVALID_REQUEST,  # cancel of an id that is unknown, finished or not this session's
    "context_length_exceeded": INVALID_REQUEST,  # the prompt leaves no room for one output token
    "tokenizer_unavailable": INVALID_REQUEST,  # text input for a model without tokenizer files
    "drafter_unavailable": INVALID_REQUEST,  # session.update names a drafter the server did not load
    "request_rejected": INVALID_REQUEST,  # the engine refused the request (e.g. larger than the KV cache)
    "invalid_grammar": INVALID_REQUEST,  # structured output: a bad format, schema, regex, grammar or choice list
    "too_many_responses": RATE_LIMIT,  # per-connection concurrent response limit
    "too_many_connections": RATE_LIMIT,  # sent once, then the socket closes with code 1013
    "server_busy": RATE_LIMIT,  # server-wide queue of responses is full
    "slow_consumer": RATE_LIMIT,  # this connection's unsent output passed its bound
    "internal_error": SERVER_ERROR,
    # The HTTP API's own (openai_protocol.py gives each its status):
    "invalid_api_key": INVALID_REQUEST,  # 401
    "origin_not_allowed": INVALID_REQUEST,  # 403: a browser page from an origin that is not allowed
    "model_not_found": INVALID_REQUEST,  # 404: "model" names a model this server does not serve
    "not_found": INVALID_REQUEST,  # 404: no such route
    "method_not_allowed": INVALID_REQUEST,  # 405
}

MAX_EVENT_ID_CHARS = 128
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MESSAGE_ROLES = ("system", "developer", "user", "assistant")
MAX_SEED = 2**63 - 1
# Below this, logits / temperature overflows fp32 in the engine's sampling transform (inf - inf = nan);
# such temperatures are greedy in all but name, so ask for 0 instead.
MIN_TEMPERATURE = 1e-4
# A top_p that underflows fp32 (e.g. 1e-300) masks every token (NaN again); top_k goes into an int64 tensor.
MIN_TOP_P = 1e-6
MAX_TOP_K = 2**31 - 1


# Client-facing messages carry no traceback and no server file path: a message built from a deep
# exception's text (the engine's, a grammar library's, torch's) can embed either, and both tell a stranger
# how the server is laid out. Every error event and HTTP error body is made from a ProtocolError, so this
# is the one place to enforce it.
_TRACEBACK = re.compile(r"Traceback \(most recent call last\).*", re.DOTALL)
_FRAME = re.compile(r"""\s*File "[^"]*", line \d+(?:, in \S+)?""")
_PATH = re.compile(
    r"""(?<![^\s'"(\[<,;=])[^\s'"()<>,;]*[/\\][^\s'"()<>,;]*\.(?:py[cdiox]?|so|dylib|dll|rs|c|cc|cpp|h|hpp|cu|cuh)\b(?::\d+)*"""
    r"""|(?:/[^\s'"()<>,;]+)*/(?:site|dist)-packages(?:/[^\s'"()<>,;]+)*"""
)


def client_safe(message: str) -> str:
    """``message`` without tracebacks, ``File "...", line N`` frames or server file paths."""
    message = _TRACEBACK.sub("", message)
    message = _FRAME.sub("", message)
    message = _PATH.sub("<internal>", message)
    return message.strip() or "the request failed"


class ProtocolError(Exception):
    """A client mistake or a limit: becomes one ``error`` event; the session carries on."""

    def __init__(self, code: str, message: str, param: str | None = None, event_id: str | None = None) -> None:
        assert code in ERROR_CODES, code
        message = client_safe(message)
        super().__init__(message)
        self.code = code
        self.type = ERROR_CODES[code]
        self.message = message
        self.param = param
        self.event_id = event_id
        self.event_type: str | None = None  # the client event it answers, when known (metrics count refused creates)

    def to_error(self) -> dict:
        """The ``error`` object (inside an ``error`` event or a failed ``response.done``)."""
        err = {"type": self.type, "code": self.code, "message": self.message}
        if self.param is not None:
            err["param"] = self.param
        return err


# ---- client events ------------------------------------------------------------------------------


@dataclass
class CreateResponse:
    """``response.create``: exactly one of ``input`` (text or token ids) and ``messages``.

    ``sampling`` holds only the fields the client gave; the session fills the rest from its defaults.
    """

    event_id: str | None
    input: str | list[int] | None
    messages: list[dict] | None
    sampling: dict[str, Any]
    metadata: dict[str, str]
    constraint: ConstraintSpec | None = None


@dataclass
class CancelResponse:
    event_id: str | None
    response_id: str


@dataclass
class UpdateSession:
    """``session.update``: ``drafter`` is None when not given; ``"none"`` switches speculation off."""

    event_id: str | None
    drafter: str | None
    defaults: dict[str, Any] = field(default_factory=dict)


ClientEvent = CreateResponse | CancelResponse | UpdateSession


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_event(text: str, *, max_output_tokens: int) -> ClientEvent:
    """Parse one text frame into a validated client event, or raise ProtocolError.

    max_output_tokens: the largest value ``max_output_tokens`` may take (the context window - 1).
    """
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ProtocolError("invalid_json", "frame nests JSON too deeply") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise ProtocolError("invalid_json", f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_event", f"an event must be a JSON object, got {_json_type(obj)}")
    event_id = _event_id(obj)
    kind = obj.get("type")
    if kind is None:
        raise ProtocolError("missing_field", "event has no 'type'", "type", event_id)
    if not isinstance(kind, str):
        raise ProtocolError("invalid_type", f"'type' must be a string, got {_json_type(kind)}", "type", event_id)
    parser = _PARSERS.get(kind)
    if parser is None:
        known = ", ".join(sorted(_PARSERS))
        raise ProtocolError("unknown_event_type", f"unknown event type {kind[:64]!r}; known: {known}", "type", event_id)
    try:
        return parser(obj, event_id, max_output_tokens)
    except ProtocolError as err:
        err.event_id = event_id
        err.event_type = kind
        raise


def _event_id(obj: dict) -> str | None:
    event_id = obj.get("event_id")
    if event_id is None:
        return None
    if not isinstance(event_id, str):
        raise ProtocolError("invalid_type", f"'event_id' must be a string, got {_json_type(event_id)}", "event_id")
    if not event_id or len(event_id) > MAX_EVENT_ID_CHARS:
        raise ProtocolError("invalid_value", f"'event_id' must have 1..{MAX_EVENT_ID_CHARS} characters", "event_id")
    return event_id


def _parse_create(obj: dict, event_id: str | None, max_output_tokens: int) -> CreateResponse:
    _only(obj, ("type", "event_id", "response"), "")
    resp = _object(obj, "response", "response", required=True)
    _only(resp, ("input", "messages", "metadata", *SAMPLING_FIELDS, *RESPONSE_OPTIONS, *CONSTRAINT_FIELDS,
                 *LOGPROB_FIELDS), "response.")
    has_input, has_messages = "input" in resp, "messages" in resp
    if has_input == has_messages:
        raise ProtocolError(
            "missing_field" if not has_input else "invalid_value",
            "give exactly one of response.input (a string or token ids) and response.messages",
            "response.input",
        )
    prompt_input = _input(resp["input"]) if has_input else None
    messages = _messages(resp["messages"]) if has_messages else None
    return CreateResponse(
        event_id=event_id,
        input=prompt_input,
        messages=messages,
        sampling=(parse_sampling(resp, "response.", max_output_tokens) | parse_options(resp, "response.")
                  | parse_logprobs(resp, "response.")),
        metadata=_metadata(resp.get("metadata")),
        constraint=parse_text_format(resp, "response."),
    )


def _parse_cancel(obj: dict, event_id: str | None, max_output_tokens: int) -> CancelResponse:
    _only(obj, ("type", "event_id", "response_id"), "")
    if "response_id" not in obj:
        raise ProtocolError("missing_field", "response.cancel needs 'response_id'", "response_id")
    rid = obj["response_id"]
    if not isinstance(rid, str):
        raise ProtocolError("invalid_type", f"'response_id' must be a string, got {_json_type(rid)}", "response_id")
    return CancelResponse(event_id, rid)


def _parse_update(obj: dict, event_id: str | None, max_output_tokens: int) -> UpdateSession:
    _only(obj, ("type", "event_id", "session"), "")
    sess = _object(obj, "session", "session", required=True)
    _only(sess, ("drafter", "defaults"), "session.")
    drafter = None
    if "drafter" in sess:
        value = sess["drafter"]
        if value is None:
            drafter = "none"
        elif isinstance(value, str) and value:
            drafter = value
        else:
            raise ProtocolError("invalid_type", "session.drafter must be a drafter name, \"none\" or null", "session.drafter")
    defaults: dict[str, Any] = {}
    if "defaults" in sess:
        d = _object(sess, "defaults", "session.defaults", required=True)
        _only(d, (*SAMPLING_FIELDS, *RESPONSE_OPTIONS), "session.defaults.")
        defaults = parse_sampling(d, "session.defaults.", max_output_tokens) | parse_options(d, "session.defaults.")
    return UpdateSession(event_id, drafter, defaults)


_PARSERS = {"response.create": _parse_create, "response.cancel": _parse_cancel, "session.update": _parse_update}

# ---- field validation ---------------------------------------------------------------------------

#: Penalties and bias (specserve/penalties.py), passed to SamplingParams under the same names.
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")
#: Sampling fields a response (or the session defaults) may set, mapped onto SamplingParams.
SAMPLING_FIELDS = ("max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                   *PENALTY_FIELDS)
MAX_LOGIT_BIAS = 1024  # tokens one logit_bias may name (OpenAI allows 300)


#: How a response is delivered rather than sampled: set per response or as a session default.
#: stream_pacing: "off" (each engine step's tokens as they come) | "smooth" (spread over the step, pacing.py).
#: truncation: "disabled" (a prompt too long for the window is an error) | "auto" (the oldest turns of
#: ``messages`` are left out until prompt + max_output_tokens fits; prompts.py).
RESPONSE_OPTIONS = ("stream_pacing", "truncation")
OPTION_VALUES = {"stream_pacing": ("off", "smooth"), "truncation": ("disabled", "auto")}


#: Log-probabilities of the output tokens, per response (as chat completions spell them): ``logprobs``
#: true/false, ``top_logprobs`` 0..20 alternatives per token (given alone, it turns logprobs on).
LOGPROB_FIELDS = ("logprobs", "top_logprobs")


def parse_logprobs(obj: dict, prefix: str) -> dict[str, int]:
    """{"logprobs": k} (SamplingParams.logprobs) when the response asks for log-probabilities, else {}."""
    on = obj.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise ProtocolError("invalid_type", f"{prefix}logprobs must be a boolean (top_logprobs says how many "
                            f"alternatives), got {_json_type(on)}", prefix + "logprobs")
    top = obj.get("top_logprobs")
    if top is not None:
        top = _int(top, prefix + "top_logprobs", 0, MAX_LOGPROBS)
        if on is False:
            raise ProtocolError("invalid_value", f"{prefix}top_logprobs needs logprobs true (or omitted)",
                                prefix + "top_logprobs")
        return {"logprobs": top}
    return {"logprobs": 0} if on else {}


def parse_options(obj: dict, prefix: str) -> dict[str, str]:
    out = {}
    for name in RESPONSE_OPTIONS:
        if name in obj:
            allowed = OPTION_VALUES[name]
            if not isinstance(obj[name], str) or obj[name] not in allowed:
                choices = " or ".join(f'"{v}"' for v in allowed)
                raise ProtocolError("invalid_value", f"{prefix}{name} must be {choices}", prefix + name)
            out[name] = obj[name]
    return out


def parse_sampling(obj: dict, prefix: str, max_output_tokens: int | None) -> dict[str, Any]:
    """Validate the sampling fields present in ``obj``; return them (``stop`` as a tuple).

    max_output_tokens: the largest value that field may take (None: no bound here; the caller checks
    it against the prompt and the window).
    """
    out: dict[str, Any] = {}
    if "max_output_tokens" in obj:
        out["max_output_tokens"] = _int(obj["max_output_tokens"], prefix + "max_output_tokens", 1, max_output_tokens)
    if "temperature" in obj:
        what = f"0 (greedy) or a finite number >= {MIN_TEMPERATURE}"
        value = _number(obj["temperature"], prefix + "temperature", 0.0, None, what)
        if 0 < value < MIN_TEMPERATURE:
            raise ProtocolError("invalid_value", f"{prefix}temperature must be {what}, got {value}", prefix + "temperature")
        out["temperature"] = value
    if "top_p" in obj:
        what = f"a number in [{MIN_TOP_P}, 1]"
        value = _number(obj["top_p"], prefix + "top_p", None, 1.0, what)
        if value < MIN_TOP_P:
            raise ProtocolError("invalid_value", f"{prefix}top_p must be {what}, got {value}", prefix + "top_p")
        out["top_p"] = value
    if "top_k" in obj:
        out["top_k"] = _int(obj["top_k"], prefix + "top_k", 0, MAX_TOP_K, f"an integer in [0, {MAX_TOP_K}] (0 = off)")
    if "min_p" in obj:
        out["min_p"] = _number(obj["min_p"], prefix + "min_p", 0.0, 1.0, "a number in [0, 1]")
    if "seed" in obj:
        out["seed"] = None if obj["seed"] is None else _int(obj["seed"], prefix + "seed", 0, MAX_SEED)
    if "stop" in obj:
        out["stop"] = _stop(obj["stop"], prefix + "stop")
    if "ignore_eos" in obj:
        if not isinstance(obj["ignore_eos"], bool):
            raise ProtocolError("invalid_type", f"{prefix}ignore_eos must be a boolean", prefix + "ignore_eos")
        out["ignore_eos"] = obj["ignore_eos"]
    return out | _penalties(obj, prefix)


def _penalties(obj: dict, prefix: str) -> dict[str, Any]:
    """presence/frequency_penalty in [-2, 2], repetition_penalty > 0, logit_bias {token id: [-100, 100]},
    min_tokens >= 0 (null: the default)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if obj.get(name) is not None:
            out[name] = _number(obj[name], prefix + name, -2.0, 2.0, "a number in [-2, 2]")
    if obj.get("repetition_penalty") is not None:
        value = _number(obj["repetition_penalty"], prefix + "repetition_penalty", 0.0, None, "a number > 0 (1 = off)")
        if value == 0:
            raise ProtocolError("invalid_value", f"{prefix}repetition_penalty must be a number > 0 (1 = off), got 0",
                                prefix + "repetition_penalty")
        out["repetition_penalty"] = value
    if obj.get("min_tokens") is not None:
        out["min_tokens"] = _int(obj["min_tokens"], prefix + "min_tokens", 0, None)
    if obj.get("logit_bias") is not None:
        bias = obj["logit_bias"]
        path = prefix + "logit_bias"
        if not isinstance(bias, dict):
            raise ProtocolError("invalid_type", f"{path} must be an object {{token id: bias}}, got {_json_type(bias)}", path)
        if len(bias) > MAX_LOGIT_BIAS:
            raise ProtocolError("invalid_value", f"{path} may name at most {MAX_LOGIT_BIAS} tokens", path)
        out["logit_bias"] = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit() and len(key) <= 12):
                raise ProtocolError("invalid_value", f"{path} keys must be token ids (decimal integers), got {_short(key)}", path)
            out["logit_bias"][int(key)] = _number(value, f"{path}.{key}", -100.0, 100.0, "a number in [-100, 100]")
    return out


# ---- structured output --------------------------------------------------------------------------

#: Structured output a response may ask for (not session defaults: a schema belongs to one request).
CONSTRAINT_FIELDS = ("text", "json_whitespace")
JSON_WHITESPACE = ("compact", "flexible")
#: ``text.format`` types and the fields each takes (``type`` included).
TEXT_FORMATS: dict[str, tuple[str, ...]] = {
    "text": ("type",),
    "json_schema": ("type", "name", "schema", "strict", "description"),
    "json_object": ("type",),
    "grammar": ("type", "syntax", "definition"),
    "choice": ("type", "choices"),  # a specserve extension: the output is exactly one of these strings
}
GRAMMAR_SYNTAXES = ("lark", "regex")
MAX_GRAMMAR_ERROR_CHARS = 600


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request's output is constrained to, before it is compiled: ``kind`` is a SamplingParams
    field (json_schema | regex | grammar | choice), ``value`` its value, ``param`` the request field it
    came from (named by an ``invalid_grammar`` error when it does not compile)."""

    kind: str
    value: Any
    param: str
    json_whitespace: str = "compact"

    def sampling_kwargs(self) -> dict[str, Any]:
        return {self.kind: self.value, "json_whitespace": self.json_whitespace}


def grammar_error(message: str, param: str | None) -> ProtocolError:
    message = " ".join(message.split())
    if len(message) > MAX_GRAMMAR_ERROR_CHARS:
        message = message[: MAX_GRAMMAR_ERROR_CHARS - 3] + "..."
    return ProtocolError("invalid_grammar", message, param)


def json_schema_spec(obj: dict, path: str, whitespace: str) -> ConstraintSpec:
    """The constraint of an OpenAI json_schema object {name?, description?, strict?, schema} found at
    `path` (the Responses API's text.format, chat completions' response_format.json_schema)."""
    for key, types, what in (("name", str, "a string"), ("description", str, "a string"), ("strict", bool, "a boolean")):
        if obj.get(key) is not None and not isinstance(obj[key], types):
            raise grammar_error(f"{path}.{key} must be {what}", f"{path}.{key}")
    if "schema" not in obj:
        raise grammar_error(f"{path}.schema is required: the JSON schema the output must follow", f"{path}.schema")
    if not isinstance(obj["schema"], dict):
        raise grammar_error(f"{path}.schema must be a JSON schema (an object), got {_json_type(obj['schema'])}",
                            f"{path}.schema")
    return ConstraintSpec("json_schema", obj["schema"], f"{path}.schema", whitespace)


def parse_json_whitespace(obj: dict, path: str) -> str:
    """``json_whitespace`` ("compact", the default, or "flexible") when present in ``obj``."""
    value = obj.get("json_whitespace")
    if value is None:
        return "compact"
    if not isinstance(value, str) or value not in JSON_WHITESPACE:
        raise ProtocolError("invalid_value", f'{path} must be "compact" or "flexible"', path)
    return value


def parse_text_format(resp: dict, prefix: str) -> ConstraintSpec | None:
    """``text: {format: {type, ...}}`` (OpenAI's Responses API) → a ConstraintSpec, or None for plain text.

    Types: ``text`` (no constraint, the default); ``json_schema`` {name?, schema, strict?, description?};
    ``json_object`` (any JSON object); ``grammar`` {syntax: "lark" (the default) | "regex", definition};
    ``choice`` {choices: [strings]} (ours). Anything wrong in ``text`` is ``invalid_grammar``; whether the
    schema or grammar compiles is checked when the request's SamplingParams are made (submit.make_params).
    """
    whitespace = parse_json_whitespace(resp, prefix + "json_whitespace")
    text = resp.get("text")
    path = prefix + "text"
    if text is None:
        return None
    if not isinstance(text, dict):
        raise grammar_error(f"{path} must be an object {{format: {{type, ...}}}}, got {_json_type(text)}", path)
    for key in text:
        if key != "format":
            raise grammar_error(f"unknown field {path}.{key[:64]}; allowed: format", f"{path}.{key[:64]}")
    fmt = text.get("format")
    path += ".format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise grammar_error(f"{path} must be an object {{type, ...}}, got {_json_type(fmt)}", path)
    kind = fmt.get("type")
    if not isinstance(kind, str) or kind not in TEXT_FORMATS:
        raise grammar_error(f"{path}.type must be one of {', '.join(TEXT_FORMATS)}", f"{path}.type")
    for key in fmt:
        if key not in TEXT_FORMATS[kind]:
            raise grammar_error(f"unknown field {path}.{key[:64]} for type {kind!r}; allowed: {', '.join(TEXT_FORMATS[kind])}",
                                f"{path}.{key[:64]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_schema", {"type": "object"}, path, whitespace)
    if kind == "json_schema":
        return json_schema_spec(fmt, path, whitespace)
    if kind == "grammar":
        syntax = fmt.get("syntax", "lark")
        if not isinstance(syntax, str) or syntax not in GRAMMAR_SYNTAXES:
            raise grammar_error(f'{path}.syntax must be "lark" or "regex"', f"{path}.syntax")
        definition = fmt.get("definition")
        if not isinstance(definition, str) or not definition:
            raise grammar_error(f"{path}.definition must be a non-empty string (the {syntax} source)", f"{path}.definition")
        return ConstraintSpec("grammar" if syntax == "lark" else "regex", definition, f"{path}.definition")
    choices = fmt.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise grammar_error(f"{path}.choices must be a non-empty list of non-empty strings", f"{path}.choices")
    return ConstraintSpec("choice", list(choices), f"{path}.choices")


def _only(obj: dict, allowed, prefix: str) -> None:
    for key in obj:
        if key not in allowed:
            shown = key if len(key) <= 64 else key[:64] + "..."
            raise ProtocolError("unknown_field", f"unknown field {prefix}{shown}; allowed: {', '.join(allowed)}", prefix + shown)


def _object(obj: dict, key: str, path: str, required: bool) -> dict:
    if key not in obj:
        if required:
            raise ProtocolError("missing_field", f"missing field {path} (an object)", path)
        return {}
    value = obj[key]
    if not isinstance(value, dict):
        raise ProtocolError("invalid_type", f"{path} must be an object, got {_json_type(value)}", path)
    return value


def _int(value: Any, path: str, lo: int | None, hi: int | None, what: str | None = None) -> int:
    if what is None:
        what = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError("invalid_type", f"{path} must be {what}, got {_json_type(value)}", path)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ProtocolError("invalid_value", f"{path} must be {what}, got {_short(value)}", path)
    return value


def _number(value: Any, path: str, lo: float | None, hi: float | None, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError("invalid_type", f"{path} must be {what}, got {_json_type(value)}", path)
    try:
        value = float(value)
    except OverflowError:  # a huge JSON integer
        raise ProtocolError("invalid_value", f"{path} must be {what}, got a number too large", path) from None
    if not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ProtocolError("invalid_value", f"{path} must be {what}, got {value}", path)
    return value


def _stop(value: Any, path: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ProtocolError("invalid_type", f"{path} must be a string or a list of strings", path)
    if len(items) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in items):
        raise ProtocolError(
            "invalid_value", f"{path} takes at most {MAX_STOP_STRINGS} strings of 1..{MAX_STOP_CHARS} characters", path
        )
    return tuple(items)


def _input(value: Any) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise ProtocolError("invalid_value", "response.input is empty", "response.input")
        return value
    if isinstance(value, list):
        if not value:
            raise ProtocolError("invalid_value", "response.input is empty", "response.input")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ProtocolError("invalid_type", "response.input must be a string or a list of token ids (integers)", "response.input")
        return list(value)
    raise ProtocolError(
        "invalid_type", f"response.input must be a string or a list of token ids, got {_json_type(value)}", "response.input"
    )


def _messages(value: Any) -> list[dict]:
    path = "response.messages"
    if not isinstance(value, list):
        raise ProtocolError("invalid_type", f"{path} must be a list of {{role, content}} objects", path)
    if not 0 < len(value) <= MAX_MESSAGES:
        raise ProtocolError("invalid_value", f"{path} must hold 1..{MAX_MESSAGES} messages", path)
    out = []
    for i, msg in enumerate(value):
        here = f"{path}[{i}]"
        if not isinstance(msg, dict):
            raise ProtocolError("invalid_type", f"{here} must be an object with role and content", here)
        _only(msg, ("role", "content"), here + ".")
        role, content = msg.get("role"), msg.get("content")
        if role is None or content is None:
            missing = "role" if role is None else "content"
            raise ProtocolError("missing_field", f"{here} has no {missing}", f"{here}.{missing}")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            raise ProtocolError("invalid_value", f"{here}.role must be one of {', '.join(MESSAGE_ROLES)}", f"{here}.role")
        if not isinstance(content, str):
            raise ProtocolError("invalid_type", f"{here}.content must be a string", f"{here}.content")
        out.append({"role": role, "content": content})
    return out


def _metadata(value: Any) -> dict[str, str]:
    path = "response.metadata"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError("invalid_type", f"{path} must be an object of string values", path)
    if len(value) > MAX_METADATA_KEYS:
        raise ProtocolError("invalid_value", f"{path} takes at most {MAX_METADATA_KEYS} keys", path)
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ProtocolError("invalid_value", f"{path} keys have at most {MAX_METADATA_KEY_CHARS} characters", path)
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise ProtocolError(
                "invalid_value", f"{path} values must be strings of at most {MAX_METADATA_VALUE_CHARS} characters", path
            )
    return dict(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


# ---- server events ------------------------------------------------------------------------------


def dumps(event: dict) -> str:
    """Compact JSON for the wire (non-ASCII kept as UTF-8)."""
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


def error_event(err: ProtocolError) -> dict:
    event: dict = {"type": "error"}
    if err.event_id is not None:
        event["event_id"] = err.event_id
    event["error"] = err.to_error()
    return event


def with_event_id(event: dict, event_id: str | None) -> dict:
    if event_id is not None:
        event["event_id"] = event_id
    return event


def delta_event(response_id: str, text: str, num_tokens: int, logprobs: list | None = None) -> dict:
    """``tokens``: how many output tokens this delta carries (several after a multi-token verify step);
    ``logprobs`` (when the response asked): one ``{token, logprob, bytes, top_logprobs}`` per token."""
    event = {"type": "response.output_text.delta", "response_id": response_id, "delta": text, "tokens": num_tokens}
    if logprobs is not None:
        event["logprobs"] = logprobs
    return event
