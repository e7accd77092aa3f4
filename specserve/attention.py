"""Attention over the paged cache for a batch of sequences, each bringing new tokens with a tree mask.

A forward step carries, per sequence, `num_new` tokens that see (a) all `num_cached` committed
entries and (b) the new tokens allowed by a boolean mask among themselves: causal for a prompt,
the ancestor mask for a draft tree. Prefill, plain decode and tree verification are all this one case.

Backends are pluggable (`BACKENDS`): `sdpa` gathers each sequence's pages into a padded contiguous
batch and calls torch's scaled_dot_product_attention with a boolean mask — right for CPU and a
correct reference everywhere; a GPU kernel reading pages and tree masks directly slots in beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kv_cache import PagedKVCache


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a forward step (host-side description).

    positions: int64[num_new] RoPE positions of the new tokens.
    new_mask:  bool[num_new, num_new] which new tokens each new token sees (row = query), or None for
               causal order (prompt chunks, chains). It may also be bool[num_new, tail + num_new]:
               then its first `tail` columns are the last `tail` cached entries, which are visible
               only where the mask says — a drafter growing a tree level by level keeps earlier
               levels in its cache and lets each new node see only its own ancestors among them.
    """

    seq_id: str
    num_cached: int
    positions: torch.Tensor
    new_mask: torch.Tensor | None = None

    @property
    def num_new(self) -> int:
        return self.positions.numel()


@dataclass
class AttentionMetadata:
    """Device tensors built once per forward and shared by every layer.

    slot_mapping: int64[T]          physical cache slot of each new token (T = total new tokens).
    kv_slots:     int64[B, L]       physical slots each sequence attends to, padded (L = max keys).
    mask:         bool[B, 1, Q, L]  or None when every query sees every key (a lone decode token).
    q_index:      int64[B, Q]       row of T feeding each padded query slot (padding repeats row 0).
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

    def prepare(self, seqs: list[SequenceSlice], cache: PagedKVCache) -> AttentionMetadata:
        device = cache.device
        batch = len(seqs)
        max_q = max(s.num_new for s in seqs)
        max_k = max(s.num_cached + s.num_new for s in seqs)
        kv_index = torch.zeros(batch, max_k, dtype=torch.int64)
        mask = torch.zeros(batch, 1, max_q, max_k, dtype=torch.bool)
        q_index = torch.zeros(batch, max_q, dtype=torch.int64)
        out_index = []
        new_slot_index = []
        row = 0
        for b, s in enumerate(seqs):
            c, n = s.num_cached, s.num_new
            kv_index[b, : c + n] = torch.arange(c + n)
            new_slot_index.append(torch.arange(c, c + n))
            new_mask = s.new_mask if s.new_mask is not None else torch.ones(n, n, dtype=torch.bool).tril_()
            if new_mask.shape[0] != n or not n <= new_mask.shape[1] <= c + n:
                raise ValueError(f"sequence {s.seq_id!r}: new_mask has shape {tuple(new_mask.shape)}, expected "
                                 f"[{n}, tail + {n}] with tail <= {c} cached entries")
            seen = c + n - new_mask.shape[1]  # cached entries every new token sees
            mask[b, 0, :n, :seen] = True
            mask[b, 0, :n, seen : c + n] = new_mask
            if self.sliding_window is not None and c + n > self.sliding_window:
                key_pos = torch.cat([torch.arange(c), s.positions])
                too_far = (s.positions[:, None] - key_pos[None, :]) >= self.sliding_window
                mask[b, 0, :n, : c + n] &= ~too_far
            mask[b, 0, n:, 0] = True  # padded queries see one key so softmax stays finite
            q_index[b, :n] = torch.arange(row, row + n)
            out_index.append(torch.arange(b * max_q, b * max_q + n))
            row += n

        # Translate per-sequence slot indices to physical slots with one gather per sequence.
        kv_slots = torch.empty(batch, max_k, dtype=torch.int64, device=device)
        slot_mapping = []
        for b, s in enumerate(seqs):
            phys = cache.slots(s.seq_id, kv_index[b].to(device))
            kv_slots[b] = phys
            slot_mapping.append(phys[s.num_cached : s.num_cached + s.num_new])
        lone_decode = batch == 1 and max_q == 1 and self.sliding_window is None
        return AttentionMetadata(
            slot_mapping=torch.cat(slot_mapping),
            kv_slots=kv_slots,
            mask=None if lone_decode else mask.to(device),
            q_index=q_index.to(device),
            out_index=torch.cat(out_index).to(device),
            batch=batch,
            max_queries=max_q,
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] → output [T, heads * head_dim].

        Writes this step's k/v into the cache first, then attends over cached + new entries.
        """
        cache.k[layer][meta.slot_mapping] = k
        cache.v[layer][meta.slot_mapping] = v
        keys = cache.k[layer][meta.kv_slots].transpose(1, 2)  # [B, kv_heads, L, head_dim]
        values = cache.v[layer][meta.kv_slots].transpose(1, 2)
        queries = q[meta.q_index].transpose(1, 2)  # [B, heads, Q, head_dim]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.mask, enable_gqa=q.shape[1] != k.shape[1]
        )  # [B, heads, Q, head_dim]
        out = out.transpose(1, 2).reshape(meta.batch * meta.max_queries, -1)
        return out[meta.out_index]


BACKENDS = {"sdpa": SdpaBackend}
