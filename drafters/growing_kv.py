"""A paged KV cache for drafters that run their own model (draft model, EAGLE head).

The engine's cache reserves each request's lifetime up front; a drafter does not know lengths in
advance, so its sequences and pool grow on demand instead.
"""

from __future__ import annotations

import itertools
import logging

import torch

from specserve.kv_cache import PagedKVCache
from specserve.model import LlamaModel

log = logging.getLogger("specserve")


class GrowingKV:
    """A `PagedKVCache` whose sequences and pool grow on demand (doubling; copies happen rarely).

    Sequences are keyed by request id; a sequence that outgrows its blocks is re-allocated under a
    fresh cache key and its cached entries are copied over.
    """

    def __init__(self, model: LlamaModel, block_size: int = 16, initial_slots: int = 8192) -> None:
        cfg = model.config
        self._shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self.device, self.dtype, self.block_size = model.device, model.dtype, block_size
        self.cache = self._new_cache(-(-initial_slots // block_size))
        self.keys: dict[str, str] = {}
        self._ids = itertools.count()

    def _new_cache(self, num_blocks: int) -> PagedKVCache:
        layers, kv_heads, head_dim = self._shape
        return PagedKVCache(layers, kv_heads, head_dim, num_blocks, self.block_size, self.device, self.dtype)

    def ensure(self, request_id: str, need: int, keep: int) -> str:
        """The cache key of a sequence with room for ``need`` slots whose first ``keep`` entries are kept."""
        key = self.keys.get(request_id)
        if key is not None and self.cache.capacity(key) >= need:
            return key
        old_capacity = self.cache.capacity(key) if key is not None else 0
        new_key = f"{request_id}#{next(self._ids)}"
        slots = max(need, 2 * old_capacity, 4 * self.block_size)
        if not self.cache.allocator.can_allocate(slots):
            self._grow_pool(slots)
        self.cache.allocate(new_key, slots)
        if key is not None:
            if keep:
                index = torch.arange(keep, device=self.device)
                self.cache.move(self.cache.slots(key, index), self.cache.slots(new_key, index))
            self.cache.free(key)
        self.keys[request_id] = new_key
        return new_key

    def _grow_pool(self, extra_slots: int) -> None:
        old = self.cache
        used = old.allocator.num_blocks - old.allocator.num_free_blocks
        blocks = max(2 * old.allocator.num_blocks, used + old.allocator.blocks_for(extra_slots))
        new = self._new_cache(blocks)
        for key in self.keys.values():
            capacity = old.capacity(key)
            new.allocate(key, capacity)
            k, v = old.read(key, capacity)
            phys = new.slots(key, torch.arange(capacity, device=self.device))
            new.k[:, phys] = k
            new.v[:, phys] = v
        self.cache = new
        log.info("drafter KV pool grown to %d blocks", blocks)

    def free(self, request_id: str) -> None:
        key = self.keys.pop(request_id, None)
        if key is not None:
            self.cache.free(key)
