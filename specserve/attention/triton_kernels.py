"""Triton kernels of the ``triton`` attention backend: paged tree attention and the KV write.

One attention kernel serves every kind of forward the engine runs — a decode token, a verify tree (root +
nodes under the ancestor mask), a prompt chunk (causal), a drafter level whose mask also covers earlier
levels cached as "tail" entries — because all of them are the StepBatch case "n new rows over a paged
context, the last `width` keys under a mask". A split into decode and prefill kernels would buy little
here: the tile loop below already stops at the causal edge, and a single kernel keeps one set of mask
semantics to test (tests/compute_kernels/test_triton_attention.py checks it against the sdpa backend and a
float64 reference under TRITON_INTERPRET=1).

Grid: (sequences, query tiles, kv heads). A program owns BLOCK_Q = BLOCK_M // GROUP query rows of one
sequence times the GROUP query heads that share one kv head (GQA: K/V are loaded once for the group),
and streams that sequence's keys through its block table in BLOCK_N-key tiles with an online softmax.
The grid depends only on (num_seqs, max_query_len) — padded bucket shapes under CUDA graphs — and
programs past their sequence's rows run no iterations, so padding costs a launch slot, not work.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_tree_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_query_lens_ptr, context_lens_ptr, block_tables_ptr, mask_offsets_ptr, mask_widths_ptr, tree_mask_ptr,
    positions_ptr,
    stride_q_row, stride_q_head, stride_cache_slot, stride_cache_head, stride_out_row, stride_out_head,
    stride_table,
    scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """q [T, heads, D] · cache [slots, kv_heads, D] -> out [T, heads, D] (StepBatch semantics, step_batch.py).

    FP32_DOT: both dots in float32 with IEEE precision (not TF32): float32 storage, and half storage under
    the interpreter, whose bf16 tl.dot is wrong — the upcast products of bf16 values are exact in float32,
    and P is still rounded to the storage dtype first, as the native half-precision dot does on a GPU.
    """
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP

    row0 = tl.load(cu_query_lens_ptr + seq)
    qlen = tl.load(cu_query_lens_ptr + seq + 1) - row0
    q_start = tile * BLOCK_Q
    # Row m of the tile: query q_start + m // GROUP, head kv_head * GROUP + m % GROUP.
    m = tl.arange(0, BLOCK_M)
    q_local = q_start + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (q_local < qlen)
    rows = row0 + q_local
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_q_row + head[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    ctx = tl.load(context_lens_ptr + seq)
    cached = ctx - qlen
    width = tl.load(mask_widths_ptr + seq)
    mask_offset = tl.load(mask_offsets_ptr + seq)
    is_tree = mask_offset >= 0
    tail_start = ctx - width  # keys from here on follow the mask (causal among the new rows without one)
    shift = width - qlen  # mask column of a row's own key = its query index + shift
    # Without a tree mask no row of this tile sees past its last query's own key: stop there.
    causal_end = tl.minimum(ctx, tail_start + shift + q_start + BLOCK_Q)
    kv_end = tl.where(is_tree, ctx, causal_end)
    kv_end = tl.where(q_start < qlen, kv_end, 0)
    q_pos = tl.load(positions_ptr + rows, mask=row_ok, other=0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < kv_end
        block = tl.load(block_tables_ptr + seq * stride_table + j // BLOCK_SIZE, mask=j_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
        kv_offsets = slot[:, None] * stride_cache_slot + kv_head * stride_cache_head + d[None, :]
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_ok, other=0.0)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [BLOCK_M, BLOCK_N] float32

        col = j - tail_start
        in_tail = col >= 0
        causal_ok = col[None, :] <= (q_local + shift)[:, None]
        # Read the mask only where a tree sequence's tail is (col < 0 columns never exist in it); the
        # bound is written as a column limit because a scalar bool in a mask trips Triton's interpreter.
        tree_cols = tl.where(is_tree, width, 0)
        tree_ok = tl.load(tree_mask_ptr + mask_offset + q_local[:, None] * width + col[None, :],
                          mask=row_ok[:, None] & (in_tail & j_ok & (col < tree_cols))[None, :], other=0) != 0
        tail_ok = tl.where(is_tree, tree_ok, causal_ok)
        visible = ((in_tail == 0)[None, :] | tail_ok) & j_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            # A cached key j sits at position j (committed in order); a new key at its row's position.
            new_pos = tl.load(positions_ptr + row0 + j - cached, mask=j_ok & (j >= cached), other=0)
            key_pos = tl.where(j < cached, j, new_pos)
            visible = visible & ((q_pos[:, None] - key_pos[None, :]) < window)

        s = tl.where(visible, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_ok, other=0.0)
        if FP32_DOT:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out_row + head[:, None] * stride_out_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_k_row, stride_v_row, stride_cache_slot,
                    ROW: tl.constexpr, ROW_P: tl.constexpr):
    """Row t of k/v [T, ROW] -> cache slot slot_mapping[t] ([slots, ROW]); a negative slot (a padding row of
    a CUDA-graph bucket) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    offsets = tl.arange(0, ROW_P)
    ok = offsets < tl.where(slot >= 0, ROW, 0)
    k = tl.load(k_ptr + t * stride_k_row + offsets, mask=ok)
    v = tl.load(v_ptr + t * stride_v_row + offsets, mask=ok)
    tl.store(k_cache_ptr + slot * stride_cache_slot + offsets, k, mask=ok)
    tl.store(v_cache_ptr + slot * stride_cache_slot + offsets, v, mask=ok)
