"""`evals.resident_memory`: the pages of an array the OS has mapped in, as `bench soak` subtracts them from RSS.

The reference is what the test itself touched: a fresh anonymous mapping has nothing resident, and
writing a span of it maps in at least that span (a kernel with transparent huge pages may map in up to 2 MiB
around each touched page, so the bound above allows that).
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest
import torch

from specserve.evals.resident_memory import resident_bytes, resident_mib
from specserve.kv_cache import BlockAllocator, PagedKVCache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency: Linux")

MIB = 2**20


def _fresh_pages(nbytes: int) -> np.ndarray:
    """Zeroed memory the OS has not mapped in yet, whatever malloc did before (an anonymous mapping of its own)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def test_untouched_memory_is_not_resident_and_written_memory_is():
    block = _fresh_pages(64 * MIB)
    assert resident_bytes(block) <= 2 * MIB
    block[: 16 * MIB] = 1
    assert 16 * MIB <= resident_bytes(block) <= 16 * MIB + 4 * MIB
    block[32 * MIB: 40 * MIB] = 1
    assert 24 * MIB <= resident_bytes(block) <= 24 * MIB + 8 * MIB


def test_the_kv_cache_is_untouched_until_written_as_the_soak_measures_it():
    # The real cache, as a server allocates it: 12 layers x 4096 slots x 4 heads x 64 dims, float32 = 48 MiB each.
    # Allocated after other big blocks came and went, as in a long test run or a server that reloads a model.
    for _ in range(3):
        scratch = np.zeros(48 * MIB, dtype=np.uint8)
        scratch[:] = 1
        del scratch
    cache = PagedKVCache(BlockAllocator(num_blocks=256, block_size=16), num_layers=12, num_kv_heads=4, head_dim=64,
                         device=torch.device("cpu"), dtype=torch.float32)
    before = resident_mib([cache.k, cache.v])
    cache.k[0] = 1.0  # one layer's 4 MiB
    after = resident_mib([cache.k, cache.v])
    assert before <= 4 and 4 <= after - before <= 8
    assert float(cache.v.abs().sum()) == 0.0 and float(cache.k[1:].abs().sum()) == 0.0  # zeroed, as promised
