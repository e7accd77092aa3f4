"""Whether a tokenizer can render chat messages itself (the server's prompts and the eval's turns)."""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    """True when ``tokenizer`` is a transformers tokenizer with a chat template set."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")
