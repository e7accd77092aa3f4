"""The step loop: admit → draft → ONE batched verify forward → accept → commit → stream.

Prefill, plain decoding and speculative decoding are one path: a prefilling request brings its
prompt with a causal mask, a decoding request brings its root plus its draft tree (empty for plain
decoding) with the tree's ancestor mask, and all of them go through a single target forward.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from specserve.budget import StaticBudget
from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel
from specserve.request import Request, RequestDelta, Status
from specserve.sampling import SamplingParams, logits_to_probs
from specserve.step_batch import StepBatchBuilder
from specserve.verify import DraftTree, VerifyResult
from specserve.verify.accept import accept_batch, split_verify_rows
from specserve.drafters.base import CommitInfo, DraftRequest, Drafter


@dataclass(frozen=True)
class EngineConfig:
    """max_model_len: context window (prompt + output). kv_cache_slots: total cached tokens."""

    max_model_len: int
    kv_cache_slots: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_prefill_tokens: int = 8192  # prompt tokens admitted per step, so one step stays short

    def __post_init__(self) -> None:
        for name in ("max_model_len", "kv_cache_slots", "block_size", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer,
        drafter: Drafter | None,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        budget_policy=None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.budget_policy = budget_policy or StaticBudget(drafter.max_budget if drafter else 0)
        self.allocator = BlockAllocator(-(-config.kv_cache_slots // config.block_size), config.block_size)
        self.cache = model.new_cache(self.allocator)
        if drafter is not None:
            drafter.attach_kv(self.allocator)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._hidden_layers = tuple(drafter.hidden_layers) if drafter and drafter.needs_hidden_states else ()

    # ---- request lifecycle ----------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, speculate: bool = True
    ) -> Request:
        """Validate and queue a request; raises ValueError naming what is wrong.

        speculate=False decodes this request plainly (budget 0) while others in the batch speculate.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if len(prompt_ids) == 0:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        context = self.config.max_model_len
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
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        need = self._slots_needed(len(prompt_ids), max_tokens)
        capacity = self.allocator.num_blocks * self.allocator.block_size
        if need > capacity:
            raise ValueError(
                f"request needs {need} KV slots but the cache holds {capacity}: "
                "lower max_tokens or raise kv_cache_tokens"
            )
        req = Request(request_id, list(prompt_ids), params, max_tokens, self.tokenizer, context, speculate)
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Cancel a request (queued or running), free its KV; False if it is unknown or finished."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, "cancelled")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self, request_id: str) -> Request:
        req = self.requests.pop(request_id)
        assert req.status is Status.FINISHED
        return req

    def _slots_needed(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots a request reserves at admission: every token it can hold, plus room past its root for
        the largest draft tree (or the drafter's own tree levels, whichever is more)."""
        past_root = max(self.drafter.max_budget, self.drafter.kv_slots_past_root) if self.drafter else 0
        return prompt_len + max_tokens + past_root + 1

    def _finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        req.detok.flush()
        if req in self.running:
            self.running.remove(req)
        self.allocator.free(req.request_id)
        if self.drafter is not None:
            self.drafter.release(req.request_id)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one engine step over every running request; return what each produced."""
        prefills = self._admit()
        decodes = [r for r in self.running if r.prefilled]
        if not prefills and not decodes:
            return []
        # A prefilling request verifies the empty tree: its "bonus token" is its first token.
        reqs = prefills + decodes
        trees = [DraftTree.empty()] * len(prefills) + self._draft(decodes)

        out = self._forward(reqs, trees)
        results = self._accept(out.logits, reqs, trees)
        self._commit_kv(reqs, trees, results)
        if self._hidden_layers:
            self._keep_hidden(out.hidden_states, reqs, trees, results, len(prefills))
        commits = []
        for r, tree, result in zip(decodes, trees[len(prefills):], results[len(prefills):]):
            r.stats.record(tree, result)
            commits.append(CommitInfo(r.request_id, result, r.num_cached + 1))
        if self.drafter is not None and commits:
            self.drafter.on_commit(commits)  # before _emit, which may finish (and release) requests
        return [self._emit(r, result.emitted_tokens) for r, result in zip(reqs, results)]

    def _forward(self, reqs: list[Request], trees: list[DraftTree]):
        """ONE target forward over every request's new tokens: a prompt (causal), or root + tree.

        Hidden states (for drafters that read target features) come from every prompt row of a
        prefill and every row of a tree; logits only from a prompt's last row and every tree row.
        """
        builder = StepBatchBuilder(self.allocator)
        hidden = bool(self._hidden_layers)
        for r, tree in zip(reqs, trees):
            if not r.prefilled:
                builder.add(r.request_id, 0, r.token_ids, logits="last", hidden=hidden)
            else:
                tokens = np.concatenate([r.token_ids[-1:], tree.tokens.numpy()])
                mask = tree.ancestor_mask.numpy() if tree.num_nodes else None
                builder.add(r.request_id, r.num_cached, tokens, tree.positions(r.num_cached).numpy(), mask,
                            logits="all", hidden=hidden)
        return self.model.forward(builder.build(), self.cache, self._hidden_layers)

    def _commit_kv(self, reqs: list[Request], trees: list[DraftTree], results: list[VerifyResult]) -> None:
        """Keep the accepted path's KV next to the root, drop the rest, advance committed lengths.

        The root sits at slot num_cached; accepted node i was written at slot num_cached + 1 + i and
        moves to num_cached + 1 + depth - 1. One batched copy for the whole step.
        """
        src_slots, dst_slots = [], []
        device = self.model.device
        for r, result in zip(reqs, results):
            if not r.prefilled:
                r.num_cached = r.prompt_len
                continue
            if result.num_accepted:
                src = torch.tensor(result.accepted_nodes) + r.num_cached + 1
                dst = torch.arange(1, result.num_accepted + 1) + r.num_cached
                moved = src != dst
                if bool(moved.any()):
                    src_slots.append(self.cache.slots(r.request_id, src[moved].to(device)))
                    dst_slots.append(self.cache.slots(r.request_id, dst[moved].to(device)))
            r.num_cached += 1 + result.num_accepted
        if src_slots:
            self.cache.move(torch.cat(src_slots), torch.cat(dst_slots))

    def _admit(self) -> list[Request]:
        """Move waiting requests into the running batch while sequences, tokens and KV allow."""
        admitted: list[Request] = []
        prefill_tokens = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            need = self._slots_needed(req.prompt_len, req.max_tokens)
            if admitted and prefill_tokens + req.prompt_len > self.config.max_prefill_tokens:
                break
            if not self.allocator.can_allocate(need):
                break  # first-come first-served: wait for blocks rather than let later requests jump ahead
            self.waiting.popleft()
            self.allocator.allocate(req.request_id, need)
            req.status = Status.RUNNING
            req.scheduled_time = time.perf_counter()
            self.running.append(req)
            admitted.append(req)
            prefill_tokens += req.prompt_len
        return admitted

    def _draft(self, decodes: list[Request]) -> list[DraftTree]:
        if not decodes:
            return []
        if self.drafter is None:
            return [DraftTree.empty() for _ in decodes]
        budgets = []
        for r, b in zip(decodes, self.budget_policy.budgets(decodes)):
            remaining = r.max_tokens - r.num_output - 1  # the bonus token always comes
            room = self.config.max_model_len - r.num_cached - 1
            budgets.append(max(0, min(b, self.drafter.max_budget, remaining, room)) if r.speculate else 0)
        if not any(budgets):
            return [DraftTree.empty() for _ in decodes]
        views = [
            DraftRequest(r.request_id, r.token_ids, r.params.temperature, r.take_hidden(), r.params.seed) for r in decodes
        ]
        trees = self.drafter.propose(views, budgets)
        vocab = self.model.config.vocab_size
        for tree, budget in zip(trees, budgets):
            if tree.num_nodes > budget:
                raise RuntimeError(f"drafter {self.drafter.name!r} proposed {tree.num_nodes} nodes over a budget of {budget}")
            if tree.num_nodes and int(tree.tokens.max()) >= vocab:
                raise RuntimeError(f"drafter {self.drafter.name!r} proposed token ids outside the vocabulary")
        return trees

    def _accept(self, logits: torch.Tensor, reqs: list[Request], trees: list[DraftTree]) -> list[VerifyResult]:
        """Greedy rows need only the argmax, sampled rows the processed target distribution; both
        are gathered on the device and reach the host in one transfer (inside accept_batch)."""
        greedy = [r.params.greedy for r in reqs]
        greedy_rows, sampled_rows = split_verify_rows(trees, greedy)
        device = logits.device
        target_tokens = logits[greedy_rows.to(device)].argmax(dim=-1) if greedy_rows.numel() else None
        target_probs = None
        if sampled_rows.numel():
            sampled = [(r.params, t.num_nodes + 1) for r, t, g in zip(reqs, trees, greedy) if not g]
            counts = torch.tensor([n for _, n in sampled])

            def per_row(values: list[float], dtype=torch.float32) -> torch.Tensor:
                return torch.repeat_interleave(torch.tensor(values, dtype=dtype), counts).to(device)

            target_probs = logits_to_probs(
                logits[sampled_rows.to(device)],
                per_row([p.temperature for p, _ in sampled]),
                per_row([min(p.top_k, logits.shape[-1]) for p, _ in sampled], torch.int64),
                per_row([p.top_p for p, _ in sampled]),
                per_row([p.min_p for p, _ in sampled]),
            )
        return accept_batch(trees, greedy, target_tokens, target_probs, [r.generator for r in reqs])

    def _emit(self, r: Request, tokens: list[int]) -> RequestDelta:
        """Append accepted tokens one by one, stopping at EOS, max_tokens, the context end or a stop string."""
        if r.first_token_time is None:
            r.first_token_time = time.perf_counter()
        kept: list[int] = []
        reason = None
        for tok in tokens:
            r.append(tok)
            kept.append(tok)
            if r.detok.add(tok):
                reason = "stop"
            elif tok in self.eos_token_ids and not r.params.ignore_eos:
                reason = "stop"
            elif r.num_output >= r.max_tokens:
                reason = "length"
            if reason:
                break
        if reason:
            self._finish(r, reason)
        return RequestDelta(r.request_id, kept, r.detok.take_delta(final=reason is not None), reason is not None, reason)

    def _keep_hidden(self, hidden, reqs, trees, results, num_prefills: int) -> None:
        """Queue, per speculating request, the target features of the tokens it just committed.

        Called after _commit_kv. hidden: {layer: [M_h, hidden]} over the forward's hidden rows (every
        prompt row of a prefill, root + nodes of a tree). A prefill commits its whole prompt, a
        decode step its root and accepted nodes. The rows wait on the request until the next
        `propose` that includes it, so no feature is lost on steps where nobody drafts.
        """
        offset = 0
        for i, (r, tree, result) in enumerate(zip(reqs, trees, results)):
            if i < num_prefills:
                rows = torch.arange(offset, offset + r.prompt_len)
                offset += r.prompt_len
            else:
                rows = torch.tensor([0, *(node + 1 for node in result.accepted_nodes)]) + offset
                offset += tree.num_nodes + 1
            if r.speculate:
                r.pending_hidden.append({layer: h[rows.to(h.device)] for layer, h in hidden.items()})
