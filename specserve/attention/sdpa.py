"""The ``sdpa`` attention backend: the reference everywhere, and the CPU path for models the kernels skip.

It gathers each sequence's keys into a padded batch and calls torch's scaled_dot_product_attention with
a boolean mask built from the StepBatch with batched tensor ops (no loop over sequences). Shapes follow
the batch (padded to its longest context), so it cannot be replayed from a CUDA graph: the ``triton``
backend is the CUDA default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kv_cache import PagedKVCache
from specserve.step_batch import StepBatch


@dataclass
class SdpaMetadata:
    """Device tensors built once per forward and shared by every layer.

    slot_mapping: int64[T]          physical cache slot of each new token.
    kv_slots:     int64[B, L]       physical slots each sequence attends to, padded (L = max keys).
    mask:         bool[B, 1, Q, L]  or None when every query sees every key (a lone decode token).
    q_index:      int64[B, Q]       row feeding each padded query slot (padding repeats a real row).
    out_index:    int64[T]          position in the flattened [B*Q] output of each new token.
    """

    slot_mapping: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    q_index: torch.Tensor
    out_index: torch.Tensor
    batch: int
    max_queries: int


class SdpaBackend:
    name = "sdpa"

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    def prepare(self, batch: StepBatch, cache: PagedKVCache) -> SdpaMetadata:
        d = batch.device_arrays(cache.device)
        B, Q, L = batch.num_seqs, batch.max_query_len, batch.max_context_len
        device = cache.device
        qlen = d.cu_query_lens[1:] - d.cu_query_lens[:-1]  # [B]
        q_local = torch.arange(Q, device=device)  # [Q]
        real_q = q_local[None, :] < qlen[:, None]  # [B, Q]
        q_rows = d.cu_query_lens[:-1, None] + q_local[None, :]  # [B, Q]
        q_index = torch.where(real_q, q_rows, d.cu_query_lens[:-1, None])
        key = torch.arange(L, device=device)  # [L] slot index of each key column
        bs = batch.block_size
        blocks = d.block_tables.gather(1, (key // bs).clamp(max=d.block_tables.shape[1] - 1).expand(B, L))
        kv_slots = blocks * bs + key % bs  # [B, L]
        ctx = d.context_lens  # [B]
        cached = ctx - qlen  # [B] entries before this step's tokens
        # The last `width` keys are governed by the sequence's mask (causal when it has none).
        is_tree = d.mask_offsets >= 0
        width = d.mask_widths
        col = key[None, None, :] - (ctx - width)[:, None, None]  # [B, 1, L] column in the mask
        in_tail = col >= 0
        causal_ok = col <= q_local[None, :, None] + (width - qlen)[:, None, None]  # [B, Q, L]
        visible = in_tail.logical_not() | causal_ok
        if bool(is_tree.any()):
            flat = (d.mask_offsets[:, None, None] + q_local[None, :, None] * width[:, None, None] + col)
            flat = flat.clamp(0, max(d.tree_mask.numel() - 1, 0))
            tree_ok = d.tree_mask[flat] if d.tree_mask.numel() else torch.zeros_like(causal_ok)
            visible = torch.where(is_tree[:, None, None] & in_tail, tree_ok, visible)
        visible &= key[None, None, :] < ctx[:, None, None]
        if self.sliding_window is not None:
            # Cached key j sits at position j (committed in order); new keys at their own positions.
            new_pos = d.positions[(d.cu_query_lens[:-1, None] + (key[None, :] - cached[:, None])).clamp(0, batch.num_tokens - 1)]
            key_pos = torch.where(key[None, :] < cached[:, None], key[None, :], new_pos)  # [B, L]
            q_pos = d.positions[q_index]  # [B, Q]
            visible &= (q_pos[:, :, None] - key_pos[:, None, :]) < self.sliding_window
        visible &= real_q[:, :, None]
        visible[:, :, 0] |= ~real_q  # padded queries see one key so softmax stays finite
        lone_decode = B == 1 and Q == 1 and self.sliding_window is None
        out_index = (d.token_seq * Q + (torch.arange(batch.num_tokens, device=device) - d.cu_query_lens[d.token_seq]))
        return SdpaMetadata(
            slot_mapping=d.slot_mapping,
            kv_slots=kv_slots,
            mask=None if lone_decode else visible[:, None],
            q_index=q_index,
            out_index=out_index,
            batch=B,
            max_queries=Q,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SdpaMetadata,
               cache: PagedKVCache) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] → output [T, heads * head_dim].

        Writes this step's k/v into the cache first, then attends over cached + new entries.
        """
        cache.k[layer][meta.slot_mapping] = k.to(cache.k.dtype)  # rounded where the cache stores fewer bits
        cache.v[layer][meta.slot_mapping] = v.to(cache.v.dtype)
        # [B, kv_heads, L, head_dim], widened to q's dtype where the cache stores fewer bits (a float16 cache)
        keys = cache.k[layer][meta.kv_slots].transpose(1, 2).to(q.dtype)
        values = cache.v[layer][meta.kv_slots].transpose(1, 2).to(q.dtype)
        queries = q[meta.q_index].transpose(1, 2)  # [B, heads, Q, head_dim]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.mask, enable_gqa=q.shape[1] != k.shape[1]
        )  # [B, heads, Q, head_dim]
        out = out.transpose(1, 2).reshape(meta.batch * meta.max_queries, -1)
        return out[meta.out_index]


