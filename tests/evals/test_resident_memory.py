"""`evals.resident_memory`: the pages of an array the OS has mapped in, as `bench soak` subtracts them from RSS.

The reference is what the test itself touched: a fresh zeroed allocation has (almost) nothing resident, and
writing a span of it maps in at least that span (a kernel with transparent huge pages may map in up to 2 MiB
around each touched page, so the bound above allows that).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from specserve.evals.resident_memory import resident_bytes, resident_mib

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency: Linux")

MIB = 2**20


def test_untouched_zeroed_memory_is_not_resident_and_written_memory_is():
    block = np.zeros(64 * MIB, dtype=np.uint8)  # calloc: the OS maps pages in when first written
    assert resident_bytes(block) <= 2 * MIB
    block[: 16 * MIB] = 1
    assert 16 * MIB <= resident_bytes(block) <= 16 * MIB + 4 * MIB
    block[32 * MIB: 40 * MIB] = 1
    assert 24 * MIB <= resident_bytes(block) <= 24 * MIB + 8 * MIB


def test_the_kv_cache_tensors_are_measured_as_the_soak_passes_them():
    # 48 MiB each: above glibc's largest mmap threshold (32 MiB), so calloc maps fresh pages as for a real cache
    # (smaller blocks can come from a heap that earlier tests already wrote).
    k = torch.from_numpy(np.zeros((12, 1024, 1024), dtype=np.float32))
    v = torch.from_numpy(np.zeros((12, 1024, 1024), dtype=np.float32))
    before = resident_mib([k, v])
    k[0] = 1.0  # one layer's 4 MiB
    after = resident_mib([k, v])
    assert before <= 4 and 4 <= after - before <= 8
