"""Random StepBatches of every kind the engine builds, and a float64 reference of their attention.

Shared by the attention kernels' tests (the CPU kernel, the Triton kernel): batches mix prompt chunks
(causal), single decode tokens, verify trees (ancestor masks, positions committed_len + depth) and
drafter levels with "tail" masks over cached entries, on block tables scattered over the pool.
"""

from __future__ import annotations

import math

import numpy as np

from specserve.kv_cache import BlockAllocator
from specserve.step_batch import StepBatchBuilder


CONFIGS = {  # name -> heads, kv_heads, head_dim, sliding window, block size
    "gqa2-hd16-bs4": (4, 2, 16, None, 4),
    "gqa3-hd32-bs2": (6, 2, 32, None, 2),
    "mha-hd16-window3": (4, 4, 16, 3, 4),
    "gqa4-hd16-window6-bs8": (8, 2, 16, 6, 8),
    "gqa2-hd48-window1": (2, 1, 48, 1, 4),
    "gqa3-hd64-bs16": (9, 3, 64, None, 16),  # the default model's attention (SmolLM2-135M)
}


def _tree_mask(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A random tree over n new tokens (token 0 the root): ancestor mask [n, n] and depths [n]."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    mask = np.eye(n, dtype=bool)
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return mask, depth


def random_batch(rng, allocator: BlockAllocator, num_seqs: int, max_cached: int = 24):
    """Sequences of random kinds on `allocator` (blocks scattered); returns the StepBatch."""
    # Scatter the free list: take every block, give them back in random order.
    for i in range(allocator.num_free_blocks):
        allocator.allocate(f"pad{i}", 1)
    for i in rng.permutation(len(allocator.tables)):
        allocator.free(f"pad{i}")
    builder = StepBatchBuilder(allocator)
    for b in range(num_seqs):
        kind = ["chunk", "decode", "tree", "tail"][b % 4] if b < 4 else str(rng.choice(["chunk", "decode", "tree", "tail"]))
        cached = int(rng.integers(1 if kind == "tail" else 0, max_cached))
        n = 1 if kind == "decode" else int(rng.integers(1, 8))
        positions = mask = None
        if kind == "tree":
            mask, depth = _tree_mask(rng, n)
            positions = cached + depth
        elif kind == "tail":
            tail = int(rng.integers(1, min(cached, 5) + 1))
            own, depth = _tree_mask(rng, n)
            mask = np.concatenate([rng.random((n, tail)) < 0.5, own], axis=1)
            positions = cached - tail + 1 + depth + int(rng.integers(0, 2))
        allocator.allocate(f"s{b}", cached + n)
        builder.add(f"s{b}", cached, rng.integers(0, 50, n), positions, mask)
    return builder.build()


def reference(batch, q, k_cache, v_cache, window) -> np.ndarray:
    """float64 attention of every row from the StepBatch semantics; k_cache/v_cache hold this step's K/V."""
    T, H, D = q.shape
    group = H // k_cache.shape[1]
    out = np.zeros((T, H, D))
    for t in range(T):
        b = int(batch.token_seq[t])
        row0, n = int(batch.cu_query_lens[b]), int(batch.cu_query_lens[b + 1] - batch.cu_query_lens[b])
        context = int(batch.context_lens[b])
        cached, i, width = context - n, t - row0, int(batch.mask_widths[b])
        offset = int(batch.mask_offsets[b])
        visible = []
        for j in range(context):
            col = j - (context - width)
            if col >= 0:
                if offset >= 0:
                    if not batch.tree_mask[offset + i * width + col]:
                        continue
                elif col > i:  # causal among the new tokens (width == n without a mask)
                    continue
            key_pos = j if j < cached else int(batch.positions[row0 + j - cached])
            if window is not None and int(batch.positions[t]) - key_pos >= window:
                continue
            visible.append(j)
        table = batch.block_tables[b]
        slots = [int(table[j // batch.block_size]) * batch.block_size + j % batch.block_size for j in visible]
        for h in range(H):
            keys = k_cache[slots, h // group].astype(np.float64)
            values = v_cache[slots, h // group].astype(np.float64)
            scores = keys @ q[t, h].astype(np.float64) / math.sqrt(D)
            p = np.exp(scores - scores.max())
            out[t, h] = p @ values / p.sum()
    return out


