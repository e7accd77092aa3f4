"""Sampling parameters and the target-distribution transform (temperature, top-k, top-p, min-p).

The same transform feeds prefill sampling, the bonus token and stochastic verification, so the
distribution speculation must reproduce is defined in exactly one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
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

    Penalties and bias (specserve/penalties.py; applied to the logits in this order, before
    temperature and the filters, on every verify row with the counts of that row's own path):
    repetition_penalty: > 0, 1 = off (transformers'/vLLM's): a token seen in the prompt or the output
                 has a positive logit divided by it, a negative one multiplied.
    frequency_penalty, presence_penalty: in [-2, 2], 0 = off (OpenAI's): logit -= frequency_penalty ×
                 count + presence_penalty × (count > 0), counts over the generated tokens only.
    logit_bias:  {token id: bias in [-100, 100]} added to the logits (-100 all but bans a token).
    min_tokens:  end-of-sequence tokens are banned until this many tokens were generated.

    Log-probabilities (the target's own, before penalties, temperature and filters: vLLM's "raw"):
    logprobs:    None (off) or k in [0, 20]: each output token's log-probability and the k most likely
                 tokens' at its position (RequestOutput.logprobs).
    prompt_logprobs: None or k in [0, 20]: the same for every prompt token but the first
                 (RequestOutput.prompt_logprobs; the first entry is None).

    Target features:
    return_hidden_states: the target's hidden states at the engine's capture layers (`LLM(...,
                 capture_layers=...)`) for every token whose row the forward ran — the prompt's and the
                 output's but the last (RequestOutput.hidden_states), taken from the rows decoding computes
                 anyway, speculative steps included. The whole prompt is prefilled (no prefix-cache reuse).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_hidden_states: bool = False
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
        for name in ("ignore_eos", "return_hidden_states"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")
        self._check_penalties(number)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= defaults.MAX_LOGPROBS):
                raise ValueError(f"SamplingParams.{name} must be None or an integer in [0, {defaults.MAX_LOGPROBS}], got {value!r}")
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

    def _check_penalties(self, number) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not number("repetition_penalty") > 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got {type(self.logit_bias).__name__}")
            bias = {}
            for key, value in self.logit_bias.items():
                token = _token_id(key)
                if token is None:
                    raise ValueError(f"SamplingParams.logit_bias keys must be token ids (integers >= 0), got {key!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                    raise ValueError(f"SamplingParams.logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}")
                bias[token] = float(value)
            object.__setattr__(self, "logit_bias", bias or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty, bias or min_tokens edits this request's logits (a PenaltyRule is made)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)




def _token_id(key) -> int | None:
    """A logit_bias key as a token id: an int, or its decimal text (JSON object keys are strings)."""
    if isinstance(key, str) and key.isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    return None


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

    On the CPU, rows with no filter (top_k 0, top_p 1, min_p 0: the API's defaults) take one compiled pass
    (`verify.softmax_kernels.tempered_softmax`) instead of ~8 tensor ops — most of a sampled step's host time
    after the forward; which way a row goes depends on its own parameters only, never on the other rows.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        plain = ((top_k <= 0) & (top_p >= 1) & (min_p <= 0)).numpy()
        if plain.any():
            from specserve.verify.softmax_kernels import tempered_softmax

            logits = logits.contiguous()
            probs = torch.empty_like(logits)
            tempered_softmax(logits.numpy(), np.flatnonzero(plain), temperature.float().contiguous().numpy(), probs.numpy())
            if not plain.all():
                rest = torch.from_numpy(np.flatnonzero(~plain))
                probs[rest] = _filtered_probs(logits[rest], temperature[rest], top_k[rest], top_p[rest], min_p[rest])
            return probs
    return _filtered_probs(logits, temperature, top_k, top_p, min_p)


def _filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """`logits_to_probs` as tensor ops (any device, any filter)."""
    # Shift by the row max first: the top logit becomes 0, so a tiny temperature sends the others
    # to -inf (probability 0) instead of overflowing to inf - inf = NaN.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
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
        peak = probs.amax(dim=-1, keepdim=True)
        probs = probs * (probs >= min_p[:, None] * peak)
    return probs / probs.sum(dim=-1, keepdim=True)
