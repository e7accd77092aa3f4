"""A tree grown level by level with earlier levels left in the cache (a tail mask) gives the same
logits as feeding every level's ancestors afresh with an ordinary tree mask."""

from __future__ import annotations

import pytest
import torch

from specserve.attention import SequenceSlice
from specserve.kv_cache import PagedKVCache
from specserve.model import LlamaModel


def _cache(model):
    cfg = model.config
    return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 4, torch.device("cpu"), torch.float32)


def test_tail_mask_matches_refeeding_the_tree(llama_dir):
    model = LlamaModel.from_pretrained(llama_dir, torch.device("cpu"), torch.float32)
    prompt = torch.tensor([5, 9, 3, 7, 1, 2])
    # level 1: nodes a, b (children of the prompt); level 2: c under b, d under a.
    level1, level2 = torch.tensor([11, 12]), torch.tensor([13, 14])
    p = len(prompt)

    grown = _cache(model)
    grown.allocate("s", 16)
    model.forward(prompt, torch.arange(p), [SequenceSlice("s", 0, torch.arange(p))], grown, torch.tensor([p - 1]))
    pos1 = torch.tensor([p, p])
    model.forward(level1, pos1, [SequenceSlice("s", p, pos1, torch.eye(2, dtype=torch.bool))], grown, torch.arange(2))
    tail = torch.tensor([[False, True, True, False], [True, False, False, True]])  # c sees b, d sees a
    pos2 = torch.tensor([p + 1, p + 1])
    out = model.forward(level2, pos2, [SequenceSlice("s", p + 2, pos2, tail)], grown, torch.arange(2)).logits

    fresh = _cache(model)
    fresh.allocate("s", 16)
    model.forward(prompt, torch.arange(p), [SequenceSlice("s", 0, torch.arange(p))], fresh, torch.tensor([p - 1]))
    tokens = torch.tensor([11, 12, 13, 14])
    parents_mask = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([p, p, p + 1, p + 1])
    ref = model.forward(tokens, pos, [SequenceSlice("s", p, pos, parents_mask)], fresh, torch.tensor([2, 3])).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mask_wider_than_the_cache_is_refused(llama_dir):
    model = LlamaModel.from_pretrained(llama_dir, torch.device("cpu"), torch.float32)
    cache = _cache(model)
    cache.allocate("s", 16)
    with pytest.raises(ValueError, match="new_mask has shape"):
        model.forward(torch.tensor([1]), torch.tensor([0]), [SequenceSlice("s", 0, torch.tensor([0]), torch.ones(1, 3, dtype=torch.bool))],
                      cache, torch.tensor([0]))
