"""Turn a request's ``input`` (text or token ids) or ``messages`` into prompt token ids, fitted to the
context window.

Messages go through the tokenizer's chat template when it has one. Without one (base models, our
tiny test models) they are concatenated as plain text, one ``role: content`` line per message,
ending with ``assistant:`` so the model continues as the assistant — see :func:`messages_to_text`.

Fitting (:func:`prepare_prompt`), by policy:

- ``"clamp"`` (websocket): the output is cut at the context end (``max_output_tokens`` clamped).
- ``"error"`` (OpenAI HTTP): an omitted max_tokens is the rest of the context; a prompt plus an
  explicit max_tokens past the window is an error naming both numbers, as OpenAI answers.
- ``"auto"`` (chats: ``truncation: "auto"``): the oldest turns are dropped — never system messages,
  never the last message — until prompt + max_output_tokens fits; if even the newest turn alone
  leaves less room, max_output_tokens is clamped to what remains.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.chat_template import has_chat_template
from specserve.server.protocol import ProtocolError

POLICIES = ("clamp", "error", "auto")


@dataclass(frozen=True)
class FieldNames:
    """How the request's fields are named in error messages' ``param`` (websocket vs HTTP)."""

    input: str = "response.input"
    messages: str = "response.messages"
    max_tokens: str = "response.max_output_tokens"


WEBSOCKET_NAMES = FieldNames()


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    max_tokens: int  # what the engine will be asked for: fits the window
    dropped_messages: int = 0  # oldest turns left out to fit (policy "auto")


def messages_to_text(tokenizer, messages: list[dict]) -> tuple[str, bool]:
    """The prompt text for ``messages`` and whether the tokenizer should add its special tokens.

    A chat template renders its own special tokens (BOS and the role markers), so its text is
    encoded without adding them again; the plain fallback is encoded like any text prompt.
    """
    tools = getattr(messages, "tools", None)  # a ToolMessages list carries the chat's tools (tool_calls.py)
    if has_chat_template(tokenizer):
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return text, False
    head = f"tools: {_signatures(tools)}\n" if tools else ""
    text = head + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return text, True


def _signatures(tools: list[dict]) -> str:
    """Tools as short signatures, ``name(arg, ...)``, for a model without a chat template (its context
    is often small; a template shows the whole schemas)."""
    return ", ".join(f"{t['function']['name']}({', '.join((t['function'].get('parameters') or {}).get('properties', {}))})"
                     for t in tools)


class ToolMessages(list):
    """A chat's messages with the tools the model is shown (`tools=` of apply_chat_template)."""

    tools: list[dict] | None = None


def prompt_ids(llm, input_: str | list[int] | None, messages: list[dict] | None,
               names: FieldNames = WEBSOCKET_NAMES) -> list[int]:
    """Token ids for one request; raises ProtocolError naming what is wrong."""
    tokenizer = llm.tokenizer
    vocab = llm.model.config.vocab_size
    if isinstance(input_, list):
        bad = [t for t in input_ if not 0 <= t < vocab]
        if bad:
            raise ProtocolError(
                "invalid_value", f"{names.input} token ids {bad[:5]} are outside the vocabulary [0, {vocab})", names.input
            )
        return list(input_)
    if tokenizer is None:
        param = names.input if input_ is not None else names.messages
        raise ProtocolError(
            "tokenizer_unavailable", f"this model has no tokenizer: give {names.input} as a list of token ids", param
        )
    if input_ is not None:
        return list(tokenizer.encode(input_, add_special_tokens=True))  # exactly what LLM.encode does
    text, add_special = messages_to_text(tokenizer, messages or [])
    ids = list(tokenizer.encode(text, add_special_tokens=add_special))
    if not ids:
        raise ProtocolError("invalid_value", f"{names.messages} render to an empty prompt", names.messages)
    return ids


def prepare_prompt(llm, context: int, input_, messages, max_tokens: int | None, policy: str,
                   names: FieldNames = WEBSOCKET_NAMES) -> Prompt:
    """Tokenize and fit to the ``context`` window (see the module doc for the policies)."""
    assert policy in POLICIES, policy
    ids = prompt_ids(llm, input_, messages, names)
    dropped = 0
    if policy == "auto" and messages is not None and max_tokens is not None and len(ids) + max_tokens > context:
        ids, dropped = _drop_oldest_turns(llm, messages, ids, context - max_tokens, names)
    prompt_param = names.input if input_ is not None else names.messages
    if len(ids) >= context:
        what = "the prompt" if not dropped else f"the newest turn (after leaving out {dropped} older messages)"
        raise ProtocolError(
            "context_length_exceeded",
            f"{what} has {len(ids)} tokens but the context window is {context}: leave room for at least one output token",
            prompt_param,
        )
    room = context - len(ids)
    if max_tokens is None:
        return Prompt(ids, room, dropped)
    if max_tokens > room and policy == "error":
        raise ProtocolError(
            "context_length_exceeded",
            f"the prompt has {len(ids)} tokens and {names.max_tokens} is {max_tokens}: together {len(ids) + max_tokens} "
            f"tokens, but the context window is {context}; ask for at most {room} (or leave {names.max_tokens} unset "
            "for the rest of the context)",
            names.max_tokens,
        )
    return Prompt(ids, min(max_tokens, room), dropped)


def _drop_oldest_turns(llm, messages: list[dict], ids: list[int], budget: int, names: FieldNames) -> tuple[list[int], int]:
    """The prompt with the fewest oldest turns left out that fits ``budget`` tokens (or the newest turn
    alone, if nothing fits); and how many messages were left out.

    A conversation is cut only before a user message (so it never resumes with a reply whose question
    is gone), keeping every system message and the last message. Prompt length only shrinks as more
    turns go, so the cut is found by bisection: O(log turns) tokenizations.
    """
    body = [i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")]
    cuts = [k for k in range(1, len(body)) if messages[body[k]]["role"] == "user"]
    if not body or not cuts:
        last_user = len(body) - 1
        cuts = [last_user] if last_user > 0 else []
    if not cuts:
        return ids, 0

    def render(cut: int) -> list[int]:
        gone = set(body[:cut])
        return prompt_ids(llm, None, [m for i, m in enumerate(messages) if i not in gone], names)

    lo, hi = 0, len(cuts) - 1
    best = render(cuts[hi])
    if len(best) > budget:  # even the newest turn alone is too long: keep just it, clamp the output
        return best, cuts[hi]
    best_cut = cuts[hi]
    while lo < hi:  # the smallest cut index whose prompt fits
        mid = (lo + hi) // 2
        trial = render(cuts[mid])
        if len(trial) <= budget:
            best, best_cut, hi = trial, cuts[mid], mid
        else:
            lo = mid + 1
    return best, best_cut
