"""One choice of an OpenAI response (index i of n): its stream chunks and its whole form — text, echo,
log-probabilities (openai_logprobs.py) and tool calls (tool_calls.py).

Tool calls stream in OpenAI's delta shape: for a named function the output is the arguments, so the
first piece opens the call (``{index, id, type, function: {name, arguments: ""}}``) and every piece
after appends ``function.arguments``; for "required" each call opens once its name is complete and its
arguments stream as they are generated (tool_calls.RequiredStream); for "auto" the calls are known once
the output is complete, and go out then (one delta per call). Content is never streamed for a
constrained call; for "auto" it is held back and sent as content at the end when the output holds no
tool call.
"""

from __future__ import annotations

from specserve.server.openai_logprobs import CompletionLogprobs, TokenTexts, chat_logprobs, merge_completion
from specserve.server.tool_calls import RequiredStream, tool_call


class ChoiceWriter:
    def __init__(self, index: int, req, shapes, texts: TokenTexts, prompt_ids: list[int], prompt_text: str) -> None:
        self.index, self.req, self.shapes, self.texts = index, req, shapes, texts
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text
        self.completion = CompletionLogprobs(texts)
        self.tools = req.tools if req.tools is not None and req.tools.mode != "none" else None
        self.text: list[str] = []
        self.entries: list = []
        self.prompt_entries: list | None = None
        self.call_open = False
        self.required: RequiredStream | None = None  # of a streamed "required" choice, from its first text

    # ---- pieces ---------------------------------------------------------------------------------

    def _logprobs(self, entries, prompt: bool = False) -> dict | None:
        if self.req.logprobs is None:
            return None
        if self.shapes.chat:
            return chat_logprobs(entries, self.texts)
        return self.completion.piece(entries, self.prompt_ids if prompt else None)

    def echo_piece(self, prompt_entries) -> str | None:
        """Completions with echo: the prompt's text (and log-probabilities) as the first piece."""
        if self.shapes.chat or not self.req.echo:
            return None
        self.prompt_entries = list(prompt_entries) if prompt_entries is not None else None
        logprobs = self._logprobs(self.prompt_entries, prompt=True) if self.prompt_entries is not None else None
        return self.shapes.chunk(text=self.prompt_text, index=self.index, logprobs=logprobs)

    def add(self, text: str, entries) -> None:
        """Keep new output text and its tokens' log-probabilities (for the whole response / the end)."""
        self.text.append(text)
        self.entries.extend(entries)

    def piece(self, text: str, entries, usage: dict | None = None) -> str | None:
        """A stream chunk for new output text and its tokens' log-probabilities (None: nothing to send);
        `usage` (continuous usage stats) rides on it."""
        if self.tools is not None:  # only tool calls read the whole output back (a streamed text is sent as it comes)
            self.add(text, entries)
            return self._tool_piece(text, usage)
        if not text and not entries and usage is None:
            return None
        if self.req.logprobs is None and self.index == 0 and usage is None:
            return self.shapes.text_chunk(text)
        return self.shapes.chunk(text=text, index=self.index, logprobs=self._logprobs(entries), usage=usage)

    def _tool_piece(self, text: str, usage: dict | None) -> str | None:
        if self.tools.mode == "required" and text:
            self.required = self.required or RequiredStream()
            deltas = self.required.feed(text)
            return self.shapes.chunk(tool_calls=deltas, index=self.index, usage=usage) if deltas else None
        if self.tools.mode != "named" or not text:
            return None
        delta: dict = {"index": 0, "function": {"arguments": text}}
        if not self.call_open:
            self.call_open = True
            delta = {"index": 0, **tool_call(self.tools.name, text)}
        return self.shapes.chunk(tool_calls=[delta], index=self.index, usage=usage)

    def finish(self, reason: str, leftover) -> tuple[list[str], str]:
        """Chunks still owed at the end (leftover log-probabilities, held-back tool calls or content) and
        the finish reason to report."""
        out = []
        if self.tools is not None:
            self.entries.extend(leftover)
            calls = self._calls(reason)
            if calls is not None:
                # A named call and a "required" one streamed as generated went out with the text; the
                # others go out now, one delta per call.
                if self.tools.mode == "auto" or (self.tools.mode == "required" and self.required is None):
                    deltas = [{"index": j, **c} for j, c in enumerate(calls)]
                    out.append(self.shapes.chunk(tool_calls=deltas, index=self.index))
                return out, "tool_calls"
            if self.tools.mode == "auto" and self.text:
                out.append(self.shapes.chunk(text="".join(self.text), index=self.index, logprobs=self._logprobs(self.entries)))
                return out, reason
        if leftover and self.req.logprobs is not None:
            out.append(self.shapes.chunk(text="", index=self.index, logprobs=self._logprobs(leftover)))
        return out, reason

    def _calls(self, reason: str) -> list[dict] | None:
        if self.tools is None or (self.tools.constrained and reason != "stop"):
            return None  # cut off by max_tokens: not a complete call
        return self.tools.calls("".join(self.text))

    # ---- whole ----------------------------------------------------------------------------------

    def whole(self, reason: str) -> dict:
        text = "".join(self.text)
        calls = self._calls(reason)
        if calls is not None:
            return self.shapes.choice(self.index, text, "tool_calls", self._logprobs(self.entries), calls)
        if self.shapes.chat:
            return self.shapes.choice(self.index, text, reason, self._logprobs(self.entries))
        logprobs = None
        if self.req.logprobs is not None:
            parts = [self.completion.piece(self.prompt_entries, self.prompt_ids)] if self.prompt_entries else []
            logprobs = merge_completion(parts + [self.completion.piece(self.entries)])
        return self.shapes.choice(self.index, (self.prompt_text if self.req.echo else "") + text, reason, logprobs)
