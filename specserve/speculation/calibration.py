"""Start-up cost calibration of a budget policy that asks for it (`BudgetPolicy.wants_calibration`).

The policy times target forwards shaped like verify steps — `rows` new tokens with logits at every
row, after a cached context of typical length (attention over it is a real part of a verify row's
cost) — through the engine's own `ModelRunner`, on a scratch sequence whose blocks are freed after.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specserve.kv_cache import BlockAllocator
from specserve.runner import ModelRunner
from specserve.verify import DraftTree, accept_trees, pack_trees
from specserve.verify.verifier import row_argmax

# Calibration forwards go up to this many rows; beyond it the cost is extrapolated (linear: the
# forward is compute-bound long before) and corrected online.
CALIBRATION_MAX_ROWS = 64
# Cached keys before the timed rows: about a prompt and a reply, so the rows' attention costs what a
# verify row's does.
CALIBRATION_CONTEXT = 128

_SCRATCH = "__calibration__"


def calibrate_policy(policy, runner: ModelRunner, allocator: BlockAllocator, max_model_len: int,
                     most_rows: int) -> tuple[float, float]:
    """Calibrate `policy` (`policy.calibrate(time_forward, max_rows, time_tree)`); most_rows: the most
    rows a step can have. Returns (warm-up seconds, calibration seconds)."""
    vocab = runner.model.config.vocab_size
    free = allocator.num_free_blocks * allocator.block_size - 1
    context = max(0, min(CALIBRATION_CONTEXT, max_model_len // 2, free // 2))
    max_rows = max(1, min(most_rows, CALIBRATION_MAX_ROWS, free - context, max_model_len - context - 1))

    def forward(start: int, rows: int, tree: DraftTree | None = None) -> torch.Tensor:
        tokens = (np.arange(start, start + rows, dtype=np.int64) * 7919) % vocab
        return runner.forward_scratch(_SCRATCH, start, tokens, tree)

    allocator.allocate(_SCRATCH, context + max_rows)
    try:
        with torch.inference_mode():
            # Warm-up first, untimed: on a fresh machine the first forwards of each shape compile the
            # kernels (a minute or more, once; cached on disk after) — that is not a cost model.
            t0 = time.perf_counter()
            if context:
                forward(0, context)
            rows = 1
            while rows < max_rows * 2:
                forward(context, min(rows, max_rows))
                rows *= 2
            t1 = time.perf_counter()

            def time_forward(rows: int) -> float:
                t0 = time.perf_counter()
                forward(context, rows)
                return time.perf_counter() - t0

            def time_tree(nodes: int) -> float:
                """A verify step of one chain of `nodes` draft tokens: the forward with its tree mask, then
                greedy tree acceptance (`time_forward(nodes + 1)` is the same rows as a plain forward)."""
                tree = DraftTree.chain(((np.arange(1, nodes + 1) * 7919) % vocab).tolist())
                t0 = time.perf_counter()
                logits = forward(context, nodes + 1, tree)
                packed = pack_trees([tree], logits.device)
                accept_trees([tree], packed, np.ones(1, dtype=np.bool_), row_argmax(logits), None,
                             np.full(packed.num_rows, -1, dtype=np.int64), np.zeros(0))
                return time.perf_counter() - t0

            policy.calibrate(time_forward, max_rows, time_tree)
            return t1 - t0, time.perf_counter() - t1
    finally:
        allocator.free(_SCRATCH)
