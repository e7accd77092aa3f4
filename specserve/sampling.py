"""Sampling parameters and the target-distribution transform (temperature, top-k, top-p, min-p).

The same transform feeds prefill sampling, the bonus token and stochastic verification, so the
distribution speculation must reproduce is defined in exactly one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve import defaults


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction (ValueError naming the field).

    The defaults live in specserve/defaults.py, shared with the CLI, the HTTP API and the server.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k:       keep the k most likely tokens; 0 (or -1) keeps all.
    top_p:       keep the smallest set of most likely tokens whose mass reaches top_p; 1 keeps all.
    min_p:       drop tokens less likely than min_p × the most likely token's probability.
    max_tokens:  most tokens to generate; None (the default) means the rest of the context window.
                 A prompt plus max_tokens past the context window is an error when the request is added.
    stop:        strings that end generation; the stop string itself is not returned.
    seed:        per-request seed: the same seed, prompt, drafter and draft budgets reproduce the same
                 output (greedy or sampled, whatever else shares the batch). Every seeded run is an exact
                 draw from the target, but which draw depends on the draft trees it was verified against:
                 with speculation="adaptive" budgets follow measured timings, so only plain decoding and
                 speculation="static" reproduce a sample exactly.
    ignore_eos:  keep generating past end-of-sequence tokens (benchmarks).

    Structured output — at most one of (checked here; ValueError naming the problem):
    json_schema: a JSON schema (dict or JSON text): the output is one JSON value valid against it.
    regex:       the output matches the regular expression (Rust `regex` syntax), whole.
    grammar:     a Lark grammar (llguidance's dialect) the output must derive from ``start``.
    choice:      the output is exactly one of these strings.
    json_whitespace: "compact" (", " and ": " separators, no other whitespace; the default) or
                 "flexible" (any JSON whitespace between tokens).
    A constrained request finishes with "stop" when its grammar is complete and admits no more
    tokens (or the model ends it where the grammar allows), and with "length" when max_tokens cuts
    it off inside the structure: that output is incomplete.
    """

    temperature: float = defaults.TEMPERATURE
    top_p: float = defaults.TOP_P
    top_k: int = defaults.TOP_K
    min_p: float = defaults.MIN_P
    max_tokens: int | None = defaults.MAX_TOKENS
    stop: tuple[str, ...] = defaults.STOP
    seed: int | None = defaults.SEED
    ignore_eos: bool = defaults.IGNORE_EOS
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    json_whitespace: str = "compact"
    constraint: Any = field(init=False, default=None, repr=False, compare=False)  # grammar.Constraint | None

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
            return float(value)

        if number("temperature") < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= number("min_p") <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1 or None (the rest of the context), "
                             f"got {self.max_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        given = [kind for kind in ("json_schema", "regex", "grammar", "choice") if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(f"SamplingParams takes at most one of json_schema, regex, grammar and choice; got {', '.join(given)}")
        if given:
            from specserve.grammar.constraint import Constraint

            value = getattr(self, given[0])
            if given[0] == "choice" and isinstance(value, list):
                object.__setattr__(self, "choice", tuple(value))
            object.__setattr__(self, "constraint", Constraint.build(given[0], value, self.json_whitespace))
        elif self.json_whitespace not in ("compact", "flexible"):
            raise ValueError(f"SamplingParams.json_whitespace must be 'compact' or 'flexible', got {self.json_whitespace!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The target distribution each row is sampled or verified against.

    logits [M, V] (fp32); temperature [M] (> 0), top_k [M] int (0 = off), top_p [M], min_p [M].
    Returns probs [M, V] summing to 1 per row. Order: temperature, then top-k, top-p, min-p, each on
    the distribution left by the previous filter, then renormalise.
    """
    # Shift by the row max first: the top logit becomes 0, so a tiny temperature sends the others
    # to -inf (probability 0) instead of overflowing to inf - inf = NaN.
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    temperature = temperature.clamp_min(torch.finfo(logits.dtype).tiny)  # 1e-308 is 0 in fp32
    probs = torch.softmax(shifted / temperature[:, None], dim=-1)
    needs_sort = bool((top_k > 0).any() or (top_p < 1).any())
    if needs_sort:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        keep_sorted = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        sorted_probs = sorted_probs * keep_sorted
        # top-p on the top-k survivors: keep a token if the mass strictly before it is < top_p.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        total = sorted_probs.sum(-1, keepdim=True)
        keep_sorted &= mass_before < top_p[:, None] * total
        keep_sorted[:, 0] = True  # the most likely token always survives (top_p may round to 0)
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = probs * keep
    if bool((min_p > 0).any()):
        peak = probs.max(dim=-1, keepdim=True).values
        probs = probs * (probs >= min_p[:, None] * peak)
    return probs / probs.sum(dim=-1, keepdim=True)
