"""Compiled softmax pieces for rows that live on the CPU: exp summed over a vocabulary-wide row, and the tempered
softmax a sampled row is drawn from.

numba's np.exp does not vectorise without Intel's SVML (10x slower than the loop below), so exp(d) is spelled
2^n * 2^f with n = floor(d log2 e), 2^f a degree-6 polynomial (relative error ~1e-6) and 2^n built from its
exponent bits: both loops vectorise. Terms below 2^-125 of the row maximum are 0, as a float32 softmax rounds
them (against the maximum's 1 in the sum they were lost to rounding anyway).
"""

from __future__ import annotations

import numba
import numpy as np

_LOG2E = np.float32(1.4426950408889634)
_FLOOR = np.float32(-125.0)  # terms at or below 2^-125 are 0 (2^n stays a normal float)


@numba.njit(cache=True, nogil=True, fastmath=True)
def sum_exp(row, hi, scale, p, bits):  # pragma: no cover - compiled
    """sum_j exp((row[j] - hi) * scale) for row[j] <= hi, in float32; leaves the terms as p[j] * 2^(bits[j])
    (p float32[V] the polynomial part, 0 for terms below 2^-125; bits int32[V] the exponent as float32 bits)."""
    v = row.shape[0]
    for j in range(v):
        d = (row[j] - hi) * scale * _LOG2E
        y = max(d, _FLOOR)
        n = np.floor(y)
        t = (y - n) * np.float32(0.6931471805599453)
        poly = np.float32(1.0) + t * (np.float32(1.0) + t * (np.float32(0.5) + t * (np.float32(1 / 6) + t * (
            np.float32(1 / 24) + t * (np.float32(1 / 120) + t * np.float32(1 / 720))))))
        p[j] = poly if d > _FLOOR else np.float32(0.0)
        bits[j] = (np.int32(n) + np.int32(127)) << 23
    powers = bits.view(np.float32)
    total = np.float32(0.0)
    for j in range(v):
        total += p[j] * powers[j]
    return total


@numba.njit(cache=True, nogil=True, fastmath=True)
def tempered_softmax(logits, rows, temperature, out):  # pragma: no cover - compiled
    """out[i] = softmax(logits[i] / temperature[i]) for each i in rows (logits, out float32[M, V]; temperature
    float32[M], clamped to the smallest normal float as `logits_to_probs` does); each row is computed alone,
    whatever else is in the call."""
    v = logits.shape[1]
    p = np.empty(v, np.float32)
    bits = np.empty(v, np.int32)
    powers = bits.view(np.float32)
    tiny = np.float32(1.1754943508222875e-38)
    for i in rows:
        row, o = logits[i], out[i]
        hi = row.max()
        scale = np.float32(1.0) / max(temperature[i], tiny)
        inv_total = np.float32(1.0) / sum_exp(row, hi, scale, p, bits)
        for j in range(v):
            o[j] = p[j] * powers[j] * inv_total
