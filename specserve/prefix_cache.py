"""Automatic prefix caching: full KV blocks keyed by their tokens and everything before them.

A request whose prompt starts with blocks some earlier request computed takes those blocks into its own
block table (reference-counted by the `BlockAllocator`) and its prefill starts at its first uncached
token. Blocks stay cached after their requests end, until their space is needed: unreferenced cached
blocks are *evictable*, counted as free at admission and reused least recently used first, so caching
never shrinks the KV available to running requests.

Keys: a hash chain. Block j of a sequence is keyed by ``blake2b-128(key of block j-1 || its B token
ids)``, so a key names the block's tokens and its whole prefix. Why a chain and not a radix tree: the unit
shared is a whole block, so matching is one dict lookup per block of the prompt (a few microseconds for a
long system prompt), registering is one insert per block filled, and eviction drops one key — there is no
tree to split or rebalance. The price: a block whose parent was evicted is unreachable until it is evicted
itself (the allocator evicts a freed prefix's tail before its head, which keeps that rare). The block's
tokens and parent key are stored and compared on every hit, so a false hit would need a collision of the
128-bit parent key itself.

What the key leaves out: the cache lives in one `Engine` — one model, one dtype, one block size, one
drafter — and dies with it, so nothing that changes what a KV entry means (weights, dtype, RoPE scaling)
can change under it; a different model or dtype is a different `LLM` with an empty cache.

Copy-on-write: only *full blocks of committed tokens* are shared, and a hit ends at least one token before
the prompt does (the last prompt token is always computed: its logits give the first output token). Every
write a request makes — prefill chunks, the root and verify tree rows, commit moves, a drafter's catch-up
and tree levels — lands at or past its own committed length, so past its shared blocks: no write ever
lands in a shared block, and nothing is ever copied (tensor-parallel ranks therefore need no extra
message: they run the same forwards on the same block tables).

Drafters with their own KV (draft model, EAGLE head: `Drafter.kv_bytes_per_slot() > 0`) keep it in the
same blocks. A block is offered to requests that will draft only when the drafter's entries in it are
valid too: the request that filled it had its drafter caught up past it (`Drafter.cached_prefix_len`). A
drafter the budget policy keeps from drafting still catches up within a block of the request's tokens
(`Speculator.drafter_kv_lag_limit`), so a chat's next turn finds its history cached whether or not it drafted.
An entry may depend on tokens after its block (EAGLE's pair at slot i is (feature i, token i+1):
`Drafter.kv_lookahead`); those tokens are stored with the block and must match the new prompt's. A hit
then tells the drafter where its own entries start (`Drafter.start_from_prefix`), and it catches up over
the uncached suffix only; the target features EAGLE needs for that suffix come from the suffix's own
prefill rows. Requests that never draft (speculate=False) take any cached block.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specserve.kv_cache import BlockAllocator


@dataclass
class _Entry:
    block: int
    parent: bytes  # key of the previous block (b"" for a sequence's first block)
    tokens: bytes  # the block's token ids (int64), compared on every hit
    # The drafter's entries in the block are valid given these following tokens (b"" when they depend on
    # none); None: not valid (the filling request's drafter never caught up past the block).
    drafter_tail: bytes | None


@dataclass
class _Sequence:
    """What the cache tracks of one live request."""

    keys: list[bytes] = field(default_factory=list)  # chain keys of its leading blocks computed so far
    registered: int = 0  # its first `registered` blocks were offered to the cache
    drafter_ok: int = 0  # ... and the first `drafter_ok` with valid drafter entries


class PrefixCache:
    """The key → block index over one `BlockAllocator`, and its hit statistics.

    drafter_lookahead: None when the engine's drafter keeps no KV of its own (blocks then only hold target
    KV); else `Drafter.kv_lookahead` (see the module docstring).
    """

    def __init__(self, allocator: BlockAllocator, drafter_lookahead: int | None) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.drafter_lookahead = drafter_lookahead
        self._by_key: dict[bytes, _Entry] = {}
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._seqs: dict[str, _Sequence] = {}
        allocator.on_evict = self._evicted
        self.queried_tokens = 0  # prompt tokens of admitted requests
        self.hit_tokens = 0  # of which came from the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # ---- admission ----------------------------------------------------------------------------------

    def match(self, request_id: str, prompt: np.ndarray, drafts: bool) -> list[int]:
        """The cached blocks a prompt (int64[P]) starts with, at most (P - 1) // B of them (the last prompt
        token is always computed). drafts: the request will draft with a drafter that keeps KV, so only
        blocks whose drafter entries are valid for this prompt count."""
        seq = self._seqs.setdefault(request_id, _Sequence())
        limit = (len(prompt) - 1) // self.block_size
        self._extend_keys(seq, prompt, limit)
        need_drafter = drafts and self.drafter_lookahead is not None
        blocks = []
        for j in range(limit):
            entry = self._by_key.get(seq.keys[j])
            if entry is None or entry.tokens != self._block_tokens(prompt, j) or \
                    entry.parent != (seq.keys[j - 1] if j else b""):
                break
            if need_drafter and entry.drafter_tail != self._tail(prompt, j):
                break
            blocks.append(entry.block)
        return blocks

    def admitted(self, request_id: str, prompt_len: int, blocks: list[int]) -> None:
        """The request was admitted with `blocks` (from `match`) at the head of its table."""
        seq = self._seqs.setdefault(request_id, _Sequence())
        seq.registered = seq.drafter_ok = len(blocks)
        self.queried_tokens += prompt_len
        self.hit_tokens += len(blocks) * self.block_size

    # ---- after each step ----------------------------------------------------------------------------

    def commit(self, request_id: str, tokens: np.ndarray, num_committed: int, drafter_tokens: Callable[[], int]) -> None:
        """Offer the request's newly filled blocks to the cache.

        tokens: int64[L], its prompt and output so far; num_committed: tokens whose KV is in its blocks
        (slots 0..num_committed-1, final; may run ahead of L within a step); drafter_tokens: how many
        leading slots have valid drafter entries (`Drafter.cached_prefix_len`), asked only when a block
        could be offered or upgraded (ignored when the drafter keeps no KV).
        """
        seq = self._seqs.get(request_id)
        table = self.allocator.tables.get(request_id)
        if seq is None or table is None:  # a request finishing before it was admitted
            return
        b = self.block_size
        # Accepted draft tokens are in the cache before they are appended to `tokens` (the engine commits,
        # then emits): only blocks whose tokens are known yet can be keyed.
        full = min(num_committed, len(tokens)) // b
        if full <= seq.registered and seq.drafter_ok >= seq.registered:
            return  # the common decode step: no block boundary crossed, nothing left to upgrade
        if self.drafter_lookahead is None:
            drafter_full = full
        else:  # its entries in block j may read tokens up to (j+1)B - 1 + lookahead
            drafter_full = min(full, drafter_tokens() // b, (len(tokens) - self.drafter_lookahead) // b)
        if full <= seq.registered and drafter_full <= seq.drafter_ok:
            return  # the common decode step: no block boundary crossed
        self._extend_keys(seq, tokens, full)
        # Upgrades first (blocks offered earlier whose drafter entries became valid), then new blocks.
        for j in itertools.chain(range(seq.drafter_ok, min(drafter_full, seq.registered)), range(seq.registered, full)):
            tail = self._tail(tokens, j) if j < drafter_full else None
            self._offer(seq.keys[j], seq.keys[j - 1] if j else b"", int(table[j]), self._block_tokens(tokens, j), tail)
        seq.registered = max(seq.registered, full)
        seq.drafter_ok = max(seq.drafter_ok, drafter_full)

    def release(self, request_id: str) -> None:
        """The request finished (call before its blocks are freed)."""
        self._seqs.pop(request_id, None)

    def clear(self) -> None:
        """Forget every cached block (unreferenced ones become free at once)."""
        for block in list(self._key_of):
            self.allocator.uncache(block)
        self._by_key.clear()
        self._key_of.clear()

    # ---- internals ----------------------------------------------------------------------------------

    def _offer(self, key: bytes, parent: bytes, block: int, tokens: bytes, tail: bytes | None) -> None:
        entry = self._by_key.get(key)
        if entry is not None and entry.block == block:
            if entry.drafter_tail is None:
                entry.drafter_tail = tail
            return
        if entry is not None:
            if tail is None or entry.drafter_tail is not None:
                return  # the cached copy is as good as ours: ours stays private and is freed with its request
            # Same tokens, but ours has valid drafter entries: it replaces the cached copy.
            del self._key_of[entry.block]
            self.allocator.uncache(entry.block)
        self._by_key[key] = _Entry(block, parent, tokens, tail)
        self._key_of[block] = key
        self.allocator.mark_cached(block)

    def _evicted(self, block: int) -> None:
        """The allocator reused an evictable block: its key goes."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._by_key[key]

    def _extend_keys(self, seq: _Sequence, tokens: np.ndarray, num_blocks: int) -> None:
        for j in range(len(seq.keys), num_blocks):
            parent = seq.keys[j - 1] if j else b""
            seq.keys.append(hashlib.blake2b(parent + self._block_tokens(tokens, j), digest_size=16).digest())

    def _block_tokens(self, tokens: np.ndarray, j: int) -> bytes:
        return _token_bytes(tokens, j * self.block_size, (j + 1) * self.block_size)

    def _tail(self, tokens: np.ndarray, j: int) -> bytes:
        """The tokens after block j that drafter entries in it depend on (b"" without a drafter lookahead)."""
        start = (j + 1) * self.block_size
        return _token_bytes(tokens, start, start + (self.drafter_lookahead or 0))


def _token_bytes(tokens: np.ndarray, start: int, stop: int) -> bytes:
    return np.ascontiguousarray(tokens[start:stop], dtype=np.int64).tobytes()
