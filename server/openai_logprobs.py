"""Log-probabilities in OpenAI's two shapes (the values come from the engine: verify/logprobs.py).

Chat (`logprobs: true`, `top_logprobs: k`): ``{"content": [{token, logprob, bytes, top_logprobs:
[{token, logprob, bytes}]}]}``, one entry per generated token — per chunk when streaming.
Completions (`logprobs: k`, with `echo` the prompt's too): the legacy ``{tokens, token_logprobs,
top_logprobs: [{text: logprob}], text_offset}``; the prompt's first token has no log-probability (null).

A token's text is the tokenizer's decode of that token alone (cached per id: the same ids recur);
text_offset counts those texts' characters from the start of the returned text.
"""

from __future__ import annotations


class TokenTexts:
    """token id -> its text, decoded alone, cached (bounded by the vocabulary)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self.tokenizer.decode([token]) if self.tokenizer is not None else f"<{token}>"
            self._cache[token] = text
        return text


def _entry(texts: TokenTexts, token: int, logprob: float) -> dict:
    text = texts(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries, texts: TokenTexts) -> dict:
    """OpenAI chat `choices[i].logprobs` for TokenLogprob entries."""
    return {"content": [{**_entry(texts, e.token, e.logprob),
                         "top_logprobs": [_entry(texts, t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


class CompletionLogprobs:
    """Builds the legacy completions `logprobs` object piece by piece (a stream's chunks), keeping the
    running text_offset across pieces."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def piece(self, entries, prompt_ids: list[int] | None = None) -> dict:
        """entries: TokenLogprob or None (the prompt's first token: `prompt_ids[0]`), in order."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, e in enumerate(entries):
            token = e.token if e is not None else prompt_ids[i]
            text = self.texts(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob if e is not None else None)
            out["top_logprobs"].append(self._top(e.top) if e is not None else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


    def _top(self, top) -> dict[str, float]:
        """{text: logprob}, most likely first; tokens that decode alike keep the likelier one's value."""
        out: dict[str, float] = {}
        for token, logprob in top:
            out.setdefault(self.texts(token), logprob)
        return out


def merge_completion(parts: list[dict]) -> dict:
    """One legacy logprobs object from consecutive pieces."""
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                       "text_offset")}
