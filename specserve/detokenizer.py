"""Incremental, UTF-8-safe detokenization with stop strings.

Text is released only when it is final: a token sequence that ends inside a multi-byte character is
held back until the next token completes it, and when stop strings are set the last
`max(len(stop)) - 1` characters are held back so a stop string is never half-streamed.

Fast tokenizers decode through the tokenizers library's own streaming decoder (`DecodeStream`, ~3 us a
token, primed with the prompt's last tokens so SentencePiece's leading-space rule sees the right
context); other tokenizers through two `decode` calls per token (prefix and prefix + new).
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded along with the output, so tokenizers that drop a leading space on the first
# token of a decode (SentencePiece) still produce the right first delta.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
            for token in prompt_ids[-_CONTEXT_TOKENS:]:
                self._stream.step(self._backend, token)
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # every finalised character of the output (stop string excluded once found)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0  # characters of `text` already handed out as deltas
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Append one output token; return True if a stop string completed (text is cut before it)."""
        if self.tokenizer is None:
            return False
        if self._stream is not None:
            new = self._stream.step(self._backend, token_id)
            if not new:
                return False
        else:
            self.ids.append(token_id)
            decode = self.tokenizer.decode
            prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
            full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return False
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += new
        for s in self.stop:
            hit = self.text.find(s, start)
            if hit != -1:
                self.text = self.text[:hit]
                self.stopped = True
                return True
        return False

    def flush(self) -> None:
        """The request ended: finalise any bytes held back waiting for a character to complete (the
        streaming decoder keeps them until a token completes the character: an incomplete one is
        dropped, as a final decode would turn it into U+FFFD)."""
        if self.tokenizer is None or self.stopped or self._stream is not None or self.read_offset == len(self.ids):
            return
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        self.text += full[len(prefix) :]
        self.read_offset = len(self.ids)

    def take_delta(self, final: bool) -> str:
        """Text finalised since the last call (all of it when `final`)."""
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
