"""Paged KV cache: fixed-size blocks, a block table per sequence, a free list.

Memory is accounted up front: a sequence reserves every block it can ever need when it is admitted
(prompt + max new tokens + the largest draft tree), so a running request never fails for lack of
cache, and admission simply waits when the pool is short.

One `BlockAllocator` hands out block ids; every model that keeps KV for a request — the target and a
drafter that runs its own model (draft model, EAGLE head) — has a `PagedKVCache` of the same number of
blocks on that one allocator, so a request's block table addresses its entries in all of them and one
reservation at admission covers both. Nothing grows or copies a pool later.

Prefix caching shares full blocks between sequences (reference counts here, keys and policy in
specserve/prefix_cache.py); no write ever lands in a shared block, so nothing is copied on write.

Storage vs positions: a sequence's *slot index* s (0, 1, 2, ...) is where its s-th cached entry lives.
Committed tokens occupy slot indices 0..committed_len-1; a step writes the root at committed_len and
draft node i at committed_len + 1 + i; commit moves the accepted nodes down next to the root.
"""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch


class BlockAllocator:
    """Hands out block ids; one block table (int32 array of block ids) per sequence.

    Blocks are reference-counted so that prefix caching (specserve/prefix_cache.py) can put one block in
    several tables: a block is *free* (unreferenced, holding nothing anyone may want), *referenced* by
    one or more tables, or *evictable* (unreferenced but cached: its KV may serve a later prompt). Fresh
    blocks come from the free list first, then from the evictable ones, least recently used first, so a
    cached block never keeps a running request out: `num_free_blocks` counts evictable blocks as free.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[str, np.ndarray] = {}
        self._refs = np.zeros(num_blocks, dtype=np.int32)  # tables holding each block
        self._cached = np.zeros(num_blocks, dtype=np.bool_)  # a prefix cache indexes it
        self._num_cached = 0  # of `_cached` (read after every step: a count, not a sum over the pool)
        # Cached and unreferenced blocks, least recently used first (the next to be evicted).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Called with a cached block's id when it is evicted for reuse (the prefix cache drops its key).
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence may take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    def blocks_for(self, num_slots: int) -> int:
        return math.ceil(num_slots / self.block_size)

    def can_allocate(self, num_slots: int, shared: Sequence[int] = ()) -> bool:
        """Whether `allocate(..., num_slots, shared)` would succeed: the fresh blocks, plus the shared ones
        that are evictable now (taking them makes them unavailable to others), fit in the free count."""
        return self._blocks_taken(num_slots, shared) <= self.num_free_blocks

    def _blocks_taken(self, num_slots: int, shared: Sequence[int]) -> int:
        fresh = self.blocks_for(num_slots) - len(shared)
        return max(fresh, 0) + sum(1 for b in shared if self._refs[b] == 0)

    def allocate(self, seq_id: str, num_slots: int, shared: Sequence[int] = ()) -> np.ndarray:
        """A block table for `num_slots` slots: the `shared` blocks first (a cached prefix; their
        references grow), then fresh blocks. Raises MemoryError when they do not fit."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        need = self.blocks_for(num_slots)
        if len(shared) > need:
            raise ValueError(f"{len(shared)} shared blocks for a sequence of {need} blocks")
        taken = self._blocks_taken(num_slots, shared)
        if taken > self.num_free_blocks:
            raise MemoryError(f"KV cache: {taken} blocks needed, {self.num_free_blocks} free")
        for b in shared:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        fresh = [self._take() for _ in range(need - len(shared))]
        table = np.array(list(shared) + fresh, dtype=np.int32)
        self.tables[seq_id] = table
        return table

    def _take(self) -> int:
        """One unreferenced block for a sequence's own use: a free one, else the least recently used
        evictable one (its cache entry is dropped first)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._cached[block] = False
            self._num_cached -= 1
            if self.on_evict is not None:
                self.on_evict(block)
        self._refs[block] = 1
        return block

    def free(self, seq_id: str) -> None:
        """Drop a sequence's references. Its last block goes back first, so among a freed table's cached
        blocks the tail of the prefix is evicted before its head (a head serves more prompts)."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for b in reversed(table.tolist()):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._cached[b]:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---- prefix caching: which blocks are cached --------------------------------------------------

    def mark_cached(self, block: int) -> None:
        """A prefix cache indexes `block` (a block some table holds): kept when unreferenced, until evicted."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not held by any sequence: only computed blocks are cached")
        if not self._cached[block]:
            self._cached[block] = True
            self._num_cached += 1

    def uncache(self, block: int) -> None:
        """The prefix cache dropped `block`: unreferenced, it is free at once."""
        if not self._cached[block]:
            return
        self._cached[block] = False
        self._num_cached -= 1
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return int(self._refs[block])

    def check(self) -> None:
        """AssertionError unless the bookkeeping is consistent (tests): each block is exactly one of free,
        referenced (count = tables holding it) or evictable (cached), and nothing is lost."""
        counts = np.zeros(self.num_blocks, dtype=np.int64)
        for table in self.tables.values():
            np.add.at(counts, table, 1)
        assert (counts == self._refs).all(), "reference counts differ from the block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        evictable = set(self._evictable)
        assert not free & evictable, "a block is both free and evictable"
        assert all(self._refs[b] == 0 for b in free | evictable), "a free or evictable block is referenced"
        assert not any(self._cached[b] for b in free), "a free block is still cached"
        assert all(self._cached[b] for b in evictable), "an evictable block is not cached"
        assert self._num_cached == int(self._cached.sum()), "the cached-block count drifted"
        referenced = int((self._refs > 0).sum())
        assert len(free) + len(evictable) + referenced == self.num_blocks, "blocks were lost"

    def capacity(self, seq_id: str) -> int:
        return len(self.tables[seq_id]) * self.block_size

    def physical_slots(self, seq_id: str, slot_indices: np.ndarray) -> np.ndarray:
        """int64 physical slots of a sequence's slot indices (numpy, any shape)."""
        table = self.tables[seq_id]
        return table[slot_indices // self.block_size].astype(np.int64) * self.block_size + slot_indices % self.block_size


def _zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor; on the CPU a fresh anonymous mapping of its own.

    Why a mapping rather than numpy's calloc: the OS hands out a mapping's zeroed pages as they are first written,
    so a 2 GiB cache costs nothing until used (torch.zeros wrote every byte at start-up: 1.8 s of the default
    model's start on 2 cores), and `bench soak` can subtract the pages reached so far (`evals.resident_memory`).
    calloc only promises that while malloc serves the block by a fresh mmap; a block it serves from memory that
    earlier allocations left behind is written whole (CI saw a 48 MiB one arrive resident). A mapping also starts
    on a page boundary, so each key's vector starts on a cache line: paged attention's 32-byte loads straddled two
    lines at every other load from calloc's 16-bytes-past-a-page start, 1.7-1.9x slower (BENCHMARKS.md, "Paged
    attention")."""
    if device.type == "cpu" and dtype in (torch.float32, torch.float16):
        item = np.dtype(np.float32 if dtype == torch.float32 else np.float16)
        count = int(np.prod(shape))
        pages = mmap.mmap(-1, max(count * item.itemsize, 1))  # anonymous, private, zero-filled on first touch
        # The array holds the mapping (its buffer base), and the tensor holds the array: unmapped when both go.
        return torch.from_numpy(np.frombuffer(pages, dtype=item, count=count).reshape(shape))
    return torch.zeros(shape, device=device, dtype=dtype)


class PagedKVCache:
    """K and V of one model's layers: [num_layers, num_blocks * block_size, kv_heads, head_dim] each,
    addressed through the block tables of a (possibly shared) `BlockAllocator`."""

    def __init__(
        self,
        allocator: BlockAllocator,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        shape = (num_layers, allocator.num_blocks * allocator.block_size, num_kv_heads, head_dim)
        self.k, self.v = _zeros(shape, device, dtype), _zeros(shape, device, dtype)
        self.device = device
        self._layer_arrays: list[tuple[np.ndarray, np.ndarray]] | None = None

    def layer_arrays(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer, numpy views (K, V) [slots, kv_heads, head_dim] of a CPU cache, for the kernels: float32, or
        a float16 cache's bits as uint16 (numba has no float16 arrays; the kernels widen them: `simd.vload`)."""
        if self._layer_arrays is None:
            def kernel_view(t: torch.Tensor) -> np.ndarray:
                a = t.numpy()
                return a.view(np.uint16) if a.dtype == np.float16 else a

            self._layer_arrays = [(kernel_view(self.k[i]), kernel_view(self.v[i])) for i in range(self.k.shape[0])]
        return self._layer_arrays

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def slots(self, seq_id: str, slot_indices: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Physical slots (int64, on the cache's device) of a sequence's slot indices."""
        index = slot_indices.cpu().numpy() if isinstance(slot_indices, torch.Tensor) else np.asarray(slot_indices)
        return torch.from_numpy(self.allocator.physical_slots(seq_id, index.astype(np.int64))).to(self.device)

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy entries src → dst in every layer (physical slots, [n] each); reads happen before writes."""
        if src_slots.numel():
            self.k[:, dst_slots] = self.k[:, src_slots]
            self.v[:, dst_slots] = self.v[:, src_slots]

    def read(self, seq_id: str, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of a sequence's first `num_slots` entries: [num_layers, num_slots, kv_heads, head_dim]."""
        phys = self.slots(seq_id, np.arange(num_slots))
        return self.k[:, phys], self.v[:, phys]
