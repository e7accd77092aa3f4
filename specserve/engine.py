"""The step loop (design.md §1): scheduler → drafters → runner (one StepBatch) → model → logits
processors → acceptance → commit → stream.

Prefill, plain decoding and speculative decoding are one path: a prefilling request brings a prompt
chunk, a decoding request its root plus its draft tree (empty for plain decoding), and all of them go
through a single target forward. Each piece is its own module: `scheduler` (who runs, budgets, KV
reservation, prefill chunks), `runner` (the StepBatch and the forward), `verify` (acceptance),
`budget` (the policy and the `StepRecord` it learns from), `step_hooks` (logits processors, forced
tokens). This class wires them and commits what was accepted.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from specserve.budget import RequestStepRecord, StaticBudget, StepRecord
from specserve.drafters.base import CommitInfo, DraftRequest, Drafter
from specserve.grammar import GrammarCompiler
from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel
from specserve.request import Request, RequestDelta, Status
from specserve.runner import ModelRunner, StepForward
from specserve.sampling import SamplingParams, logits_to_probs
from specserve.scheduler import ScheduledStep, Scheduler
from specserve.step_batch import StepBatchBuilder
from specserve.step_hooks import ForcedTokens, LogitsProcessor, VerifyRows
from specserve.verify import DraftTree, VerifyResult, accept_trees, draw_uniforms, pack_trees


GRAMMAR_DRAFTING = ("verify", "aware", "forced")

log = logging.getLogger("specserve")


@dataclass(frozen=True)
class EngineConfig:
    """max_model_len: context window (prompt + output). kv_cache_slots: total cached tokens.

    max_prefill_tokens: prompt tokens per step; a longer prompt is prefilled in chunks between the
    running requests' decode steps. max_forced_tokens: most tokens a constraint may force per step
    (reserved past each request's root).
    grammar_drafting: how constrained requests draft — "verify" (the grammar masks verification only:
    drafters propose freely, what other stacks do), "aware" (drafters also mask their own
    distributions, n-gram drafts are filtered: no verify row is spent on a forbidden token), "forced"
    (aware, and tokens the grammar leaves no choice about are drafted for free; the default).
    """

    max_model_len: int
    kv_cache_slots: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_prefill_tokens: int = 128
    max_forced_tokens: int = 8
    grammar_drafting: str = "forced"

    def __post_init__(self) -> None:
        if self.grammar_drafting not in GRAMMAR_DRAFTING:
            raise ValueError(f"grammar_drafting must be one of {', '.join(GRAMMAR_DRAFTING)}, got {self.grammar_drafting!r}")
        for name in ("max_model_len", "kv_cache_slots", "block_size", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_forced_tokens < 0:
            raise ValueError(f"EngineConfig.max_forced_tokens must be >= 0, got {self.max_forced_tokens}")


class Engine:
    """One model, one optional drafter, a paged KV cache, and the step loop over every request.

    logits_processors and forced_tokens are the seams of `step_hooks` (empty / None by default).
    """

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
        past_root = max(drafter.max_budget, drafter.kv_slots_past_root) if drafter else 0
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_prefill_tokens,
                                   max(past_root, config.max_forced_tokens), self.budget_policy)
        self._hidden_layers = tuple(drafter.hidden_layers) if drafter and drafter.needs_hidden_states else ()
        self.runner = ModelRunner(model, self.cache, self._hidden_layers)
        self.logits_processors: list[LogitsProcessor] = []
        self.forced_tokens: ForcedTokens | None = None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built with the first constrained request
        self._grammars_lock = threading.Lock()
        # Fault isolation: drafter calls that raised (the requests they touched decode plainly from
        # then on, never handed to the drafter again) and target forwards that raised (the requests in
        # that step finish with "error"). _drafter_off: ids the drafter has already released.
        self.drafter_failures = 0
        self.forward_failures = 0
        self._drafter_off: set[str] = set()
        self.warmup_s = self.calibration_s = 0.0
        if hasattr(self.budget_policy, "calibrate"):
            self._calibrate_budget_policy()

    # ---- cost calibration -----------------------------------------------------------------------

    def _calibrate_budget_policy(self) -> None:
        """Let the budget policy time target forwards shaped like verify steps: `rows` new tokens with
        logits at every row, after a cached context of typical length (attention over it is a real
        part of a verify row's cost). A scratch sequence holds the context; its blocks are freed after."""
        from specserve.speculation import CALIBRATION_CONTEXT, CALIBRATION_MAX_ROWS

        budget = self.drafter.max_budget if self.drafter is not None else 0
        most = self.config.max_num_seqs * (1 + budget) + self.config.max_prefill_tokens
        free = self.allocator.num_free_blocks * self.allocator.block_size - 1
        context = max(0, min(CALIBRATION_CONTEXT, self.config.max_model_len // 2, free // 2))
        max_rows = max(1, min(most, CALIBRATION_MAX_ROWS, free - context, self.config.max_model_len - context - 1))
        seq, vocab = "__calibration__", self.model.config.vocab_size
        self.allocator.allocate(seq, context + max_rows)
        try:
            with torch.inference_mode():
                # Warm-up first, untimed: on a fresh machine the first forwards of each shape compile
                # the kernels (a minute or more, once; cached on disk after) — that is not a cost model.
                t0 = time.perf_counter()
                if context:
                    self._forward_scratch(seq, 0, context)
                rows = 1
                while rows < max_rows * 2:
                    self._forward_scratch(seq, context, min(rows, max_rows))
                    rows *= 2
                t1 = time.perf_counter()

                def time_forward(rows: int) -> float:
                    t0 = time.perf_counter()
                    self._forward_scratch(seq, context, rows)
                    return time.perf_counter() - t0

                def time_tree(nodes: int) -> float:
                    """A verify step of one chain of `nodes` draft tokens: the forward with its tree mask, then
                    greedy tree acceptance (`time_forward(nodes + 1)` is the same rows as a plain forward)."""
                    tree = DraftTree.chain(((np.arange(1, nodes + 1) * 7919) % vocab).tolist())
                    t0 = time.perf_counter()
                    logits = self._forward_scratch(seq, context, nodes + 1, tree)
                    packed = pack_trees([tree], logits.device)
                    accept_trees([tree], packed, np.ones(1, dtype=np.bool_), _argmax(logits), None,
                                 np.full(packed.num_rows, -1, dtype=np.int64), np.zeros(0))
                    return time.perf_counter() - t0

                self.budget_policy.calibrate(time_forward, max_rows, time_tree)
                self.warmup_s, self.calibration_s = t1 - t0, time.perf_counter() - t1
        finally:
            self.allocator.free(seq)

    def _forward_scratch(self, seq: str, start: int, rows: int, tree: DraftTree | None = None) -> torch.Tensor:
        """A forward of `rows` new tokens of the scratch sequence at `start` (a tree's verify rows, root
        first, when `tree` is given); returns float[rows, vocab] logits."""
        builder = StepBatchBuilder(self.allocator)
        tokens = (np.arange(start, start + rows, dtype=np.int64) * 7919) % self.model.config.vocab_size
        positions = mask = None
        if tree is not None:
            positions = start + np.concatenate([[0], tree.depths.numpy()])
            mask = tree.ancestor_mask.numpy()
        builder.add(seq, start, tokens, positions, mask, logits="all")
        return self.model.forward(builder.build(), self.cache, self._hidden_layers).logits

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # ---- request lifecycle ----------------------------------------------------------------------

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler, built with the first constraint (from any thread: servers compile
        constraints on worker threads, `compile_constraint`)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
            return self._grammars

    def constraint_compiled(self, constraint) -> bool:
        """Whether ``constraint`` is in the compiled cache (its request can go straight to the engine)."""
        return self._grammars is not None and self._grammars.cached(constraint)

    def compile_constraint(self, constraint) -> None:
        """Compile a constraint into the cache now, on the calling thread (ValueError when it does not
        compile), so `add_request` on the engine thread finds it compiled and no step waits for it."""
        self.grammars.template(constraint)

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
        need = self.scheduler.slots_needed(len(prompt_ids), max_tokens)
        capacity = self.allocator.num_blocks * self.allocator.block_size
        if need > capacity:
            raise ValueError(
                f"request needs {need} KV slots but the cache holds {capacity}: "
                "lower max_tokens or raise kv_cache_tokens"
            )
        grammar = self.grammars.state(params.constraint) if params.constraint is not None else None
        if drafter_parts is not None:
            parts = tuple(getattr(self.drafter, "names", ()))
            unknown = [p for p in drafter_parts if p not in parts]
            if not drafter_parts or unknown:
                raise ValueError(f"drafter parts {list(drafter_parts)} are not parts of this engine's drafter "
                                 f"({self.drafter.name if self.drafter else 'none'}; parts: {list(parts)})")
        req = Request(request_id, list(prompt_ids), params, max_tokens, self.tokenizer, context, speculate)
        req.drafter_parts = None if drafter_parts is None else tuple(drafter_parts)
        req.client = client
        req.grammar = grammar
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

    @property
    def grammar_mask_s(self) -> float:
        """Seconds spent computing grammar masks so far (verification rows and drafters' nodes)."""
        return self._grammars.clock.seconds if self._grammars is not None else 0.0

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
        self.allocator.free(req.request_id)
        self.budget_policy.release(req.request_id)
        if self.drafter is not None and req.request_id not in self._drafter_off:
            try:
                self.drafter.release(req.request_id)
            except Exception:
                self.drafter_failures += 1
                log.exception("drafter %r failed to release %s", self.drafter.name, req.request_id)
        self._drafter_off.discard(req.request_id)

    def _drafter_failed(self, reqs: list[Request], what: str) -> None:
        """A drafter call raised (called from its except block): log it once, count it, and turn
        speculation off for the requests it touched — they go on decoding plainly (the same greedy
        output), are released from the drafter and never handed to it again."""
        self.drafter_failures += 1
        log.exception("drafter %r failed in %s; %d request(s) go on without speculation: %s", self.drafter.name,
                      what, len(reqs), ", ".join(r.request_id for r in reqs[:8]) + (" ..." if len(reqs) > 8 else ""))
        for r in reqs:
            r.speculate = False
            r.pending_hidden = []
            if r.request_id in self._drafter_off:
                continue
            self._drafter_off.add(r.request_id)
            try:
                self.drafter.release(r.request_id)
            except Exception:  # already counted and logged: the failure that brought us here
                pass

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
        only prefilled a prompt chunk produce nothing yet). Inference mode for the whole step: logits
        processors may edit the forward's logits in place."""
        t_start = time.perf_counter()
        step = self.scheduler.schedule(self.drafter.max_budget if self.drafter else 0)
        if step.empty:
            return []
        t0 = time.perf_counter()
        trees, budgets = self._draft(step)
        t1 = time.perf_counter()
        trees, predicted = self._cut(step, trees, budgets, t1 - t0)
        try:
            out = self.runner.run(step, trees)
        except Exception as exc:
            return self._forward_failed(step, exc)
        results, argmax = self._accept(out)
        t2 = time.perf_counter()
        self._commit(step, out, results, argmax, budgets, predicted)
        deltas = [self._emit(r, res.emitted_tokens) for r, res in zip(out.verifying, results)]
        self.budget_policy.observe(StepRecord(
            requests=tuple(RequestStepRecord(r.request_id, b, t.num_nodes, t.max_depth, res.num_accepted,
                                             tuple(res.accepted_nodes))
                           for r, b, t, res in zip(out.verifying, budgets, out.trees, results)),
            num_tokens=out.num_tokens,
            num_prefill_tokens=step.num_prefill_tokens,
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            step_s=time.perf_counter() - t_start,
            draft_depth=self._draft_depth(step) if any(budgets) else 0,
        ))
        return deltas

    def _draft_depth(self, step: ScheduledStep) -> int:
        depth = self.drafter.depth if self.drafter is not None and hasattr(self.drafter, "depth") else 1
        return min(depth, step.depth) if step.depth is not None else depth

    def _cut(self, step: ScheduledStep, trees: list[DraftTree], budgets: list[int],
             draft_s: float) -> tuple[list[DraftTree], list[float | None]]:
        """The policy cuts the decodes' drafted trees to what is worth verifying (completed prompts
        verify the empty tree and are not its business)."""
        n = len(step.decodes)
        if not n:
            return trees, [None] * len(trees)
        fixed_rows = n + step.num_prefill_tokens
        cut, predicted = self.budget_policy.cut(step.decodes, trees[:n], budgets[:n], fixed_rows, draft_s)
        for tree, before in zip(cut, trees[:n]):
            if tree.num_nodes > before.num_nodes:
                raise RuntimeError("the budget policy's cut added nodes to a tree")
        return list(cut) + trees[n:], list(predicted) + [None] * (len(trees) - n)

    def _draft(self, step: ScheduledStep) -> tuple[list[DraftTree], list[int]]:
        """Each decode's tree: forced tokens when a constraint forces some, else the drafter's, within
        its budget and the plan's depth. Returns the trees and the budgets given (one per verifying
        request; 0 for forced trees, which the policy's cut leaves alone)."""
        decodes, budgets = step.decodes, list(step.budgets)
        trees = [_EMPTY] * len(decodes)
        grammar_forces = self.config.grammar_drafting == "forced"
        if self.forced_tokens is not None or grammar_forces:
            for i, r in enumerate(decodes):
                if r.grammar is not None and grammar_forces:
                    forced = r.grammar.forced_tokens()
                elif self.forced_tokens is not None:
                    forced = list(self.forced_tokens(r))
                else:
                    continue
                forced = forced[: min(self.config.max_forced_tokens, r.max_tokens - r.num_output - 1)]
                if forced:
                    trees[i] = DraftTree.chain(forced)
                    budgets[i] = 0
        drafting = [i for i, b in enumerate(budgets) if b > 0]
        if self.drafter is not None and drafting:
            # Only drafting requests are handed over: a request at budget 0 keeps its target features
            # queued (`Request.pending_hidden`) and hands them all over when it next drafts, so plain
            # decoding pays no drafter work per step.
            aware = self.config.grammar_drafting != "verify"
            views = [DraftRequest(decodes[i].request_id, decodes[i].token_ids, decodes[i].params.temperature,
                                  decodes[i].take_hidden(), decodes[i].params.seed,
                                  decodes[i].grammar if aware else None, decodes[i].drafter_parts) for i in drafting]
            try:
                proposed = self.drafter.propose(views, [budgets[i] for i in drafting], depth=step.depth)
            except Exception:
                # This step's drafting requests verify the empty tree (plain decoding) and are done with
                # the drafter; the step goes on for everyone.
                self._drafter_failed([decodes[i] for i in drafting], "propose")
                for i in drafting:
                    budgets[i] = 0
                proposed, drafting = [], []
            vocab = self.model.config.vocab_size
            for i, tree in zip(drafting, proposed):
                if tree.num_nodes > budgets[i]:
                    raise RuntimeError(f"drafter {self.drafter.name!r} proposed {tree.num_nodes} nodes over a "
                                       f"budget of {budgets[i]}")
                if tree.num_nodes and int(tree.tokens.max()) >= vocab:
                    raise RuntimeError(f"drafter {self.drafter.name!r} proposed token ids outside the vocabulary")
                r = decodes[i]
                if aware and r.grammar is not None and tree.num_nodes and (r.params.greedy or not tree.has_q):
                    # Drafters that do not mask their own proposals (n-gram, Medusa's static trees): drop
                    # what the grammar forbids. Exact for greedy requests and one-hot drafts (GrammarState).
                    tree = r.grammar.legal_subtree(tree)
                trees[i] = tree
        done = sum(c.completes_prompt for c in step.prefills)
        return trees, budgets + [0] * done

    def _accept(self, out: StepForward) -> tuple[list[VerifyResult], torch.Tensor]:
        """Logits processors, then greedy / sampled acceptance of every verifying request, batched.
        Also returns every verify row's argmax int64[R] (after processors and grammar masks), which
        drafters with `wants_row_argmax` are handed at commit."""
        reqs, trees, logits = out.verifying, out.trees, out.logits
        constrained = [b for b, r in enumerate(reqs) if r.grammar is not None]
        if not self.logits_processors and not constrained and all(
                not t.num_nodes and r.params.greedy for r, t in zip(reqs, trees)):
            # Plain greedy decoding: each request's token is its row's argmax (the common case, kept lean:
            # right after a forward has streamed the weights through the caches, every Python step is slow).
            argmax = _argmax(logits)
            return [VerifyResult((), (), token, 0) for token in argmax.tolist()], argmax
        packed = pack_trees(trees, logits.device)
        if constrained:
            self._mask_grammar_rows(logits, reqs, trees, packed.cu_rows, constrained)
        if self.logits_processors:
            rows = VerifyRows(reqs, trees, packed.cu_rows)
            for processor in self.logits_processors:
                processor(logits, rows)
        greedy = np.fromiter((r.params.greedy for r in reqs), dtype=np.bool_, count=len(reqs))
        argmax = _argmax(logits)  # [R]
        probs, prob_index, uniforms = None, np.full(packed.num_rows, -1, dtype=np.int64), np.zeros(0)
        if not greedy.all():
            sampled = np.flatnonzero(~greedy)
            counts = np.diff(packed.cu_rows)[sampled]
            rows = np.concatenate([np.arange(packed.cu_rows[b], packed.cu_rows[b + 1]) for b in sampled])
            prob_index[rows] = np.arange(len(rows))

            def per_row(values, dtype=torch.float32) -> torch.Tensor:
                return torch.from_numpy(np.repeat(np.asarray(values), counts)).to(logits.device, dtype)

            params = [reqs[b].params for b in sampled]
            probs = logits_to_probs(
                logits[torch.from_numpy(rows).to(logits.device)],
                per_row([p.temperature for p in params]),
                per_row([min(p.top_k, logits.shape[-1]) for p in params], torch.int64),
                per_row([p.top_p for p in params]),
                per_row([p.min_p for p in params]),
            )
            uniforms = draw_uniforms(packed, greedy, [r.generator for r in reqs])
        return accept_trees(trees, packed, greedy, argmax, probs, prob_index, uniforms), argmax

    @staticmethod
    def _mask_grammar_rows(logits: torch.Tensor, reqs: list[Request], trees: list[DraftTree], cu_rows: np.ndarray,
                           constrained: list[int]) -> None:
        """-inf at every token a constrained request's grammar forbids at each of its verify rows (the
        matcher state of the row's node), before argmax, sampling and residuals see the logits."""
        masks = [reqs[b].grammar.tree_masks(trees[b])[0] for b in constrained]
        rows = np.concatenate([np.arange(cu_rows[b], cu_rows[b + 1]) for b in constrained])
        forbidden = torch.from_numpy(~np.concatenate(masks)).to(logits.device)
        index = torch.from_numpy(rows).to(logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))

    def _commit(self, step: ScheduledStep, out: StepForward, results: list[VerifyResult], row_argmax: torch.Tensor,
                budgets: list[int], predicted: list[float | None]) -> None:
        """Keep the accepted path's KV next to the root (one batched move), advance committed lengths,
        queue target features for the drafter, record statistics and tell the drafter what was kept.

        A decode's root sits at slot num_cached; accepted node i was written at num_cached + 1 + i and
        moves to num_cached + depth.
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
        if src:
            device = self.cache.device
            self.cache.move(torch.from_numpy(np.concatenate(src)).to(device),
                            torch.from_numpy(np.concatenate(dst)).to(device))
        hidden = out.hidden
        roots = None
        if hidden:
            # Every decode keeps its root's features: gathered once for the batch ([decodes, hidden] per
            # layer), each request keeping a one-row view (the common plain step costs no per-request copy).
            index = torch.as_tensor(out.first_rows[:len(step.decodes)], dtype=torch.int64)
            roots = {layer: h[index.to(h.device)] for layer, h in hidden.items()}
        commits = []
        argmax = offsets = None
        if self.drafter is not None and self.drafter.wants_row_argmax and step.decodes:
            argmax = row_argmax.cpu().numpy()  # acceptance's own, for greedy and sampled rows alike
            offsets = np.cumsum([0] + [t.num_nodes + 1 for t in out.trees])
        for j, (r, tree, result, first, budget, guess) in enumerate(zip(step.decodes, out.trees, results, out.first_rows,
                                                                       budgets, predicted)):
            if hidden and r.speculate:
                if result.num_accepted:
                    keep = first + np.concatenate([[0], np.asarray(result.accepted_nodes, dtype=np.int64) + 1])
                    r.pending_hidden.append({layer: h[torch.from_numpy(keep).to(h.device)] for layer, h in hidden.items()})
                else:
                    r.pending_hidden.append({layer: h[j:j + 1] for layer, h in roots.items()})
            r.num_cached += 1 + result.num_accepted
            r.stats.record(tree, result, budget, guess)
            if argmax is not None:
                commits.append(CommitInfo(r.request_id, result, r.num_cached + 1, tree, argmax[offsets[j]:offsets[j + 1]]))
            else:
                commits.append(CommitInfo(r.request_id, result, r.num_cached + 1))
        for chunk, first in zip(step.prefills, out.first_rows[len(step.decodes):]):
            r = chunk.request
            if hidden and r.speculate:
                r.pending_hidden.append({layer: h[first:first + chunk.end - chunk.start] for layer, h in hidden.items()})
            r.num_cached = chunk.end
        if self.drafter is not None and self._drafter_off:
            commits = [c for c in commits if c.request_id not in self._drafter_off]
        if self.drafter is not None and commits:
            try:
                self.drafter.on_commit(commits)  # before _emit, which may finish (and release) requests
            except Exception:
                self._drafter_failed([self.requests[c.request_id] for c in commits], "on_commit")

    def _emit(self, r: Request, tokens: list[int]) -> RequestDelta:
        """Append accepted tokens one by one, stopping at EOS, max_tokens or a stop string."""
        if r.first_token_time is None:
            r.first_token_time = time.perf_counter()
        kept: list[int] = []
        reason = None
        for tok in tokens:
            if r.grammar is not None:
                if not r.grammar.failed:
                    r.grammar.advance([tok])
                if r.grammar.failed:
                    # The matcher gave up (llguidance's work limits on a pathological grammar): this
                    # request alone ends, without the tokens its grammar could not vouch for.
                    r.error = f"the output constraint failed: {r.grammar.error}"
                    reason = "error"
                    break
            r.append(tok)
            kept.append(tok)
            if r.detok.add(tok):
                reason = "stop"
            elif tok in self.eos_token_ids and not r.params.ignore_eos:
                reason = "stop"
            elif r.grammar is not None and r.grammar.stopped:
                reason = "stop"  # the grammar is complete and admits nothing more
            elif r.num_output >= r.max_tokens:
                reason = "length"
            if reason:
                break
        if reason:
            self._finish(r, reason)
        return RequestDelta(r.request_id, kept, r.detok.take_delta(final=reason is not None), reason is not None, reason)


_EMPTY = DraftTree.empty()


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64[R] argmax per row (on the CPU through numpy: 10x cheaper than torch's op on small rows)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)
