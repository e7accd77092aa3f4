"""A tree grown level by level with earlier levels left in the cache (a tail mask) gives the same
logits as feeding every level's ancestors afresh with an ordinary tree mask — on both executors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel
from specserve.step_batch import StepBatchBuilder


def _cache(model):
    allocator = BlockAllocator(16, 4)
    allocator.allocate("s", 16)
    return model.new_cache(allocator)


def _forward(model, cache, tokens, num_cached, positions=None, mask=None, logits="all"):
    builder = StepBatchBuilder(cache.allocator)
    builder.add("s", num_cached, np.asarray(tokens, dtype=np.int64),
                None if positions is None else np.asarray(positions, dtype=np.int64),
                None if mask is None else np.asarray(mask, dtype=np.bool_), logits=logits)
    return model.forward(builder.build(), cache).logits


@pytest.mark.parametrize("executor", ["kernels", "torch"])
def test_tail_mask_matches_refeeding_the_tree(llama_dir, executor):
    model = LlamaModel.from_pretrained(llama_dir, torch.device("cpu"), torch.float32, cpu_kernels=executor == "kernels")
    prompt = [5, 9, 3, 7, 1, 2]
    # level 1: nodes a, b (children of the prompt); level 2: c under b, d under a.
    p = len(prompt)

    grown = _cache(model)
    _forward(model, grown, prompt, 0, logits="last")
    _forward(model, grown, [11, 12], p, [p, p], np.eye(2, dtype=bool))
    tail = [[False, True, True, False], [True, False, False, True]]  # c sees b, d sees a
    out = _forward(model, grown, [13, 14], p + 2, [p + 1, p + 1], tail)

    fresh = _cache(model)
    _forward(model, fresh, prompt, 0, logits="last")
    parents_mask = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]]
    ref = _forward(model, fresh, [11, 12, 13, 14], p, [p, p, p + 1, p + 1], parents_mask)[2:]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mask_wider_than_the_cache_is_refused(llama_dir):
    model = LlamaModel.from_pretrained(llama_dir, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="new_mask has shape"):
        _forward(model, _cache(model), [1], 0, [0], np.ones((1, 3), dtype=bool))
