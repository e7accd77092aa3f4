"""A request's state inside the engine, its speculation statistics, and what callers get back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.detokenizer import IncrementalDetokenizer
from specserve.sampling import SamplingParams
from specserve.verify import DraftTree, VerifyResult


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation statistics of one request.

    num_steps:              verify steps (the prefill that produced the first token is not one).
    mean_accepted_length:   τ — tokens emitted per verify step, bonus token included (1.0 = plain).
    accepted_per_position:  [d-1] = steps in which the draft token at depth d was accepted.
    drafted_per_position:   [d-1] = steps whose tree reached depth d.
    accepted_length_counts: [a] = steps that accepted exactly a draft tokens (emitting a + 1).
    num_budget:             nodes the budget policy allowed, summed over steps (mean_budget per step).
    predicted_accepted / accepted_when_predicted / num_predicted: over the steps where the adaptive
                            policy predicted its tree's accepted length — what it predicted and what
                            was accepted (predicted_tau vs realised_tau).
    accepted_by_drafter:    accepted draft tokens by the drafter that proposed them, for trees that say
                            (a hybrid drafter's parts; "a+b" when both proposed the token).
    """

    num_steps: int = 0
    num_emitted: int = 0
    num_drafted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_length_counts: list[int] = field(default_factory=list)
    num_budget: int = 0
    predicted_accepted: float = 0.0
    accepted_when_predicted: int = 0
    num_predicted: int = 0
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_budget(self) -> float:
        return self.num_budget / self.num_steps if self.num_steps else 0.0

    @property
    def predicted_tau(self) -> float | None:
        return 1 + self.predicted_accepted / self.num_predicted if self.num_predicted else None

    @property
    def realised_tau(self) -> float | None:
        """τ over the same steps as predicted_tau."""
        return 1 + self.accepted_when_predicted / self.num_predicted if self.num_predicted else None

    def record(self, tree: DraftTree, result: VerifyResult, budget: int = 0, predicted: float | None = None) -> None:
        self.num_steps += 1
        self.num_budget += budget
        if predicted is not None:
            self.num_predicted += 1
            self.predicted_accepted += predicted
            self.accepted_when_predicted += result.num_accepted
        self.num_emitted += result.num_accepted + 1
        self.num_drafted += tree.num_nodes
        depth = tree.max_depth
        _grow(self.drafted_per_position, depth)
        _grow(self.accepted_per_position, depth)
        for d in range(depth):
            self.drafted_per_position[d] += 1
        for d in range(result.num_accepted):
            self.accepted_per_position[d] += 1
        _grow(self.accepted_length_counts, result.num_accepted + 1)
        self.accepted_length_counts[result.num_accepted] += 1
        if tree.sources is not None:
            for node in result.accepted_nodes:
                self.accepted_by_drafter[tree.sources[node]] = self.accepted_by_drafter.get(tree.sources[node], 0) + 1

    def to_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "mean_accepted_length": self.mean_accepted_length,
            "num_drafted": self.num_drafted,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_length_counts": list(self.accepted_length_counts),
            "mean_budget": self.mean_budget,
            "predicted_tau": self.predicted_tau,
            "realised_tau": self.realised_tau,
            **({"accepted_by_drafter": dict(self.accepted_by_drafter)} if self.accepted_by_drafter else {}),
        }


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))


def resolve_max_tokens(prompt_ids, params: SamplingParams, vocab_size: int, max_model_len: int) -> int:
    """A request's max_tokens (None: the rest of the context window); ValueError for a prompt that is
    empty, outside the vocabulary or does not leave room for it."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    context = max_model_len
    if len(prompt_ids) >= context:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens but the context window is {context}: "
            "leave room for at least one new token"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else context - len(prompt_ids)
    if len(prompt_ids) + max_tokens > context:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: together "
            f"{len(prompt_ids) + max_tokens} tokens, but the context window is {context}; lower max_tokens to at "
            f"most {context - len(prompt_ids)} (or leave it unset for the rest of the context)"
        )
    return max_tokens


class Request:
    """Engine-side state. Once prefilled: len(token_ids) == num_cached + 1 (the root, whose KV comes
    with the next verify step); while prefilling, num_cached counts the prompt tokens cached so far."""

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int, tokenizer, max_len: int,
        speculate: bool = True,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens resolved: None became the rest of the context window
        self.prompt_len = len(prompt_ids)
        self._tokens = np.empty(max_len + 1, dtype=np.int64)  # prompt + output; +1 for the root slack
        self._tokens[: self.prompt_len] = prompt_ids
        self.num_tokens = self.prompt_len
        self.num_cached = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (set at admission)
        self.status = Status.WAITING
        self.speculate = speculate  # False: this request decodes plainly (budget 0)
        self.drafter_parts: tuple[str, ...] | None = None  # a hybrid drafter's parts this request uses (None: all)
        self.client: str | None = None  # who sent it (a websocket session, API user or HTTP connection): admission is fair across clients
        # Its step hooks (a grammar's matcher, ...): made at admission by the engine's rule factories.
        self.rules: tuple = ()
        self.finish_reason: str | None = None
        self.error: str | None = None  # why, when finish_reason is "error" (the engine failed on its step)
        self.stats = SpecStats()
        # Log-probabilities (verify/logprobs.py) when asked for: one per output token, and one per prompt
        # token (the first has none: nothing predicts it).
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        # SamplingParams.return_hidden_states: the capture layers' rows each step committed, in token order
        # (one {layer: float[rows, hidden]} per step; `captured_hidden_states` joins them).
        self.hidden_states: list | None = [] if params.return_hidden_states else None
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop)
        self.generator = torch.Generator().manual_seed(
            params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        )
        self.arrival_time = time.perf_counter()
        self.scheduled_time: float | None = None  # admitted into the running batch (queue time ends)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def token_ids(self) -> np.ndarray:
        """int64[num_tokens]: prompt + output (a view; copy before keeping it)."""
        return self._tokens[: self.num_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self._tokens[self.prompt_len : self.num_tokens].tolist()

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def tokens_after_bonus(self) -> int:
        """Output tokens a verify step may still add besides its bonus token (which always comes): the most
        draft or forced tokens this step can use."""
        return self.max_tokens - self.num_output - 1

    @property
    def prefilled(self) -> bool:
        """The whole prompt is in the cache (prefill may take several steps, one chunk each)."""
        return self.num_cached >= self.prompt_len

    def captured_hidden_states(self) -> dict | None:
        """{layer: float[rows, hidden]}: row i is token i of prompt + output, for every token whose forward
        row ran (all but the last, which no step fed back; a stop string or EOS inside an accepted path can
        leave rows past the output's end, which are dropped). None unless the request asked."""
        if not self.hidden_states:
            return None if self.hidden_states is None else {}
        return {layer: torch.cat([s[layer] for s in self.hidden_states])[:self.num_tokens]
                for layer in self.hidden_states[0]}

    def append(self, token: int) -> None:
        self._tokens[self.num_tokens] = token
        self.num_tokens += 1


@dataclass(frozen=True)
class RequestDelta:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: tuple = ()  # one verify.logprobs.TokenLogprob per token in token_ids, when the request asked


@dataclass(frozen=True)
class RequestOutput:
    """A finished request: `finish_reason` is "stop", "length", "cancelled" or "error" (the model failed on
    one of its steps: `error` says so; the tokens are those produced before)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    spec: SpecStats
    ttft_s: float | None
    e2e_s: float | None
    error: str | None = None
    # SamplingParams.logprobs / prompt_logprobs: TokenLogprob per output token / per prompt token (None first).
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    # SamplingParams.return_hidden_states: {layer: float[rows, hidden]}, row i the target's hidden state at
    # token i of prompt + output, for every token the forward ran (all but the last).
    hidden_states: dict | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled)
