"""CUDA graphs for a model's forward: captured once per bucket shape, replayed from static buffers.

At batch 1 a decode step of an 8B model launches hundreds of kernels; from Python each launch costs a
few microseconds of host time, enough to hide the GPU's memory bandwidth. A CUDA graph records the
launches once and replays them with one call. It replays *fixed* shapes and addresses, so:

- a **bucket** is (num_seqs, query_len): up to `num_seqs` sequences with up to `query_len` new rows each —
  a decode step (query_len 1) or a verify step (root + tree nodes) of that many requests. A batch runs in
  the smallest bucket that holds it (`choose_bucket`); anything else (a prefill chunk, a bigger tree, a
  drafter level whose mask reaches into cached entries past the bucket's width) runs eagerly.
- a batch is **padded** to its bucket (`pad_to_bucket`): empty sequences (no rows, no keys), padding rows
  whose K/V slot is -1 (the triton backend's KV write skips them), block tables widened to the model's
  longest context, logit and hidden rows repeated — every array keeps one size per bucket.
- the padded arrays travel in ONE host->device copy into the bucket's static buffer
  (`StepBatch.bind_buffer`); the graph reads only that buffer, the cache and the weights, and writes its
  outputs into tensors that live as long as the graph. Real rows' outputs are sliced off after replay.

Only the ``triton`` attention backend can be captured: sdpa's shapes follow each batch's longest context.
Rotary tables are grown to the longest context before capture (a later growth would move them).

Off CUDA the same object "replays" by running the forward eagerly on the bound buffer (`GraphedForward`
with `capture=False`): tests on the CPU check everything around the graph — bucket choice, padding, the
static buffer, slicing — and CUDA machines run the real capture (tests/engine/test_gpu.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from specserve.step_batch import StepBatch

log = logging.getLogger("specserve")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_QUERY_LENS = (1, 2, 4, 8, 16, 32, 64)  # 1: plain decode; the rest: root + tree nodes


@dataclass(frozen=True, order=True)
class GraphBucket:
    """A captured shape: up to `num_seqs` sequences with up to `query_len` new rows each."""

    num_seqs: int
    query_len: int

    @property
    def rows(self) -> int:
        return self.num_seqs * self.query_len

    @property
    def mask_entries(self) -> int:
        """tree_mask capacity: every sequence a full [query_len, query_len] mask (a tree over its own rows)."""
        return self.num_seqs * self.query_len * self.query_len


def make_buckets(max_num_seqs: int, max_query_len: int, batch_sizes=DEFAULT_BATCH_SIZES,
                 query_lens=DEFAULT_QUERY_LENS) -> list[GraphBucket]:
    """Every (batch size, query length) pair the engine can reach, plus the limits themselves, so the
    largest decode and verify steps have a bucket too. Sorted smallest first."""
    sizes = sorted({b for b in batch_sizes if b <= max_num_seqs} | {max_num_seqs})
    lens = sorted({q for q in query_lens if q <= max_query_len} | {max_query_len})
    return sorted(GraphBucket(b, q) for b in sizes for q in lens)


def choose_bucket(buckets: list[GraphBucket], batch: StepBatch, max_blocks: int) -> GraphBucket | None:
    """The smallest bucket (fewest padded rows, then fewest sequences) that holds `batch`, or None: the batch
    runs eagerly. A batch fits when its sequences, its longest sequence's rows, its masks and its block
    tables fit the bucket's arrays, and every mask covers only the sequence's own rows (a drafter level
    whose mask also covers cached "tail" entries is wider than any bucket's)."""
    num_seqs, query_len = batch.num_seqs, batch.max_query_len
    trees = batch.mask_offsets >= 0
    if batch.block_tables.shape[1] > max_blocks or np.any(batch.mask_widths[trees] != np.diff(batch.cu_query_lens)[trees]):
        return None
    fitting = [b for b in buckets if b.num_seqs >= num_seqs and b.query_len >= query_len]
    return min(fitting, key=lambda b: (b.rows, b.num_seqs), default=None)


def pad_to_bucket(batch: StepBatch, bucket: GraphBucket, max_blocks: int, hidden: bool) -> StepBatch:
    """`batch` padded to the bucket's fixed array sizes (see the module docstring); rows keep their index,
    logit and hidden rows their order, so the first len(batch.logit_rows) logits of the padded forward are
    the batch's. hidden: the graph returns hidden states (then every bucket row has a hidden row)."""
    B, T = batch.num_seqs, batch.num_tokens
    if B > bucket.num_seqs or T > bucket.rows:
        raise ValueError(f"a batch of {B} sequences and {T} rows does not fit {bucket}")

    def grow(a: np.ndarray, size: int, fill) -> np.ndarray:
        return np.concatenate([a, np.full(size - len(a), fill, dtype=a.dtype)])

    tables = np.zeros((bucket.num_seqs, max_blocks), dtype=batch.block_tables.dtype)
    tables[:B, : batch.block_tables.shape[1]] = batch.block_tables
    return replace(
        batch,
        input_ids=grow(batch.input_ids, bucket.rows, 0),
        positions=grow(batch.positions, bucket.rows, 0),
        slot_mapping=grow(batch.slot_mapping, bucket.rows, -1),  # padding rows write no K/V
        token_seq=grow(batch.token_seq, bucket.rows, max(B - 1, 0)),
        cu_query_lens=grow(batch.cu_query_lens, bucket.num_seqs + 1, T),  # padding sequences have no rows...
        context_lens=grow(batch.context_lens, bucket.num_seqs, 0),  # ...and no keys
        block_tables=tables,
        mask_offsets=grow(batch.mask_offsets, bucket.num_seqs, -1),
        mask_widths=grow(batch.mask_widths, bucket.num_seqs, 0),
        tree_mask=grow(batch.tree_mask, bucket.mask_entries, False),
        logit_rows=grow(batch.logit_rows, bucket.rows, 0),
        hidden_rows=grow(batch.hidden_rows, bucket.rows, 0) if hidden else batch.hidden_rows[:0],
        query_len_bound=bucket.query_len,
    )


def dummy_batch(bucket: GraphBucket, max_blocks: int, block_size: int, hidden: bool) -> StepBatch:
    """A bucket-shaped batch that reads block 0 and writes nothing (slots -1): what a capture runs."""
    q, B = bucket.query_len, bucket.num_seqs
    rows = np.arange(bucket.rows, dtype=np.int64)
    return StepBatch(
        input_ids=np.zeros(bucket.rows, dtype=np.int64),
        positions=rows % q,
        slot_mapping=np.full(bucket.rows, -1, dtype=np.int64),
        token_seq=(rows // q).astype(np.int32),
        cu_query_lens=(np.arange(B + 1) * q).astype(np.int32),
        context_lens=np.full(B, q, dtype=np.int32),
        block_tables=np.zeros((B, max_blocks), dtype=np.int32),
        mask_offsets=np.full(B, -1, dtype=np.int64),
        mask_widths=np.full(B, q, dtype=np.int32),
        tree_mask=np.zeros(bucket.mask_entries, dtype=np.bool_),
        logit_rows=rows,
        hidden_rows=rows if hidden else np.zeros(0, dtype=np.int64),
        block_size=block_size,
        query_len_bound=q,
    )


def forward_activation_bytes(cfg, rows: int, dtype: torch.dtype) -> int:
    """Peak activation bytes of one forward over `rows` rows (an upper estimate): the residual stream, the
    normed input, q|k|v, attention output, gate|up and its product in `dtype`, and the logits in `dtype` and
    float32. A graph pool holds this much for the largest bucket (smaller buckets reuse it)."""
    width = torch.finfo(dtype).bits // 8
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_row = width * (3 * cfg.hidden_size + qkv + cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size)
    per_row += (width + 4) * cfg.vocab_size
    return rows * per_row


def cuda_kv_budget(free_bytes: int, total_bytes: int, utilization: float, reserve_bytes: int) -> int:
    """Bytes the KV cache may take on a GPU: what `utilization` of the device leaves free after the weights
    (already loaded: `free_bytes` is measured after them) minus `reserve_bytes` (graph pool and eager
    activations). Never negative."""
    used = total_bytes - free_bytes
    return max(0, int(total_bytes * utilization) - used - reserve_bytes)


class _Graph:
    """One bucket: its static input buffer, and the outputs its captured forward writes."""

    def __init__(self, buffer: torch.Tensor, batch: StepBatch) -> None:
        self.buffer = buffer  # int64[sum of the padded arrays' sizes] on the device
        self.batch = batch  # the bucket-shaped batch the forward was captured from (bound to `buffer`)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output = None  # ForwardOutput written by each replay


class GraphedForward:
    """A model's forward over one cache, replayed from CUDA graphs for batches that fit a bucket.

    model:         a `LlamaModel` on the ``triton`` backend (target or draft model).
    cache:         the PagedKVCache every replay reads and writes (its tensors are baked into the graphs).
    hidden_layers: the hidden-state layers every forward returns (fixed per graph).
    max_positions: rotary positions covered before capture; a batch reaching past them runs eagerly.
    capture:       record CUDA graphs (on CUDA); False runs the same padded forward eagerly (CPU tests).
    """

    def __init__(self, model, cache, buckets: list[GraphBucket], hidden_layers: tuple[int, ...], max_positions: int,
                 capture: bool = True) -> None:
        if model.backend.name != "triton":
            raise ValueError(f"CUDA graphs need the 'triton' attention backend, this model uses {model.backend.name!r}")
        self.model, self.cache, self.hidden_layers = model, cache, tuple(hidden_layers)
        self.buckets = sorted(buckets)
        self.max_blocks = -(-max_positions // cache.block_size)
        model.rope.cover(max_positions)
        self.max_positions = model.rope.num_positions
        self.capture = capture and model.device.type == "cuda"
        self.graphs: dict[GraphBucket, _Graph] = {}
        self.replays = 0  # batches served from a bucket (for tests and metrics)

    def capture_all(self) -> None:
        """Build every bucket's buffer and graph, largest first so smaller graphs reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for bucket in sorted(self.buckets, reverse=True):
            batch = dummy_batch(bucket, self.max_blocks, self.cache.block_size, bool(self.hidden_layers))
            entry = _Graph(torch.from_numpy(batch.flat_arrays()).to(self.model.device), batch)
            batch.bind_buffer(self.model.device, entry.buffer)
            if self.capture:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernels, settles allocations
                    self.model.eager_forward(batch, self.cache, self.hidden_layers)
                torch.cuda.current_stream().wait_stream(stream)
                entry.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(entry.graph, pool=pool):
                    entry.output = self.model.eager_forward(batch, self.cache, self.hidden_layers)
            self.graphs[bucket] = entry
        if self.capture:
            torch.cuda.synchronize()
            log.info("captured %d CUDA graphs (buckets %s)", len(self.graphs), ", ".join(
                f"{b.num_seqs}x{b.query_len}" for b in self.buckets))

    def run(self, batch: StepBatch, cache, hidden_layers: tuple[int, ...]):
        """The forward of `batch` from its bucket's graph, or None when it has none (the caller runs it eagerly)."""
        if cache is not self.cache or tuple(hidden_layers) != self.hidden_layers or not self.graphs:
            return None
        if batch.num_positions > self.max_positions:
            return None
        bucket = choose_bucket(self.buckets, batch, self.max_blocks)
        if bucket is None:
            return None
        entry = self.graphs[bucket]
        padded = pad_to_bucket(batch, bucket, self.max_blocks, bool(self.hidden_layers))
        host = torch.from_numpy(padded.flat_arrays())  # the same layout as the buffer: sizes are the bucket's
        if self.capture:
            entry.buffer.copy_(host.pin_memory(), non_blocking=True)
            entry.graph.replay()
            out = entry.output
        else:
            entry.buffer.copy_(host)
            out = self.model.eager_forward(entry.batch, self.cache, self.hidden_layers)
        self.replays += 1
        return _sliced(out, len(batch.logit_rows), len(batch.hidden_rows))


def _sliced(out, num_logits: int, num_hidden: int):
    """The real rows of a padded forward's outputs (they come first). Logits stay a view of the graph's
    output — read before this model's next forward, as the engine does; hidden states are copied, since
    drafters may keep them across steps."""
    from specserve.forward_output import ForwardOutput

    return ForwardOutput(logits=out.logits[:num_logits],
                         hidden_states={layer: h[:num_hidden].clone() for layer, h in out.hidden_states.items()})
