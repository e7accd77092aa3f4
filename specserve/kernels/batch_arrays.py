"""A `StepBatch`'s per-token index arrays in one compiled pass (`StepBatchBuilder.build`).

Every forward builds them, and right after the previous forward has streamed the weights through the caches each
numpy call costs several microseconds: as a dozen vectorised calls (cumsum, repeat, fancy indexing) they took
~110 µs of a plain step's ~160 µs build on those caches; one call does the same arithmetic in a loop.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def token_arrays(lens, cached, tables, block_size):
    """(cu_query_lens int32[B+1], token_seq int32[T], slot_mapping int64[T]) for B sequences bringing lens int32[B]
    new tokens each after cached int32[B] entries, their block tables int32[B, max_blocks]: new token i of sequence
    b is written at slot index cached[b] + i, in block tables[b, (cached[b] + i) // block_size]."""
    num_seqs = lens.shape[0]
    cu = np.zeros(num_seqs + 1, dtype=np.int32)
    for b in range(num_seqs):
        cu[b + 1] = cu[b] + lens[b]
    token_seq = np.empty(cu[num_seqs], dtype=np.int32)
    slot_mapping = np.empty(cu[num_seqs], dtype=np.int64)
    for b in range(num_seqs):
        for i in range(lens[b]):
            index = cached[b] + i
            token_seq[cu[b] + i] = b
            slot_mapping[cu[b] + i] = np.int64(tables[b, index // block_size]) * block_size + index % block_size
    return cu, token_seq, slot_mapping
