"""Turn a response's ``input`` or ``messages`` into prompt token ids.

Messages go through the tokenizer's chat template when it has one. Without one (base models, our
tiny test models) they are concatenated as plain text, one ``role: content`` line per message,
ending with ``assistant:`` so the model continues as the assistant — see :func:`messages_to_text`.
"""

from __future__ import annotations

from specserve.chat_template import has_chat_template
from specserve.server.protocol import ProtocolError


def messages_to_text(tokenizer, messages: list[dict]) -> tuple[str, bool]:
    """The prompt text for ``messages`` and whether the tokenizer should add its special tokens.

    A chat template renders its own special tokens (BOS and the role markers), so its text is
    encoded without adding them again; the plain fallback is encoded like any text prompt.
    """
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, False
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return text, True


def prompt_ids(llm, input_: str | list[int] | None, messages: list[dict] | None) -> list[int]:
    """Token ids for one response; raises ProtocolError naming what is wrong."""
    tokenizer = llm.tokenizer
    vocab = llm.model.config.vocab_size
    if isinstance(input_, list):
        bad = [t for t in input_ if not 0 <= t < vocab]
        if bad:
            raise ProtocolError(
                "invalid_value", f"response.input token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "response.input"
            )
        return list(input_)
    if tokenizer is None:
        param = "response.input" if input_ is not None else "response.messages"
        raise ProtocolError(
            "tokenizer_unavailable", "this model has no tokenizer: give response.input as a list of token ids", param
        )
    if input_ is not None:
        return list(tokenizer.encode(input_, add_special_tokens=True))  # exactly what LLM.encode does
    text, add_special = messages_to_text(tokenizer, messages or [])
    ids = list(tokenizer.encode(text, add_special_tokens=add_special))
    if not ids:
        raise ProtocolError("invalid_value", "response.messages render to an empty prompt", "response.messages")
    return ids
