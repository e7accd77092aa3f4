"""Tensor parallelism for the target model over torch.distributed (gloo on CPUs, NCCL on GPUs).

Megatron-style split of every decoder layer over N ranks: rank r owns query heads
[r*H/N, (r+1)*H/N) and kv heads [r*KV/N, ...) — their rows of q|k|v, their columns of o_proj and their
share of the paged KV cache — and MLP columns [r*I/N, ...) — rows of gate|up, columns of down. Each
layer ends its attention and its MLP with ONE all-reduce of the partial output projections; biases of
o_proj and down are added after it, once. The residual stream is therefore whole on every rank, so the
hidden states a drafter reads (EAGLE, Medusa) come from rank 0 without any extra gather. The LM head is
split over the vocabulary (rank r: rows [r*ceil(V/N), ...)); rank 0 gathers the logit rows of its batch.
Embeddings and norms are replicated (only indexed / tiny); rank 0 also keeps the whole LM head, for the
drafters that draft through it (EAGLE-1, Medusa-2) — the memory it costs rank 0 is one [V, hidden].

Who decides what: rank 0 runs the whole engine (scheduler, drafters, acceptance, commit). Each forward
it BROADCASTS the StepBatch it built (a header, then its flat arrays — one int64 tensor), and the cache
moves of a commit, to the other ranks, which only run forwards and cache moves. Broadcasting rather
than running the scheduler on every rank keeps one decision-maker: drafters, grammars and sampling
(random state) never have to agree across processes.

Batch invariance: a rank's partial product sums its heads or MLP columns only, and the all-reduce adds
the N partials; the sum is taken in a different order than one device's, so logits differ from TP=1 by
float32 rounding (~1e-6 relative). Greedy output equals one device's except where two tokens tie to
within that; on one TP size, plain and speculative steps compute a row the same way, as on one device.

Ranks are started by `launch` (torch.multiprocessing, spawn): the calling process is rank 0, workers
load their own slices of the checkpoint (`specserve.checkpoint.load_state_dict(shard=...)` reads only
those bytes) and loop in `_worker_loop` until rank 0 sends STOP.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from specserve.sharding import Shard, check_shardable, shard_config, slice_of  # noqa: F401 (re-exported)
from specserve.kv_cache import PagedKVCache
from specserve.step_batch import ARRAY_NAMES, StepBatch

log = logging.getLogger("specserve")

# Header of every message rank 0 broadcasts: int64[HEADER]; [0] is the operation.
HEADER = 32
STOP, FORWARD, MOVE, MAKE_CACHE, DESCRIBE = range(5)
MAX_HIDDEN_LAYERS = HEADER - 12


class TensorParallel:
    """One rank's handle on the group: the collectives the model calls, and rank 0's broadcasts."""

    def __init__(self, shard: Shard, device: torch.device) -> None:
        self.shard, self.device = shard, device
        self.vocab_size = 0  # set by the model that joins the group
        self.workers: list = []  # rank 0: the worker processes it started
        self.collective_s = 0.0  # time in the forwards' collectives (waiting for the slowest rank included)

    @property
    def is_leader(self) -> bool:
        return self.shard.rank == 0

    # ---- collectives inside a forward ---------------------------------------------------------

    def new_cache(self, allocator, num_layers: int, num_kv_heads: int, head_dim: int, device: torch.device,
                  dtype: torch.dtype) -> "ShardedKVCache":
        """The leader's KV cache: its own share, and every other rank makes its share alongside."""
        return ShardedKVCache(self, allocator, num_layers, num_kv_heads, head_dim, device, dtype)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `partial` [T, hidden], in place."""
        start = time.perf_counter()
        dist.all_reduce(partial)
        self.collective_s += time.perf_counter() - start
        return partial

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """local float32 [R, this rank's vocab rows] -> rank 0: [R, vocab]; other ranks: None."""
        width = -(-self.vocab_size // self.shard.world)
        padded = local
        if local.shape[1] < width:  # the last rank's share of a vocabulary that does not divide evenly
            padded = torch.zeros(local.shape[0], width, dtype=local.dtype, device=local.device)
            padded[:, : local.shape[1]] = local
        start = time.perf_counter()
        if self.is_leader:
            parts = [torch.empty_like(padded) for _ in range(self.shard.world)]
            dist.gather(padded, parts, dst=0)
            self.collective_s += time.perf_counter() - start
            return torch.cat(parts, dim=1)[:, : self.vocab_size]
        dist.gather(padded, None, dst=0)
        self.collective_s += time.perf_counter() - start
        return None

    # ---- rank 0 -> workers ----------------------------------------------------------------------

    def _header(self, op: int, *values: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = op
        header[1: 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(header.to(self.device), 0)

    def send_forward(self, batch: StepBatch, hidden_layers: tuple[int, ...]) -> None:
        if len(hidden_layers) > MAX_HIDDEN_LAYERS:
            raise ValueError(f"tensor parallelism passes at most {MAX_HIDDEN_LAYERS} hidden-state layers")
        self._header(FORWARD, batch.num_tokens, batch.num_seqs, batch.block_tables.shape[1], batch.tree_mask.size,
                     len(batch.logit_rows), len(batch.hidden_rows), batch.block_size, batch.query_len_bound,
                     len(hidden_layers), *hidden_layers)
        dist.broadcast(torch.from_numpy(batch.flat_arrays()).to(self.device), 0)

    def send_move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._header(MOVE, src.numel())
        dist.broadcast(torch.cat([src, dst]).to(device=self.device, dtype=torch.int64), 0)

    def send_make_cache(self, num_blocks: int, block_size: int) -> None:
        self._header(MAKE_CACHE, num_blocks, block_size)

    def describe(self, own: dict) -> list[dict]:
        """Every rank's description (`describe_rank`), rank 0's `own` first."""
        self._header(DESCRIBE)
        out = [None] * self.shard.world
        dist.gather_object(own, out, dst=0)
        return out

    def stop(self) -> None:
        """Tell the workers to leave their loop; wait for them; leave the group."""
        if not dist.is_initialized():
            return
        try:
            self._header(STOP)
        finally:
            for p in self.workers:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()


class ShardedKVCache(PagedKVCache):
    """Rank 0's share of the KV cache. Making it makes every rank's share (same blocks, their own kv heads);
    a commit's moves are sent to every rank before they happen here, so all shares stay in step."""

    def __init__(self, tp: TensorParallel, allocator, num_layers: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        tp.send_make_cache(allocator.num_blocks, allocator.block_size)
        super().__init__(allocator, num_layers, num_kv_heads, head_dim, device, dtype)
        self.tp = tp

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        if src_slots.numel():
            self.tp.send_move(src_slots, dst_slots)
        super().move(src_slots, dst_slots)


def unpack_batch(header: torch.Tensor, flat: np.ndarray) -> tuple[StepBatch, tuple[int, ...]]:
    """The StepBatch (and hidden layers) a FORWARD message carries; `flat` is `StepBatch.flat_arrays()`."""
    block_size, bound, n_hidden = (int(x) for x in header[7:10])
    hidden_layers = tuple(int(x) for x in header[10: 10 + n_hidden])
    arrays, start = {}, 0
    for name, shape in zip(ARRAY_NAMES, _shapes_of(header)):
        size = int(np.prod(shape))
        a = flat[start:start + size].reshape(shape)
        arrays[name] = a.astype(np.bool_) if name == "tree_mask" else a
        start += size
    return StepBatch(**arrays, block_size=block_size, query_len_bound=bound), hidden_layers


# ---- starting the group ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Each rank's device: cuda:rank on GPUs, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def launch(world: int, model_dir: str, device: torch.device, dtype: torch.dtype, threads: int | None) -> TensorParallel:
    """Start ranks 1..world-1 (each loads its slices and waits for rank 0) and join the group as rank 0."""
    import torch.multiprocessing as mp

    if dist.is_initialized():
        raise ValueError("a tensor-parallel LLM is already running in this process: close() it first")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    address = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_worker_main, args=(rank, world, address, model_dir, str(device), dtype, threads),
                           daemon=True, name=f"specserve-tp{rank}") for rank in range(1, world)]
    for p in workers:
        p.start()
    dist.init_process_group(_backend(device), init_method=address, rank=0, world_size=world)
    tp = TensorParallel(Shard(0, world), rank_device(device, 0))
    tp.workers = workers
    return tp


def _worker_main(rank: int, world: int, address: str, model_dir: str, device: str, dtype: torch.dtype,
                 threads: int | None) -> None:
    from specserve.kv_cache import BlockAllocator
    from specserve.model import LlamaModel

    torch.set_num_threads(threads or 1)
    base = torch.device(device)
    dev = rank_device(base, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(_backend(base), init_method=address, rank=rank, world_size=world)
    tp = TensorParallel(Shard(rank, world), dev)
    model = LlamaModel.from_pretrained(model_dir, dev, dtype, cpu_kernels=False, tp=tp)
    cache = None
    with torch.inference_mode():
        while True:
            header = torch.empty(HEADER, dtype=torch.int64, device=tp.device)
            dist.broadcast(header, 0)
            header = header.cpu()
            op = int(header[0])
            if op == STOP:
                break
            if op == MAKE_CACHE:
                cache = model.new_cache(BlockAllocator(int(header[1]), int(header[2])))
            elif op == FORWARD:
                size = sum(int(np.prod(s)) for s in _shapes_of(header))
                flat = torch.empty(size, dtype=torch.int64, device=tp.device)
                dist.broadcast(flat, 0)
                batch, hidden_layers = unpack_batch(header, flat.cpu().numpy())
                model.forward(batch, cache, hidden_layers)
            elif op == MOVE:
                n = int(header[1])
                pairs = torch.empty(2 * n, dtype=torch.int64, device=tp.device)
                dist.broadcast(pairs, 0)
                cache.move(pairs[:n].to(cache.device), pairs[n:].to(cache.device))
            elif op == DESCRIBE:
                dist.gather_object(describe_rank(model, cache), None, dst=0)
    dist.destroy_process_group()


def _shapes_of(header: torch.Tensor) -> list[tuple[int, ...]]:
    T, B, max_blocks, M, R, R_h = (int(x) for x in header[1:7])
    return [(T,)] * 4 + [(B + 1,), (B,), (B, max_blocks), (B,), (B,), (M,), (R,), (R_h,)]


def describe_rank(model, cache) -> dict:
    """What a rank holds: its KV cache's shape and bytes, and the checkpoint bytes its loader read."""
    return {"rank": model.tp.shard.rank, "pid": os.getpid(),
            "kv_shape": tuple(cache.k.shape) if cache is not None else None,
            "kv_bytes": 2 * cache.k.numel() * cache.k.element_size() if cache is not None else 0,
            "checkpoint_bytes_read": model.checkpoint_bytes_read,
            "num_heads": model.config.num_heads, "num_kv_heads": model.config.num_kv_heads}


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Bytes of a checkpoint's tensors (what one device reads)."""
    from specserve.checkpoint import checkpoint_files

    return sum(p.stat().st_size for p in checkpoint_files(Path(model_dir)))
