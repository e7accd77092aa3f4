"""The Speculator owns speculation from plan to commit (ARCHITECTURE.md, "The step").

Each step, for the scheduler's decodes:

    propose:  budgets from the budget policy within the scheduler's hard caps (0 = plain decoding)
              → forced tokens of the step hooks (a free chain, budget 0) → the drafter's trees for the
              requests still drafting, each masked by its rules (`RequestRule.draft_mask`) and filtered
              (`filter_tree`) → the policy's cut. A drafter that raises is isolated: the requests it
              touched decode plainly from then on, the step goes on for everyone.
    commit:   (after the Verifier) the target features drafters read are queued per request and handed
              over the next time the request drafts; the drafter's `on_commit`; speculation statistics.
    observe:  the step's `StepRecord` to the policy, the only thing it learns from.

The drafter's capabilities are its class's typed attributes (`drafters.base.Drafter`); nothing here
asks which drafter it is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from specserve.budget import BudgetPolicy, RequestStepRecord, StaticBudget, StepRecord
from specserve.drafters.base import CommitInfo, DraftRequest, Drafter
from specserve.request import Request
from specserve.runner import StepForward
from specserve.scheduler import ScheduledStep
from specserve.step_hooks import StepHooks
from specserve.verify import DraftTree, VerifyResult

log = logging.getLogger("specserve")

_EMPTY = DraftTree.empty()


@dataclass(frozen=True)
class Proposal:
    """What the step verifies for its decodes (`ScheduledStep.decodes` order).

    trees:     the trees to verify (forced chains, the policy's cut of the drafter's trees, or empty).
    budgets:   nodes the policy allowed each (0 for forced trees and plain decoding).
    predicted: the policy's predicted accepted length of each tree (None: no prediction).
    depth:     the plan's tree depth (0 when nobody drafted).
    draft_s:   wall time of drafting (forced tokens, the drafter, tree filters; not the plan or the cut).
    drafted_at: `time.perf_counter()` when drafting ended (the step's verify time counts from it).
    caught_up: ids of requests whose drafter caught up without drafting (`Speculator.drafter_kv_lag_limit`).
    """

    trees: list[DraftTree]
    budgets: list[int]
    predicted: list[float | None]
    depth: int
    draft_s: float
    drafted_at: float
    caught_up: frozenset[str] = frozenset()


class Speculator:
    """drafter: None for plain decoding; policy: how much each request drafts (default: the drafter's
    own budget, static); hooks: the engine's step hooks (forced tokens, draft masks, tree filters);
    max_forced_tokens: the most forced tokens per step (reserved past each request's root);
    capture_layers: target layers whose committed rows requests asking for them
    (`SamplingParams.return_hidden_states`) keep — the same rows the drafter's features are."""

    def __init__(self, drafter: Drafter | None, hooks: StepHooks, vocab_size: int, max_forced_tokens: int,
                 policy: BudgetPolicy | None = None, capture_layers: tuple[int, ...] = ()) -> None:
        self.drafter = drafter
        self.hooks = hooks
        self.vocab_size = vocab_size
        self.max_forced_tokens = max_forced_tokens
        self.max_budget = drafter.max_budget if drafter is not None else 0
        self.policy: BudgetPolicy = policy or StaticBudget(self.max_budget)
        self.drafter_layers = tuple(drafter.hidden_layers) if drafter is not None and drafter.needs_hidden_states else ()
        self.capture_layers = tuple(capture_layers)
        # What the forward returns: the drafter's layers and the captured ones.
        self.hidden_layers = tuple(sorted(set(self.drafter_layers) | set(self.capture_layers)))
        # Cache slots a request reserves past its root: the largest tree, the drafter's own levels, forced tokens.
        self.slots_past_root = max(self.max_budget, drafter.kv_slots_past_root if drafter else 0, max_forced_tokens)
        # Target features of committed tokens not yet handed to the drafter: per request, one dict
        # {layer: float[rows, hidden]} per step. A request at budget 0 keeps them queued and hands them all
        # over when it next drafts, so plain decoding pays no drafter work per step.
        self._features: dict[str, list[dict[int, torch.Tensor]]] = {}
        # Fault isolation: drafter calls that raised; ids of requests the drafter is done with.
        self.drafter_failures = 0
        self._drafter_off: set[str] = set()
        # Prefix caching offers a block to drafting requests only with the drafter's own KV entries in it
        # (specserve/prefix_cache.py). A request the policy keeps from drafting would leave them unwritten, and
        # the next turn of its chat would find none of its history cached: 288 of 5,214 prompt tokens over a
        # 10-turn chat with a draft model, TTFT 2.8 s by turn 10 (BENCHMARKS.md). So once a request's drafter
        # entries lag this many tokens behind its KV, the drafter catches up without drafting: one batched
        # forward per block of tokens. 0: never (the engine sets its block size when prefix caching is on and
        # the drafter keeps KV).
        self.drafter_kv_lag_limit = 0

    def check_parts(self, parts: tuple[str, ...] | None) -> None:
        """ValueError unless ``parts`` (a request's choice among a hybrid drafter's parts) are parts of it."""
        if parts is None:
            return
        names = self.drafter.part_names if self.drafter is not None else ()
        if not parts or any(p not in names for p in parts):
            raise ValueError(f"drafter parts {list(parts)} are not parts of this engine's drafter "
                             f"({self.drafter.name if self.drafter else 'none'}; parts: {list(names)})")

    # ---- before the forward ---------------------------------------------------------------------

    def propose(self, step: ScheduledStep) -> Proposal:
        for chunk in step.prefills:
            if chunk.start == chunk.request.num_cached_tokens > 0:  # a prefix-cache hit's first chunk
                self._start_from_prefix(chunk.request)
        decodes = step.decodes
        budgets, depth = list(step.caps), None
        fixed_rows = len(decodes) + step.num_prefill_tokens
        if decodes and self.max_budget:
            plan = self.policy.plan(decodes, fixed_rows)
            budgets, depth = [min(b, cap) for b, cap in zip(plan.budgets, step.caps)], plan.depth
        t0 = time.perf_counter()
        trees = [_EMPTY] * len(decodes)
        for i, r in enumerate(decodes):
            if not (r.rules or self.hooks.forced_tokens):
                continue
            forced = self.hooks.forced(r)[: min(self.max_forced_tokens, r.tokens_after_bonus)]
            if forced:
                trees[i], budgets[i] = DraftTree.chain(forced), 0
        drafting = [i for i, b in enumerate(budgets) if b > 0]
        if self.drafter is not None and drafting:
            proposed = self._draft([decodes[i] for i in drafting], [budgets[i] for i in drafting], depth)
            if proposed is None:  # the drafter failed: these requests verify the empty tree
                for i in drafting:
                    budgets[i] = 0
            else:
                for i, tree in zip(drafting, proposed):
                    trees[i] = self.hooks.filter_tree(decodes[i], tree)
        caught_up = self._keep_drafter_kv_current(decodes)
        drafted_at = time.perf_counter()
        predicted: list[float | None] = [None] * len(decodes)
        if decodes:
            cut, predicted = self.policy.cut(decodes, trees, budgets, fixed_rows, drafted_at - t0)
            for tree, before in zip(cut, trees):
                if tree.num_nodes > before.num_nodes:
                    raise RuntimeError("the budget policy's cut added nodes to a tree")
            trees, predicted = list(cut), list(predicted)
        depth = self._draft_depth(depth) if any(budgets) else 0
        return Proposal(trees, budgets, predicted, depth, drafted_at - t0, drafted_at, caught_up)

    def _view(self, r: Request) -> DraftRequest:
        """What the drafter sees of a request; hands over its queued target features."""
        return DraftRequest(r.request_id, r.token_ids, r.params.temperature, self._take_features(r.request_id),
                            r.params.seed, self.hooks.draft_mask(r), r.drafter_parts, self.hooks.draft_logits(r))

    def _draft(self, reqs: list[Request], budgets: list[int], depth: int | None) -> list[DraftTree] | None:
        """The drafter's trees for the requests drafting this step; None when it raised (they are then
        done with the drafter and decode plainly)."""
        views = [self._view(r) for r in reqs]
        try:
            proposed = self.drafter.propose(views, budgets, depth=depth)
        except Exception:
            self._drafter_failed(reqs, "propose")
            return None
        for tree, budget in zip(proposed, budgets):
            if tree.num_nodes > budget:
                raise RuntimeError(f"drafter {self.drafter.name!r} proposed {tree.num_nodes} nodes over a "
                                   f"budget of {budget}")
            if tree.num_nodes and int(tree.tokens.max()) >= self.vocab_size:
                raise RuntimeError(f"drafter {self.drafter.name!r} proposed token ids outside the vocabulary")
        return list(proposed)

    def _keep_drafter_kv_current(self, decodes: list[Request]) -> frozenset[str]:
        """Catch the drafter up (`Drafter.catch_up`) on decodes whose drafter KV lags `drafter_kv_lag_limit`
        tokens or more behind their own (those that drafted this step do not, unless a hybrid's costly part sat
        them out); their ids. Its time counts as drafting time."""
        limit = self.drafter_kv_lag_limit
        if not limit or not decodes:
            return frozenset()
        behind = [r for r in decodes if r.speculate and r.request_id not in self._drafter_off
                  and r.num_cached - self.drafter.cached_prefix_len(r.request_id) >= limit]
        if not behind:
            return frozenset()
        try:
            self.drafter.catch_up([self._view(r) for r in behind])
        except Exception:
            self._drafter_failed(behind, "catch_up")
            return frozenset()
        return frozenset(r.request_id for r in behind)

    def _draft_depth(self, plan_depth: int | None) -> int:
        depth = self.drafter.depth
        return min(depth, plan_depth) if plan_depth is not None else depth

    # ---- after the Verifier ---------------------------------------------------------------------

    def commit(self, step: ScheduledStep, out: StepForward, results: list[VerifyResult], row_argmax: torch.Tensor,
               proposal: Proposal) -> None:
        """Queue target features, record statistics and tell the drafter what each decode kept. Called
        once the cache holds the accepted rows (`Request.num_cached` advanced) and before any token is
        emitted (emitting may finish, and release, a request)."""
        hidden = out.hidden  # {layer: float[T, hidden]}
        roots = None
        if hidden and any(not result.num_accepted for result in results[:len(step.decodes)]):
            # A decode that accepted nothing keeps its root's features: gathered once for the batch ([decodes,
            # hidden] per layer), each such request keeping a one-row view (the common plain step costs no
            # per-request copy; a step where every decode accepted a path gathers its own rows below instead).
            index = torch.as_tensor(out.first_rows[:len(step.decodes)], dtype=torch.int64)
            roots = {layer: h[index.to(h.device)] for layer, h in hidden.items()}
        argmax = offsets = None
        if self.drafter is not None and self.drafter.wants_row_argmax and step.decodes:
            argmax = row_argmax.cpu().numpy()  # acceptance's own, for greedy and sampled rows alike
            offsets = np.cumsum([0] + [t.num_nodes + 1 for t in out.trees])
        commits = []
        for j, (r, tree, result, first) in enumerate(zip(step.decodes, out.trees, results, out.first_rows)):
            if hidden and self._keeps_features(r):
                if result.num_accepted:
                    keep = first + np.concatenate([[0], np.asarray(result.accepted_nodes, dtype=np.int64) + 1])
                    self._keep_features(r, {layer: h[torch.from_numpy(keep).to(h.device)] for layer, h in hidden.items()})
                else:
                    self._keep_features(r, {layer: h[j:j + 1] for layer, h in roots.items()})
            r.stats.record(tree, result, proposal.budgets[j], proposal.predicted[j])
            if argmax is not None:
                commits.append(CommitInfo(r.request_id, result, r.num_cached + 1, tree, argmax[offsets[j]:offsets[j + 1]]))
            else:
                commits.append(CommitInfo(r.request_id, result, r.num_cached + 1))
        for chunk, first in zip(step.prefills, out.first_rows[len(step.decodes):]):
            if hidden and self._keeps_features(chunk.request):
                self._keep_features(chunk.request, {layer: h[first:first + chunk.end - chunk.start]
                                                    for layer, h in hidden.items()})
        if self.drafter is None:
            return
        commits = [c for c in commits if c.request_id not in self._drafter_off]
        if commits:
            try:
                self.drafter.on_commit(commits)
            except Exception:
                by_id = {r.request_id: r for r in step.decodes}
                self._drafter_failed([by_id[c.request_id] for c in commits], "on_commit")

    def observe(self, step: ScheduledStep, out: StepForward, results: list[VerifyResult], proposal: Proposal,
                verify_s: float, step_s: float) -> None:
        """Hand the policy what the step cost and earned (prompts that completed verify the empty tree
        with budget 0)."""
        budgets = proposal.budgets + [0] * (len(out.verifying) - len(proposal.budgets))
        self.policy.observe(StepRecord(
            requests=tuple(RequestStepRecord(r.request_id, b, t.num_nodes, t.max_depth, res.num_accepted,
                                             tuple(res.accepted_nodes), r.request_id in proposal.caught_up)
                           for r, b, t, res in zip(out.verifying, budgets, out.trees, results)),
            num_tokens=out.num_tokens,
            num_prefill_tokens=step.num_prefill_tokens,
            draft_s=proposal.draft_s,
            verify_s=verify_s,
            step_s=step_s,
            draft_depth=proposal.depth,
        ))

    def release(self, request: Request) -> None:
        """The request finished or was cancelled: the policy and the drafter forget it."""
        self.policy.release(request.request_id)
        self._features.pop(request.request_id, None)
        if self.drafter is not None and request.request_id not in self._drafter_off:
            try:
                self.drafter.release(request.request_id)
            except Exception:
                self.drafter_failures += 1
                log.exception("drafter %r failed to release %s", self.drafter.name, request.request_id)
        self._drafter_off.discard(request.request_id)

    # ---- prefix caching -------------------------------------------------------------------------

    def _start_from_prefix(self, r: Request) -> None:
        """The request's first `num_cached_tokens` KV entries came from the prefix cache: a drafter that
        keeps KV starts from there too (the cache offered only blocks whose drafter entries are valid) and
        catches up over the rest; the target features of the rest come from its prefill rows."""
        if self.drafter is not None and r.speculate:
            self.drafter.start_from_prefix(r.request_id, r.num_cached_tokens)

    def drafter_cached(self, r: Request) -> int:
        """Leading cache slots of the request whose drafter entries are valid (0: none, or no drafter)."""
        if self.drafter is None or not r.speculate or r.request_id in self._drafter_off:
            return 0
        return self.drafter.cached_prefix_len(r.request_id)

    # ---- target features ------------------------------------------------------------------------

    def _keeps_features(self, r: Request) -> bool:
        """Its committed rows' features go somewhere: its drafter reads them, or it asked for them."""
        return (r.speculate and bool(self.drafter_layers)) or r.hidden_states is not None

    def _keep_features(self, r: Request, rows: dict[int, torch.Tensor]) -> None:
        """rows {layer: float[rows, hidden]} (every layer the forward returned) of tokens the step committed,
        in token order: queued for the drafter and kept for the request, each its own layers."""
        if r.speculate and self.drafter_layers:
            self._features.setdefault(r.request_id, []).append({layer: rows[layer] for layer in self.drafter_layers})
        if r.hidden_states is not None:
            r.hidden_states.append({layer: rows[layer] for layer in self.capture_layers})

    def _take_features(self, request_id: str) -> dict[int, torch.Tensor] | None:
        """Every queued feature row of a request, in token order ({layer: [rows, hidden]}), handed over once."""
        steps = self._features.pop(request_id, None)
        if not steps:
            return None
        if len(steps) == 1:
            return steps[0]
        return {layer: torch.cat([s[layer] for s in steps]) for layer in steps[0]}

    # ---- fault isolation ------------------------------------------------------------------------

    def _drafter_failed(self, reqs: list[Request], what: str) -> None:
        """A drafter call raised (called from its except block): log it once, count it, and turn
        speculation off for the requests it touched — they go on decoding plainly (the same greedy
        output), are released from the drafter and never handed to it again."""
        self.drafter_failures += 1
        log.exception("drafter %r failed in %s; %d request(s) go on without speculation: %s", self.drafter.name,
                      what, len(reqs), ", ".join(r.request_id for r in reqs[:8]) + (" ..." if len(reqs) > 8 else ""))
        for r in reqs:
            r.speculate = False
            self._features.pop(r.request_id, None)
            if r.request_id in self._drafter_off:
                continue
            self._drafter_off.add(r.request_id)
            try:
                self.drafter.release(r.request_id)
            except Exception:  # already counted and logged: the failure that brought us here
                pass
