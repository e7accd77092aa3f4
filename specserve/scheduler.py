"""Who runs this step: admission, KV reservation, prefill chunks, and each decoding request's hard cap
on draft nodes (the Speculator's budget policy decides within it).

Every running request whose prompt is in the cache decodes every step (with a tree sized by the
Speculator, 0 = plain). Prompts are prefilled in chunks: at most `max_prefill_tokens` prompt tokens
per step, partially prefilled requests first, then newly admitted ones (first come, first served), so a
long prompt never stalls everyone else's next token for more than one chunk's time.

Admission is fair across clients: the next request admitted is the oldest waiting one of a client with
the fewest requests running (`Request.client`: a websocket session, an API user or an HTTP connection; requests without one are
each their own client, so plain FIFO for `LLM.generate`). One client queueing a burst of long requests
then delays another client's request by at most its share of the batch, not by the whole burst.

A few batch slots (`newcomer_slots`, an eighth of the batch) are kept for clients with nothing running:
a client that already runs a request is not admitted into them. A burst from one client therefore never
fills the batch to the last slot, and the next client to arrive is admitted at the next step instead
of waiting for someone's request to finish (in the soak, the well-behaved clients' p99 wait for a
slot fell from ~200 ms to one step).

Admission reserves every KV block a request can ever need (prompt + max_tokens + room past its root
for the largest tree — the target's, the drafter's own levels, forced tokens), so a running request
never fails for lack of cache; when the pool is short the queue waits.

With prefix caching (specserve/prefix_cache.py) admission first looks the prompt up: the cached blocks it
starts with head its block table (shared, not copied), only the rest are fresh, and its prefill starts at
its first uncached token. Evictable cached blocks count as free, so a cache never keeps a request out.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specserve.kv_cache import BlockAllocator
from specserve.prefix_cache import PrefixCache
from specserve.request import Request, Status


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``start .. end - 1`` of a request go through the forward this step."""

    request: Request
    start: int
    end: int

    @property
    def completes_prompt(self) -> bool:
        """The last chunk: its last row's logits give the request's first token."""
        return self.end == self.request.prompt_len


@dataclass(frozen=True)
class ScheduledStep:
    """prefills: this step's prompt chunks; decodes: requests verifying a tree (possibly empty);
    caps: per decode, the most draft nodes it may verify — the drafter's maximum, and the tokens it may
    still emit after the bonus token; 0 for a request that decodes plainly."""

    prefills: list[PrefillChunk]
    decodes: list[Request]
    caps: list[int]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.end - c.start for c in self.prefills)


class Scheduler:
    """Owns the waiting queue and the running batch.

    slots_past_root: cache slots a request reserves past its root (largest tree or drafter levels).
    prefix_cache: where admission looks prompts up (None: prefix caching is off).
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_prefill_tokens: int, slots_past_root: int,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.slots_past_root = slots_past_root
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Slots only a client with nothing running may take (see the module docstring).
        self.newcomer_slots = max(1, max_num_seqs // 8) if max_num_seqs > 1 else 0

    def slots_needed(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots a request reserves at admission: every token it can hold, its root's slot and room
        past the root for its largest tree."""
        return prompt_len + max_tokens + self.slots_past_root + 1

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queue or the batch (finished or cancelled); the caller frees its KV."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_budget: int) -> ScheduledStep:
        """This step's prefill chunks, decodes and their caps. max_budget: the drafter's own cap (0: none)."""
        decodes = [r for r in self.running if r.prefilled]
        tokens_left = self.max_prefill_tokens
        prefills = []
        for r in self.running:  # continue prompts already under way, oldest first
            if not r.prefilled and tokens_left > 0:
                chunk = self._chunk(r, tokens_left)
                prefills.append(chunk)
                tokens_left -= chunk.end - chunk.start
        while self.waiting and len(self.running) < self.max_num_seqs and tokens_left > 0:
            running = self._running_per_client()
            req = self._next_admission(running)
            if len(self.running) >= self.max_num_seqs - self.newcomer_slots and running.get(req.client, 0):
                break  # only newcomers' slots are left, and the fairest waiting client already runs something
            need = self.slots_needed(req.prompt_len, req.max_tokens)
            cached = self._cached_prefix(req)
            if not self.allocator.can_allocate(need, cached):
                break  # the chosen one waits for blocks rather than let others jump ahead of it
            self.waiting.remove(req)
            self.allocator.allocate(req.request_id, need, cached)
            if self.prefix_cache is not None:
                self.prefix_cache.admitted(req.request_id, req.prompt_len, cached)
            # Its prefill starts at its first uncached token (the shared blocks are never written).
            req.num_cached = req.num_cached_tokens = len(cached) * self.allocator.block_size
            req.status = Status.RUNNING
            req.scheduled_time = time.perf_counter()
            self.running.append(req)
            chunk = self._chunk(req, tokens_left)
            prefills.append(chunk)
            tokens_left -= chunk.end - chunk.start
        # The bonus token always comes: a tree may use at most the tokens left after it.
        caps = [max(0, min(max_budget, r.tokens_after_bonus)) if r.speculate else 0 for r in decodes]
        return ScheduledStep(prefills, decodes, caps)

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks the request's prompt starts with (none when caching is off)."""
        if self.prefix_cache is None or req.params.prompt_logprobs is not None or req.params.return_hidden_states:
            return []  # prompt log-probabilities and hidden states need every prompt row: prefill it all
        return self.prefix_cache.match(req.request_id, req.token_ids, drafts=req.speculate)

    def _running_per_client(self) -> dict[str, int]:
        """Requests running per client (requests without a client are each their own: not counted)."""
        running: dict[str, int] = {}
        for r in self.running:
            if r.client is not None:
                running[r.client] = running.get(r.client, 0) + 1
        return running

    def _next_admission(self, running: dict[str, int]) -> Request:
        """The oldest waiting request of a client with the fewest running requests (see the module docstring)."""
        first = self.waiting[0]
        if first.client is None:
            return first
        fewest = running.get(first.client, 0)
        if fewest == 0:
            return first
        best = first
        for r in self.waiting:
            count = 0 if r.client is None else running.get(r.client, 0)
            if count < fewest:
                best, fewest = r, count
                if count == 0:
                    break
        return best

    @staticmethod
    def _chunk(req: Request, tokens_left: int) -> PrefillChunk:
        start = req.num_cached
        return PrefillChunk(req, start, min(req.prompt_len, start + tokens_left))
