"""A whole Llama decoder layer as one compiled call on the CPU: norm, QKV, (Qwen3's per-head q/k norms,)
rotary, KV write, paged tree attention, output projection + residual, norm, gate/up, SiLU, down + residual.

One call per layer instead of dozens of torch ops: on a small model a plain step was mostly per-op
overhead. Every piece computes a row from that row alone, in a fixed order (`linear_rows`,
`paged_attention`, and the row-wise loops here), so the layer is batch-invariant: a row's output does
not depend on which other rows share the call, nor on the thread count.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from specserve.kernels.attention import paged_attention
from specserve.kernels.linear import linear_rows
from specserve.kernels.simd import LANES, store_float, vadd, vbroadcast, vdiv, vexp, vload, vmul, vstore, vsub, vzero
from specserve.numba_cache import CALLS_PARALLEL_KERNELS


@numba.njit(inline="always")
def rms_norm_rows(x, weight, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, float32, summed in index order."""
    rows, dim = x.shape
    for t in range(rows):
        total = np.float32(0.0)
        for i in range(dim):
            total += x[t, i] * x[t, i]
        inv = np.float32(1.0) / np.float32(math.sqrt(total / np.float32(dim) + eps))
        for i in range(dim):
            out[t, i] = (x[t, i] * inv) * weight[i]


@numba.njit(inline="always")
def head_norms(qkv, q_norm, k_norm, eps, num_heads, num_kv, head_dim):
    """Qwen3's per-head RMSNorm, in place on qkv [T, (heads + 2 kv) * d]: every q head scaled by
    q_norm [d], every k head by k_norm [d], v untouched; each head summed in index order."""
    rows = qkv.shape[0]
    for t in range(rows):
        for h in range(num_heads + num_kv):  # the k heads follow the q heads in the fused row
            weight = q_norm if h < num_heads else k_norm
            start = h * head_dim
            total = np.float32(0.0)
            for i in range(head_dim):
                total += qkv[t, start + i] * qkv[t, start + i]
            inv = np.float32(1.0) / np.float32(math.sqrt(total / np.float32(head_dim) + eps))
            for i in range(head_dim):
                qkv[t, start + i] = (qkv[t, start + i] * inv) * weight[i]


@numba.njit(inline="always")
def _rotate(vec, cos, sin, out, at):
    """HF's half rotation: out[at : at + head_dim] = vec * cos + rotate_half(vec) * sin (vec: [head_dim]; out 1-D,
    float32 or a float16 KV cache's bits: `store_float`)."""
    half = vec.shape[0] // 2
    for i in range(half):
        a, b = vec[i], vec[i + half]
        store_float(out, at + i, a * cos[i] - b * sin[i])
        store_float(out, at + i + half, b * cos[i + half] + a * sin[i + half])


@numba.njit(inline="always")
def rope_and_write_cache(qkv, cos, sin, positions, slot_mapping, num_heads, num_kv, head_dim, q_out, k_cache, v_cache):
    """Split qkv [T, (heads + 2 kv) * d] into rotated q (-> q_out [T, heads, d]) and rotated k and v
    written to the cache slots `slot_mapping` (k_cache/v_cache [slots, kv_heads, d]: float32, or float16 bits as
    uint16 — each value rounded to the nearest float16 as it is written)."""
    rows = qkv.shape[0]
    k_start = num_heads * head_dim
    v_start = k_start + num_kv * head_dim
    q_flat, k_flat, v_flat = q_out.reshape(-1), k_cache.reshape(-1), v_cache.reshape(-1)
    for t in range(rows):
        pos = positions[t]
        c, s = cos[pos], sin[pos]
        slot = slot_mapping[t]
        for h in range(num_heads):
            _rotate(qkv[t, h * head_dim:(h + 1) * head_dim], c, s, q_flat, (t * num_heads + h) * head_dim)
        for g in range(num_kv):
            at = (slot * num_kv + g) * head_dim
            _rotate(qkv[t, k_start + g * head_dim:k_start + (g + 1) * head_dim], c, s, k_flat, at)
            for i in range(head_dim):
                store_float(v_flat, at + i, qkv[t, v_start + g * head_dim + i])


@numba.njit(inline="always")
def silu_mul(gate_up, out):
    """out = silu(gate) * up, with gate_up [T, 2I] = [gate | up]; 16 lanes at a time (`vexp`), a scalar
    tail when I is not a multiple of 16 (a fixed split by index: every row is computed alike)."""
    rows, inter = out.shape
    one = vbroadcast(np.float32(1.0))
    for t in range(rows):
        row, dst = gate_up[t], out[t]
        i = 0
        while i + LANES <= inter:
            g = vload(row, i)
            vstore(dst, i, vmul(vdiv(g, vadd(one, vexp(vsub(vzero(), g)))), vload(row, inter + i)))
            i += LANES
        for i in range(i, inter):
            g = row[i]
            dst[i] = (g / (np.float32(1.0) + np.float32(math.exp(-g)))) * row[inter + i]


@numba.njit(parallel=CALLS_PARALLEL_KERNELS, boundscheck=False, cache=True)
def decoder_layer(x, attn_input, input_norm, post_norm, q_norm, k_norm, eps,
                  qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, gate_up_w, gate_up_s, gate_up_b, down_w, down_s, down_b, inter,
                  num_heads, num_kv, head_dim, cos, sin, k_cache, v_cache, positions, slot_mapping, slots, seen_counts,
                  threads):
    """One decoder layer over a StepBatch, updating the residual stream x float32[T, hidden] in place.

    attn_input: float32[T, in] what attention reads; pass an empty [0, 0] array to use
                rms_norm(x, input_norm) (a target layer); an EAGLE-3 head passes its own.
    q_norm, k_norm: float32[head_dim] per-head norms applied before rotary (Qwen3), or both empty [0].
    *_w, *_s:   `PackedLinear.weight`s and `.scales`; *_b their float32 biases; inter: intermediate size.
    cos, sin:   float32[max_positions, head_dim] rotary tables; k_cache, v_cache: this layer's cache.
    positions, slot_mapping: the StepBatch arrays; slots, seen_counts: its visible keys (`attention.visible_keys`).
    threads:    the kernel threads (`threads.get_threads`), for how attention splits its work.
    """
    rows, hidden = x.shape
    if attn_input.shape[0] == 0:
        attn_input = np.empty((rows, hidden), dtype=np.float32)
        rms_norm_rows(x, input_norm, eps, attn_input)
    qkv = np.empty((rows, (num_heads + 2 * num_kv) * head_dim), dtype=np.float32)
    linear_rows(attn_input, qkv_w, qkv_s, qkv_b, qkv, False)
    if q_norm.shape[0] > 0:
        head_norms(qkv, q_norm, k_norm, eps, num_heads, num_kv, head_dim)
    q = np.empty((rows, num_heads, head_dim), dtype=np.float32)
    rope_and_write_cache(qkv, cos, sin, positions, slot_mapping, num_heads, num_kv, head_dim, q, k_cache, v_cache)
    attn = np.empty((rows, num_heads, head_dim), dtype=np.float32)
    scale = np.float32(1.0 / math.sqrt(head_dim))
    paged_attention(q, k_cache, v_cache, slots, seen_counts, scale, attn, threads)
    linear_rows(attn.reshape(rows, num_heads * head_dim), o_w, o_s, o_b, x, True)
    normed = np.empty((rows, hidden), dtype=np.float32)
    rms_norm_rows(x, post_norm, eps, normed)
    gate_up = np.empty((rows, 2 * inter), dtype=np.float32)
    linear_rows(normed, gate_up_w, gate_up_s, gate_up_b, gate_up, False)
    act = np.empty((rows, inter), dtype=np.float32)
    silu_mul(gate_up, act)
    linear_rows(act, down_w, down_s, down_b, x, True)


@numba.njit(boundscheck=False, cache=True)
def rms_norm(x, weight, eps, out):
    """`rms_norm_rows` callable from Python: x, out float32[T, dim] (C-contiguous), weight float32[dim]."""
    rms_norm_rows(x, weight, eps, out)
