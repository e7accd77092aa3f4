"""llama.cpp's reference quantizers (ggml-quants.c: quantize_row_q8_0_ref, quantize_row_q4_0_ref,
quantize_row_q4_1_ref), written here in float32 numpy from their definitions, as the tests' reference for our
int8, int4 and q4_1 weights."""

from __future__ import annotations

import numpy as np


def q8_0_reference(w: np.ndarray, scale_dtype=np.float16) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_0_ref, row by row, in float32 numpy: per run of 32 inputs,
    d = amax / 127, id = 1 / d (0 when d is 0), q = roundf(x * id) (half away from zero; computed as
    floor(|v| + 0.5) in float32, as our kernels do, which rounds up values within an ulp below a half), d kept as
    float16 (weights; the kernel keeps activations' d as float32: scale_dtype). Returns (q int8 [out, in],
    d [out, ceil(in / 32)])."""
    out_features, in_features = w.shape
    runs = -(-in_features // 32)
    q = np.zeros((out_features, in_features), dtype=np.int8)
    d16 = np.zeros((out_features, runs), dtype=scale_dtype)
    for o in range(out_features):
        for j in range(runs):
            x = w[o, 32 * j: 32 * j + 32].astype(np.float32)
            d = np.float32(np.abs(x).max()) / np.float32(127)
            inv = np.float32(1) / d if d else np.float32(0)
            scaled = (x * inv).astype(np.float32)
            q[o, 32 * j: 32 * j + 32] = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)
            d16[o, j] = d
    return q, d16


def q4_0_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q4_0_ref, row by row, in float32 numpy: per run of 32 inputs, m = the value of
    largest magnitude (the first one, sign kept), d = m / -8, id = 1 / d (0 when d is 0), stored
    q = min(15, (int8)(x * id + 8.5)) (truncation), d kept as float16; the weight is (q - 8) * d. A short last
    run is padded with zeros. Returns (q uint8 [out, in] in [0, 15], d float16 [out, ceil(in / 32)])."""
    out_features, in_features = w.shape
    runs = -(-in_features // 32)
    q = np.zeros((out_features, in_features), dtype=np.uint8)
    d16 = np.zeros((out_features, runs), dtype=np.float16)
    for o in range(out_features):
        for j in range(runs):
            x = w[o, 32 * j: 32 * j + 32].astype(np.float32)
            amax, m = np.float32(0), np.float32(0)
            for v in x:
                if amax < abs(v):
                    amax, m = abs(v), v
            d = m / np.float32(-8)
            inv = np.float32(1) / d if d else np.float32(0)
            q[o, 32 * j: 32 * j + 32] = np.minimum(15, ((x * inv).astype(np.float32) + np.float32(8.5)).astype(np.int8))
            d16[o, j] = d
    return q, d16


def q4_1_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q4_1_ref, row by row, in float32 numpy: per run of 32 inputs, min and max of the
    run, d = (max - min) / 15, id = 1 / d (0 when d is 0), q = min(15, (int8)((x - min) * id + 0.5)) (truncation;
    each operation rounded to float32), d and m = min kept as float16; the weight is q * d + m. A short last run
    (llama.cpp has none) is padded with zeros, which take part in its min and max (as ours do). Returns
    (q uint8 [out, in] in [0, 15], d float16 [out, ceil(in / 32)], m float16 [out, ceil(in / 32)])."""
    out_features, in_features = w.shape
    runs = -(-in_features // 32)
    padded = np.zeros((out_features, runs * 32), dtype=np.float32)
    padded[:, :in_features] = w
    q = np.zeros((out_features, runs * 32), dtype=np.uint8)
    d16 = np.zeros((out_features, runs), dtype=np.float16)
    m16 = np.zeros((out_features, runs), dtype=np.float16)
    for o in range(out_features):
        for j in range(runs):
            x = padded[o, 32 * j: 32 * j + 32]
            lo, hi = np.float32(np.inf), np.float32(-np.inf)
            for v in x:
                lo, hi = min(lo, v), max(hi, v)
            d = np.float32(hi - lo) / np.float32(15)
            inv = np.float32(1) / d if d else np.float32(0)
            scaled = ((x - lo).astype(np.float32) * inv).astype(np.float32)
            q[o, 32 * j: 32 * j + 32] = np.minimum(15, (scaled + np.float32(0.5)).astype(np.float32).astype(np.int8))
            d16[o, j], m16[o, j] = d, lo
    return q[:, :in_features], d16, m16
