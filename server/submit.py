"""The way every request takes to the engine, shared by the websocket sessions and the HTTP API.

sampling fields → ``SamplingParams`` (:func:`make_params`); input or messages → token ids fitted to
the context (:func:`prepare`, on the event loop for short texts, on the server's tokenizer thread for
long ones so no other stream stalls); and, once it ends, the one status word that the metrics and the
request log use (:func:`final_status`). The server's ``check_capacity``/``submit``/``finish`` do the
rest (app.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

from specserve.sampling import SamplingParams
from specserve.server.prompts import WEBSOCKET_NAMES, FieldNames, Prompt, prepare_prompt
from specserve.server.protocol import PENALTY_FIELDS, ConstraintSpec, ProtocolError, grammar_error

#: Texts up to this many characters are tokenized inline (well under a millisecond); longer ones on
#: the server's tokenizer thread.
INLINE_TOKENIZE_CHARS = 16384


def text_chars(input_, messages) -> int:
    if isinstance(input_, str):
        return len(input_)
    return sum(len(m["content"]) for m in messages or ())


def needs_thread(input_, messages, params: SamplingParams | None = None, server=None) -> bool:
    """Whether preparing a request takes long enough to do off the event loop: a long text to tokenize,
    or a constraint not compiled yet (a new big schema takes up to a second; a cached one nothing — it
    must not queue behind others' compiles on the one worker thread)."""
    if text_chars(input_, messages) > INLINE_TOKENIZE_CHARS:
        return True
    if params is None or params.constraint is None:
        return False
    return server is None or not server.llm.constraints.compiled(params.constraint)


def prepare_now(server, input_, messages, params: SamplingParams, policy: str, names: FieldNames = WEBSOCKET_NAMES,
                constraint: ConstraintSpec | None = None) -> Prompt:
    """Compile the request's constraint into the engine's cache (so the engine thread never stalls every
    stream compiling it) and tokenize + fit its prompt. Blocking: call it off the loop when `needs_thread`."""
    if params.constraint is not None:
        try:
            server.llm.constraints.compile(params.constraint)
        except ValueError as exc:
            raise constraint_refusal(str(exc), constraint) from None
    return prepare_prompt(server.llm, server.context_length, input_, messages, params.max_tokens, policy, names)


def make_params(s: dict, constraint: ConstraintSpec | None = None) -> SamplingParams:
    """``s``: sampling fields as the websocket protocol names them (max_output_tokens None = the rest);
    ``constraint``: structured output, compiled (validated by llguidance) here — one that does not is
    ``invalid_grammar`` naming the field it came from."""
    try:
        return SamplingParams(
            temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], min_p=s["min_p"],
            max_tokens=s.get("max_output_tokens"), stop=tuple(s["stop"]), seed=s["seed"], ignore_eos=s["ignore_eos"],
            **{name: s[name] for name in PENALTY_FIELDS if s.get(name) is not None},
            **({"logprobs": s["logprobs"]} if s.get("logprobs") is not None else {}),
            **({"prompt_logprobs": s["prompt_logprobs"]} if s.get("prompt_logprobs") is not None else {}),
            **(constraint.sampling_kwargs() if constraint is not None else {}),
        )
    except ValueError as exc:
        # SamplingParams names its own fields ("SamplingParams.top_p ..."), all validated already (a backstop);
        # anything else comes from the constraint.
        if constraint is not None and not str(exc).startswith("SamplingParams"):
            raise grammar_error(str(exc), constraint.param) from None
        raise ProtocolError("invalid_value", str(exc)) from None


def refusal(summary, constraint: ConstraintSpec | None = None) -> ProtocolError:
    """The error for a request the engine refused (``add_request`` raised): ``invalid_grammar`` when its
    constraint does not compile for this model's tokenizer, ``tokenizer_unavailable`` when the model has
    none, else ``request_rejected``."""
    return constraint_refusal(summary.error or "the engine refused the request", constraint)


def constraint_refusal(message: str, constraint: ConstraintSpec | None) -> ProtocolError:
    """`refusal` of an engine message (add_request's or the constraint compiler's ValueError)."""
    if constraint is not None and message.startswith("invalid "):
        return grammar_error(message, constraint.param)
    if constraint is not None and message.startswith("constrained output"):
        return ProtocolError("tokenizer_unavailable", message, constraint.param)
    return ProtocolError("request_rejected", message)


def engine_failure(summary, constraint: ConstraintSpec | None = None) -> ProtocolError:
    """The error for a request that ended with reason "error". A constraint whose matcher gave up part-way
    (found by the websocket fuzzer: 'start: "a"{99999}' passes llguidance's work limit after one token)
    is the client's ``invalid_grammar``, naming the field; only the engine's own failures are
    ``internal_error`` (a server error, HTTP 500)."""
    message = summary.error or "the engine failed"
    if constraint is not None and summary.constraint_failed:
        return grammar_error(message, constraint.param)
    return ProtocolError("internal_error", message)


def fitted(params: SamplingParams, prompt: Prompt) -> SamplingParams:
    """``params`` with max_tokens set to what fits the window (the engine refuses anything past it)."""
    return params if params.max_tokens == prompt.max_tokens else dataclasses.replace(params, max_tokens=prompt.max_tokens)


async def prepare(server, input_, messages, params: SamplingParams, policy: str, names: FieldNames = WEBSOCKET_NAMES,
                  constraint: ConstraintSpec | None = None) -> Prompt:
    """`prepare_now`, off the event loop when it may take a while (`needs_thread`)."""
    args = (server, input_, messages, params, policy, names, constraint)
    if not needs_thread(input_, messages, params, server):
        return prepare_now(*args)
    return await asyncio.get_running_loop().run_in_executor(server.tokenize_executor, prepare_now, *args)


def final_status(summary, failed: bool = False) -> str:
    """completed | length | cancelled | failed (see metrics.py) for an engine Summary."""
    if failed or summary.reason in ("rejected", "error"):
        return "failed"
    return {"stop": "completed", "length": "length"}.get(summary.reason, "cancelled")
