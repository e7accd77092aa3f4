"""Paged KV cache: fixed-size blocks, a block table per sequence, a free list.

Memory is accounted up front: a sequence reserves every block it can ever need when it is admitted
(prompt + max new tokens + the largest draft tree), so a running request never fails for lack of
cache, and admission simply waits when the pool is short.

One `BlockAllocator` hands out block ids; every model that keeps KV for a request — the target and a
drafter that runs its own model (draft model, EAGLE head) — has a `PagedKVCache` of the same number of
blocks on that one allocator, so a request's block table addresses its entries in all of them and one
reservation at admission covers both. Nothing grows or copies a pool later.

Storage vs positions: a sequence's *slot index* s (0, 1, 2, ...) is where its s-th cached entry lives.
Committed tokens occupy slot indices 0..committed_len-1; a step writes the root at committed_len and
draft node i at committed_len + 1 + i; commit moves the accepted nodes down next to the root.
"""

from __future__ import annotations

import math

import numpy as np
import torch


class BlockAllocator:
    """Hands out block ids from a free list; one block table (int32 array of block ids) per sequence."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[str, np.ndarray] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_slots: int) -> int:
        return math.ceil(num_slots / self.block_size)

    def can_allocate(self, num_slots: int) -> bool:
        return self.blocks_for(num_slots) <= len(self._free)

    def allocate(self, seq_id: str, num_slots: int) -> np.ndarray:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        need = self.blocks_for(num_slots)
        if need > len(self._free):
            raise MemoryError(f"KV cache: {need} blocks needed, {len(self._free)} free")
        table = np.array([self._free.pop() for _ in range(need)], dtype=np.int32)
        self.tables[seq_id] = table
        return table

    def free(self, seq_id: str) -> None:
        table = self.tables.pop(seq_id, None)
        if table is not None:
            self._free.extend(reversed(table.tolist()))

    def capacity(self, seq_id: str) -> int:
        return len(self.tables[seq_id]) * self.block_size

    def physical_slots(self, seq_id: str, slot_indices: np.ndarray) -> np.ndarray:
        """int64 physical slots of a sequence's slot indices (numpy, any shape)."""
        table = self.tables[seq_id]
        return table[slot_indices // self.block_size].astype(np.int64) * self.block_size + slot_indices % self.block_size


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
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.device = device
        self._layer_arrays: list[tuple[np.ndarray, np.ndarray]] | None = None

    def layer_arrays(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer, numpy views (K, V) [slots, kv_heads, head_dim] of a CPU cache, for the kernels."""
        if self._layer_arrays is None:
            self._layer_arrays = [(self.k[i].numpy(), self.v[i].numpy()) for i in range(self.k.shape[0])]
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
