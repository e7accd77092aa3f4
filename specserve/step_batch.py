"""`StepBatch`: everything one forward needs, flat, built once per forward and read by every kernel.

A forward runs the new tokens of B sequences (T tokens in all) over a paged KV cache. Each sequence
brings `n` new tokens that see (a) its cached entries and (b) the new tokens its mask allows:
causal for a prompt chunk, the ancestor mask for a draft tree. Prefill, chunked prefill, plain
decoding, tree verification and drafters growing their own trees level by level are all this case.

Arrays are filled in numpy on the host (one pass over the sequences) and, on an accelerator, moved to
the device in ONE copy (`StepBatch.device_arrays`). Attention backends and kernels read only this
object — never per-request state — so a new backend or kernel plugs in without touching the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.kernels.batch_arrays import token_arrays
from specserve.kv_cache import BlockAllocator


@dataclass(frozen=True, eq=False)
class StepBatch:
    """One forward's inputs and attention metadata (numpy, host). T new tokens, B sequences.

    input_ids:     int64[T]   new tokens, sequence after sequence.
    positions:     int64[T]   their RoPE positions (a tree node sits at committed_len + depth).
    slot_mapping:  int64[T]   physical cache slot each new token's K/V is written to.
    token_seq:     int32[T]   the sequence each new token belongs to.
    cu_query_lens: int32[B+1] sequence b's new tokens are rows cu_query_lens[b] : cu_query_lens[b+1].
    context_lens:  int32[B]   keys sequence b attends over: its cached entries + its new tokens. Key j
                              is the sequence's slot index j (block_tables maps it to a physical slot).
    block_tables:  int32[B, max_blocks] each sequence's block ids (padded with 0).
    mask_offsets:  int64[B]   start of sequence b's mask in `tree_mask`, or -1: causal among its new
                              tokens (a prompt chunk, a chain, a single token).
    mask_widths:   int32[B]   columns of that mask: it covers the LAST `width` keys of the sequence —
                              any cached "tail" entries (a drafter's earlier tree levels) and then the new
                              tokens; keys before them are visible to every new token.
    tree_mask:     bool[M]    the masks, each row-major [n, width]: mask[i, c] = new token i sees key
                              context_len - width + c.
    logit_rows:    int64[R]   rows whose logits the forward returns (in this order).
    hidden_rows:   int64[R_h] rows whose hidden states of the asked layers the forward returns.
    block_size:    slots per block.
    query_len_bound: `max_query_len` reports at least this (0: the batch's own): a CUDA-graph bucket's
                   rows per sequence, so a padded batch launches the same attention grid it was captured with.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    token_seq: np.ndarray
    cu_query_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    mask_offsets: np.ndarray
    mask_widths: np.ndarray
    tree_mask: np.ndarray
    logit_rows: np.ndarray
    hidden_rows: np.ndarray
    block_size: int
    query_len_bound: int = 0
    _device: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def max_query_len(self) -> int:
        own = int(np.max(np.diff(self.cu_query_lens))) if self.num_seqs else 0
        return max(own, self.query_len_bound)

    @property
    def num_positions(self) -> int:
        """1 + the highest RoPE position of any new token (0 for an empty batch): the rotary rows needed."""
        return int(self.positions.max()) + 1 if self.positions.size else 0

    @property
    def max_context_len(self) -> int:
        return int(self.context_lens.max()) if self.num_seqs else 0

    def device_arrays(self, device: torch.device) -> "DeviceArrays":
        """The arrays as torch tensors on `device`, made once per batch: on the CPU they share the numpy
        memory; on an accelerator every integer array travels in ONE pinned, non-blocking copy."""
        cached = self._device.get(device)
        if cached is None:
            cached = self._device[device] = _to_device(self, device)
        elif isinstance(cached, torch.Tensor):  # a bound static buffer: fresh views (see `bind_buffer`)
            return _views(self, cached)
        return cached

    def flat_arrays(self) -> np.ndarray:
        """int64[sum of the arrays' sizes]: every array, flattened, in `ARRAY_NAMES` order — what travels to
        the device in one copy."""
        return np.concatenate([getattr(self, name).reshape(-1).astype(np.int64, copy=False) for name in ARRAY_NAMES])

    def bind_buffer(self, device: torch.device, flat: torch.Tensor) -> None:
        """Read this batch's device arrays from `flat` (int64, on the device, holding `flat_arrays()`: a CUDA
        graph's static input buffer) instead of copying them. `device_arrays` then makes its views on every
        call, so a graph capture records the one conversion among them (tree_mask to bool) and a replay
        redoes it on the buffer's new contents."""
        self._device[device] = flat


ARRAY_NAMES = ("input_ids", "positions", "slot_mapping", "token_seq", "cu_query_lens", "context_lens",
           "block_tables", "mask_offsets", "mask_widths", "tree_mask", "logit_rows", "hidden_rows")


@dataclass(frozen=True)
class DeviceArrays:
    """`StepBatch`'s arrays as torch tensors on one device (same names, same shapes; tree_mask bool,
    the rest int64)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_seq: torch.Tensor
    cu_query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    mask_offsets: torch.Tensor
    mask_widths: torch.Tensor
    tree_mask: torch.Tensor
    logit_rows: torch.Tensor
    hidden_rows: torch.Tensor


def _to_device(batch: StepBatch, device: torch.device) -> DeviceArrays:
    arrays = [getattr(batch, name) for name in ARRAY_NAMES]
    if device.type == "cpu":
        return DeviceArrays(*(torch.from_numpy(a.astype(np.bool_ if a.dtype == np.bool_ else np.int64, copy=False))
                              for a in arrays))
    host = torch.from_numpy(batch.flat_arrays())
    if device.type == "cuda":
        host = host.pin_memory()
    return _views(batch, host.to(device, non_blocking=True))


def _views(batch: StepBatch, flat: torch.Tensor) -> DeviceArrays:
    """The batch's arrays as views of `flat` (its `flat_arrays()` on a device); tree_mask converted to bool."""
    out, start = [], 0
    for name in ARRAY_NAMES:
        a = getattr(batch, name)
        t = flat[start:start + a.size].view(a.shape)
        out.append(t.bool() if name == "tree_mask" else t)
        start += a.size
    return DeviceArrays(*out)


class StepBatchBuilder:
    """Collects the sequences of one forward, then packs them into a `StepBatch` in one pass.

    allocator: the block allocator whose tables address the sequences' cache entries.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._tables: list[np.ndarray] = []
        self._cached: list[int] = []
        self._tokens: list[np.ndarray] = []
        self._positions: list[np.ndarray] = []
        self._masks: list[np.ndarray | None] = []
        self._logit_rows: list[np.ndarray] = []
        self._hidden_rows: list[np.ndarray] = []
        self._rows = 0

    @property
    def num_tokens(self) -> int:
        return self._rows

    def add(
        self,
        seq_id: str,
        num_cached: int,
        tokens: np.ndarray,
        positions: np.ndarray | None = None,
        mask: np.ndarray | None = None,
        logits: str | np.ndarray = "none",
        hidden: bool = False,
    ) -> int:
        """Add one sequence's new tokens; return the row of its first token.

        seq_id:     the sequence's block table in the allocator.
        num_cached: its cache entries before this forward (slot indices 0..num_cached-1); the new tokens
                    are written at slot indices num_cached .. num_cached + n - 1.
        tokens:     int64[n]; positions: int64[n] (default: num_cached .. num_cached + n - 1).
        mask:       None (causal) or bool[n, width], width in [n, num_cached + n] (see `StepBatch`).
        logits:     "none", "last" (the last new token's row), "all", or an int array of the new tokens
                    (0 .. n-1) whose logits are wanted, in the order given.
        hidden:     return hidden states of every new token.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError(f"sequence {seq_id!r}: a forward needs at least one new token")
        if positions is None:
            positions = np.arange(num_cached, num_cached + n, dtype=np.int64)
        elif len(positions) != n:
            raise ValueError(f"sequence {seq_id!r}: {len(positions)} positions for {n} tokens")
        if mask is not None and (mask.shape[0] != n or not n <= mask.shape[1] <= num_cached + n):
            raise ValueError(f"sequence {seq_id!r}: new_mask has shape {tuple(mask.shape)}, expected "
                             f"[{n}, tail + {n}] with tail <= {num_cached} cached entries")
        table = self.allocator.tables[seq_id]
        if (num_cached + n) > len(table) * self.allocator.block_size:
            raise ValueError(f"sequence {seq_id!r}: {num_cached + n} cache entries exceed its "
                             f"{len(table) * self.allocator.block_size} reserved slots")
        first = self._rows
        self._tables.append(table)
        self._cached.append(num_cached)
        self._tokens.append(np.asarray(tokens, dtype=np.int64))
        self._positions.append(np.asarray(positions, dtype=np.int64))
        self._masks.append(mask)
        if isinstance(logits, np.ndarray):
            self._logit_rows.append(first + logits.astype(np.int64))
        elif logits == "last":
            self._logit_rows.append(np.array([first + n - 1], dtype=np.int64))
        elif logits == "all":
            self._logit_rows.append(np.arange(first, first + n, dtype=np.int64))
        elif logits != "none":
            raise ValueError(f"logits must be 'none', 'last', 'all' or an array of rows, got {logits!r}")
        if hidden:
            self._hidden_rows.append(np.arange(first, first + n, dtype=np.int64))
        self._rows += n
        return first

    def build(self) -> StepBatch:
        if not self._tokens:
            raise ValueError("a StepBatch needs at least one sequence")
        num_seqs = len(self._tokens)
        lens = np.fromiter((len(t) for t in self._tokens), dtype=np.int32, count=num_seqs)
        cached = np.asarray(self._cached, dtype=np.int32)
        max_blocks = max(len(t) for t in self._tables)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for b, t in enumerate(self._tables):
            tables[b, : len(t)] = t
        bs = self.allocator.block_size
        cu, token_seq, slot_mapping = token_arrays(lens, cached, tables, bs)
        offsets = np.full(num_seqs, -1, dtype=np.int64)
        widths = lens.copy()
        masks, start = [], 0
        for b, m in enumerate(self._masks):
            if m is not None:
                offsets[b], widths[b] = start, m.shape[1]
                masks.append(np.ascontiguousarray(m, dtype=np.bool_).reshape(-1))
                start += m.size
        empty = np.zeros(0, dtype=np.int64)
        return StepBatch(
            input_ids=np.concatenate(self._tokens),
            positions=np.concatenate(self._positions),
            slot_mapping=slot_mapping,
            token_seq=token_seq,
            cu_query_lens=cu,
            context_lens=cached + lens,
            block_tables=tables,
            mask_offsets=offsets,
            mask_widths=widths,
            tree_mask=np.concatenate(masks) if masks else np.zeros(0, dtype=np.bool_),
            logit_rows=np.concatenate(self._logit_rows) if self._logit_rows else empty,
            hidden_rows=np.concatenate(self._hidden_rows) if self._hidden_rows else empty,
            block_size=bs,
        )
