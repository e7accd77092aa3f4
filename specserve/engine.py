"""The step loop (ARCHITECTURE.md): schedule → speculator.propose → runner.run → verifier.accept →
keep the accepted rows' KV → speculator.commit → emit.

Prefill, plain decoding and speculative decoding are one path: a prefilling request brings a prompt
chunk, a decoding request its root plus its draft tree (empty for plain decoding), and all of them go
through a single target forward. Each concern has one owner: the `Scheduler` (who runs, KV reservation,
prefill chunks, hard caps), the `Speculator` (budgets, forced tokens, drafting, the policy's cut,
drafter state and failures), the `ModelRunner` (one StepBatch, one forward), the `Verifier` (logits
rules, acceptance), and `StepHooks` (per-request rules: constraints, later penalties and tools). This
class admits requests, runs the step, keeps what was accepted and streams it.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from specserve.budget import BudgetPolicy
from specserve.drafters.base import Drafter
from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel
from specserve.prefix_cache import PrefixCache
from specserve.request import Request, RequestDelta, Status, resolve_max_tokens
from specserve.runner import ModelRunner
from specserve.sampling import SamplingParams
from specserve.scheduler import ScheduledStep, Scheduler
from specserve.speculation.calibration import calibrate_policy
from specserve.speculation.speculator import Speculator
from specserve.step_hooks import StepHooks
from specserve.verify import VerifyResult
from specserve.verify.verifier import Verifier

log = logging.getLogger("specserve")


@dataclass(frozen=True)
class EngineConfig:
    """max_model_len: context window (prompt + output). kv_cache_slots: total cached tokens.

    max_prefill_tokens: prompt tokens per step; a longer prompt is prefilled in chunks between the
    running requests' decode steps. max_forced_tokens: most tokens a rule may force per step (reserved
    past each request's root). enable_prefix_caching: share the KV of full blocks of earlier requests'
    tokens with prompts that start with them (specserve/prefix_cache.py).
    """

    max_model_len: int
    kv_cache_slots: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_prefill_tokens: int = 128
    max_forced_tokens: int = 8
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "kv_cache_slots", "block_size", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_forced_tokens < 0:
            raise ValueError(f"EngineConfig.max_forced_tokens must be >= 0, got {self.max_forced_tokens}")


class Engine:
    """One model, one optional drafter, a paged KV cache, and the step loop over every request.

    hooks: the step hooks (rule factories — `specserve.LLM` installs the output constraints' —, batch
    logits processors, forced-token sources); empty by default. budget_policy: how much each request
    drafts (default: the drafter's own budget); calibrated here when it asks for it. capture_layers: target
    layers (transformers' hidden_states numbering) whose hidden states requests may ask for
    (`SamplingParams.return_hidden_states`).
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer,
        drafter: Drafter | None,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        budget_policy: BudgetPolicy | None = None,
        hooks: StepHooks | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.hooks = hooks if hooks is not None else StepHooks()
        self.allocator = BlockAllocator(-(-config.kv_cache_slots // config.block_size), config.block_size)
        self.cache = model.new_cache(self.allocator)
        if drafter is not None:
            drafter.attach_kv(self.allocator)
        if any(not (isinstance(layer, int) and 0 <= layer <= model.config.num_layers) for layer in capture_layers):
            raise ValueError(f"capture layers {list(capture_layers)} must lie in 0..{model.config.num_layers} "
                             "(transformers' hidden_states numbering)")
        self.speculator = Speculator(drafter, self.hooks, model.config.vocab_size, config.max_forced_tokens,
                                     budget_policy, capture_layers)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            keeps_kv = drafter is not None and drafter.kv_bytes_per_slot() > 0
            self.prefix_cache = PrefixCache(self.allocator, drafter.kv_lookahead if keeps_kv else None)
            if keeps_kv:  # its blocks are offered to drafting requests only with the drafter's entries written
                self.speculator.drafter_kv_lag_limit = config.block_size
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_prefill_tokens,
                                   self.speculator.slots_past_root, self.prefix_cache)
        self.runner = ModelRunner(model, self.cache, self.speculator.hidden_layers)
        self.verifier = Verifier(self.hooks)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.forward_failures = 0  # target forwards that raised (the requests of that step finished with "error")
        self.warmup_s = self.calibration_s = 0.0
        if self.speculator.policy.wants_calibration:
            most_rows = config.max_num_seqs * (1 + self.speculator.max_budget) + config.max_prefill_tokens
            self.warmup_s, self.calibration_s = calibrate_policy(self.speculator.policy, self.runner, self.allocator,
                                                                 config.max_model_len, most_rows)

    @property
    def drafter(self) -> Drafter | None:
        return self.speculator.drafter

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # ---- request lifecycle ----------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, speculate: bool = True,
        drafter_parts: tuple[str, ...] | None = None, client: str | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming what is wrong.

        speculate=False decodes this request plainly (budget 0) while others in the batch speculate.
        drafter_parts: which of a hybrid drafter's parts draft for this request (None: all of them).
        client: who sent it (a server's connection or peer): the scheduler admits fairly across clients.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        max_tokens = resolve_max_tokens(prompt_ids, params, self.model.config.vocab_size, self.config.max_model_len)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        need = self.scheduler.slots_needed(len(prompt_ids), max_tokens)
        capacity = self.allocator.num_blocks * self.allocator.block_size
        if need > capacity:
            raise ValueError(
                f"request needs {need} KV slots but the cache holds {capacity}: "
                "lower max_tokens or raise kv_cache_tokens"
            )
        self.speculator.check_parts(drafter_parts)
        if params.return_hidden_states and not self.speculator.capture_layers:
            raise ValueError("return_hidden_states needs an engine that captures hidden states: "
                             "LLM(..., capture_layers=(...))")
        req = Request(request_id, list(prompt_ids), params, max_tokens, self.tokenizer, self.config.max_model_len,
                      speculate)
        req.rules = self.hooks.rules_for(req)
        req.drafter_parts = None if drafter_parts is None else tuple(drafter_parts)
        req.client = client
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Cancel a request (queued or running), free its KV; False if it is unknown or finished."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        self._finish(req, "cancelled")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def pop_finished(self, request_id: str) -> Request:
        req = self.requests.pop(request_id)
        assert req.status is Status.FINISHED
        return req

    def _finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        req.detok.flush()
        self.scheduler.remove(req)
        if self.prefix_cache is not None:
            if reason != "error":  # the last step's accepted tokens were appended after its blocks were offered
                self._offer(req)
            self.prefix_cache.release(req.request_id)
        self.allocator.free(req.request_id)
        self.speculator.release(req)
        self.hooks.release(req)

    def _forward_failed(self, step: ScheduledStep, exc: Exception) -> list[RequestDelta]:
        """The target forward raised: the requests of this step finish with "error" (their KV freed);
        everyone else — waiting requests, later arrivals — is untouched and the next step runs."""
        self.forward_failures += 1
        reqs = list(step.decodes) + [c.request for c in step.prefills]
        log.exception("target forward failed; failing the %d request(s) of this step", len(reqs))
        message = f"the model failed on this request's step ({type(exc).__name__})"
        deltas = []
        for r in reqs:
            if r.status is Status.FINISHED:
                continue
            r.error = message
            self._finish(r, "error")
            deltas.append(RequestDelta(r.request_id, [], r.detok.take_delta(final=True), True, "error"))
        return deltas

    # ---- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """Run one engine step over every running request; return what each produced (requests that
        only prefilled a prompt chunk produce nothing yet). Inference mode for the whole step: the
        Verifier's rules edit the forward's logits in place."""
        t_start = time.perf_counter()
        step = self.scheduler.schedule(self.speculator.max_budget)
        if step.empty:
            return []
        proposal = self.speculator.propose(step)
        try:
            out = self.runner.run(step, proposal.trees)
        except Exception as exc:
            return self._forward_failed(step, exc)
        results, row_argmax = self.verifier.accept(out)
        t_verified = time.perf_counter()
        self._keep_accepted(step, results)
        self.speculator.commit(step, out, results, row_argmax, proposal)
        if self.prefix_cache is not None:
            self._offer_blocks(step)
        deltas = [self._emit(r, res.emitted_tokens, res.logprobs) for r, res in zip(out.verifying, results)]
        self.speculator.observe(step, out, results, proposal, verify_s=t_verified - proposal.drafted_at,
                                step_s=time.perf_counter() - t_start)
        return deltas

    def _keep_accepted(self, step: ScheduledStep, results: list[VerifyResult]) -> None:
        """Keep the accepted path's KV next to the root (one batched move) and advance committed lengths.

        A decode's root sits at slot num_cached; accepted node i was written at num_cached + 1 + i and
        moves to num_cached + depth. The rest of the tree's rows are dropped (overwritten later).
        """
        src, dst = [], []
        for r, result in zip(step.decodes, results):
            if result.num_accepted:
                nodes = np.asarray(result.accepted_nodes, dtype=np.int64)
                moved = nodes != np.arange(result.num_accepted)
                if moved.any():
                    base = r.num_cached + 1
                    src.append(self.allocator.physical_slots(r.request_id, base + nodes[moved]))
                    dst.append(self.allocator.physical_slots(r.request_id, base + np.flatnonzero(moved)))
            r.num_cached += 1 + result.num_accepted
        if src:
            device = self.cache.device
            self.cache.move(torch.from_numpy(np.concatenate(src)).to(device),
                            torch.from_numpy(np.concatenate(dst)).to(device))
        for chunk in step.prefills:
            chunk.request.num_cached = chunk.end

    def _offer_blocks(self, step: ScheduledStep) -> None:
        """Blocks the step filled with committed tokens (prompt or output) join the prefix cache, before
        emitting may finish their requests: a later prompt (the next turn of a chat) starts with them."""
        for r in itertools.chain(step.decodes, (c.request for c in step.prefills)):
            self._offer(r)

    def _offer(self, r: Request) -> None:
        self.prefix_cache.commit(r.request_id, r.token_ids, r.num_cached, lambda: self.speculator.drafter_cached(r))

    def _emit(self, r: Request, tokens: list[int], logprobs: tuple = ()) -> RequestDelta:
        """Append accepted tokens one by one, stopping at a rule's verdict, EOS, max_tokens or a stop string;
        `logprobs` (one per token, when the request asked) follow the tokens kept."""
        if r.first_token_time is None:
            r.first_token_time = time.perf_counter()
        kept: list[int] = []
        reason = None
        for tok in tokens:
            verdict = self.hooks.accept_token(r, tok) if r.rules else None
            if verdict is not None and not verdict.keep:
                r.error, reason = verdict.error, verdict.reason
                break
            r.append(tok)
            kept.append(tok)
            if r.detok.add(tok):
                reason = "stop"
            elif tok in self.eos_token_ids and not r.params.ignore_eos:
                reason = "stop"
            elif verdict is not None:
                reason = verdict.reason
            elif r.num_output >= r.max_tokens:
                reason = "length"
            if reason:
                break
        kept_logprobs = tuple(logprobs[:len(kept)])
        if kept_logprobs:
            r.logprobs.extend(kept_logprobs)
        if reason:
            self._finish(r, reason)
        return RequestDelta(r.request_id, kept, r.detok.take_delta(final=reason is not None), reason is not None, reason,
                            kept_logprobs)
