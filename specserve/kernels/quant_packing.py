"""llama.cpp's quantized weights for `linear_quant.linear_rows_quant`: quantized from float weights by llama.cpp's
reference quantizers, or taken as given (a GGUF file's blocks: `pack_*_blocks` pack them without requantizing),
and packed into `linear`'s tiles.

Formats, per output row and run of 32 inputs (a short last run is padded with zero weights):
- Q8_0 (`quantize_q8`): float16 scale d = max|w| / 127, w ≈ q · d with q = round(w / d) in [-127, 127]; 8.5 bits a
  weight. round is half away from zero, computed as floor(|v| + 0.5) in float32 with v's sign — C's roundf but
  for values within an ulp below a half, which the float32 + 0.5 rounds up (the tests' references do the same).
- Q4_0 (`quantize_q4`): float16 d = m / -8 where m is the run's weight of largest magnitude (sign kept),
  w ≈ (q - 8) · d with q = min(15, trunc(w / d + 8.5)) in [0, 15]; 4.5 bits a weight.
- Q4_1 (`quantize_q4_1`): float16 d = (max - min) / 15 and float16 m = min of the run, w ≈ q · d + m with
  q = min(15, trunc((w - min) / d + 0.5)) in [0, 15]; 5 bits a weight.

Layout: weights are stored as unsigned values in `linear`'s tiles (blocks of 16 outputs, `tile_blocks` blocks a
tile, each tile one sequential stream), in groups of 4 consecutive inputs — one 64-byte slot holds a group of 4
inputs for 16 outputs, the shape vpdpbusd multiplies (unsigned by signed bytes):
- Q8_0 (`pack_q8_blocks`, uint8): q + 128, ``packed[t, (g * tb + i) * 64 + l * 4 + c] = q[16 (t * tb + i) + l, 4 g + c]
  + 128``.
- Q4_0 (`pack_q4_blocks`, nibble pairs in an int8-typed array — the dtype tags the format, as int16 and uint16
  tag bfloat16 and float16 bits): the stored q (the signed weight + 8, as llama.cpp stores it); slot (p, i) holds
  groups 2p (low nibbles) and 2p + 1 (high nibbles), ``packed[t, (p * tb + i) * 64 + l * 4 + c] = q[.., 8 p + c] |
  q[.., 8 p + 4 + c] << 4`` for output 16 (t tb + i) + l.
- Q4_1 (`pack_q4_1_blocks`): Q4_0's nibble pairs, the stored nibble q itself (weight q · d + m).
Scales: Q8_0, Q4_0: uint16[tiles * tile_blocks, runs * 16] float16 bits, [b, j * 16 + l] = output 16 b + l's d of
run j. Q4_1: uint32[tiles * tile_blocks, runs * 16] — a uint32 array only as the format's tag; viewed as uint16
[.., runs * 32], [b, j * 32 + l] = output 16 b + l's d of run j and [b, j * 32 + 16 + l] its m, float16 bits.
Inputs are padded to whole runs (Q8_0: q = 0; Q4_0: q = 8, zero weights; Q4_1: q = 0, whose weight m meets
x = 0), outputs to whole tiles (d = m = 0).

From blocks: a GGUF file's blocks pack as they are, after unpacking llama.cpp's nibble order (its Q4_0 / Q4_1
byte k of a run holds inputs k and k + 16: low, high nibble) into one q per input; `linear.PackedLinear.from_blocks`.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.kernels.simd import LANES, tiled_rows

Q8_BLOCK = 32  # inputs sharing one scale (llama.cpp's QK8_0, and QK4_0: both formats' runs)
GROUP = 4  # inputs per int32 lane of one 8-bit dot product
Q8_OFFSET = 128  # stored Q8_0 weight byte = q + 128 (unsigned)
Q4_OFFSET = 8  # stored Q4_0 nibble = the signed weight + 8 (llama.cpp's own storage)


def _runs(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] as float32 runs of 32 inputs, [out, ceil(in / 32), 32], a short last run padded with zeros."""
    w = w.detach().to("cpu", torch.float32)
    out_features, in_features = w.shape
    runs = -(-in_features // Q8_BLOCK)
    padded = torch.zeros(out_features, runs * Q8_BLOCK)
    padded[:, :in_features] = w
    return padded.view(out_features, runs, Q8_BLOCK)


def _check_scales(name: str, s: torch.Tensor, out_features: int, runs: int) -> None:
    if s.dtype != torch.float16 or tuple(s.shape) != (out_features, runs):
        raise ValueError(f"{name} must be float16 [{out_features}, {runs}] (one per output and run of 32 inputs), "
                         f"got {s.dtype} {tuple(s.shape)}")


def _check_nibbles(q: torch.Tensor) -> None:
    if q.dim() != 2 or q.dtype != torch.uint8:
        raise ValueError(f"4-bit blocks' q must be uint8 [out, in], got {q.dtype} {tuple(q.shape)}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"4-bit blocks' q must lie in 0..15, got {int(q.max())}")


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of w [out, in] (any float dtype): per output row and run of 32 inputs (the last run
    may be shorter), d = max|w| / 127 and q = round(w / d) (half away from zero, as roundf), clamped to
    ±127 (round: see the module docstring); d is stored as float16, as Q8_0 stores it. Returns (q int8[out, in], d float16[out, ceil(in/32)])."""
    out_features, in_features = w.shape
    runs = _runs(w)
    kblocks = runs.shape[1]
    d = runs.abs().amax(dim=2) / 127.0  # float32, as llama.cpp computes it
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = runs * inv[:, :, None]
    q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    return q.view(out_features, kblocks * Q8_BLOCK)[:, :in_features].contiguous(), d.to(torch.float16)


def _pack_scales(d: torch.Tensor, rows: int) -> np.ndarray:
    """d float16[out, runs] -> uint16[rows / 16, runs * 16] float16 bits, [b, j * 16 + l] = output 16 b + l's
    scale of run j (padding outputs: 0)."""
    runs = d.shape[1]
    padded = torch.zeros(rows, runs, dtype=torch.float16)
    padded[:d.shape[0]] = d
    blocks = padded.view(rows // LANES, LANES, runs).transpose(1, 2).reshape(rows // LANES, runs * LANES)
    return blocks.contiguous().view(torch.int16).numpy().view(np.uint16)


def _unpack_scales(scales: np.ndarray, out_features: int) -> torch.Tensor:
    """`_pack_scales`' inverse: float16[out, runs]."""
    blocks, runs = scales.shape[0], scales.shape[1] // LANES
    d = torch.from_numpy(scales.view(np.int16)).view(torch.float16).view(blocks, runs, LANES).transpose(1, 2)
    return d.reshape(blocks * LANES, runs)[:out_features].contiguous()


def pack_q8_blocks(q: torch.Tensor, d: torch.Tensor, tile_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks as given — q int8[out, in], d float16[out, ceil(in / 32)] — packed without requantizing:
    (weight uint8[tiles, runs * 32 * tile_blocks * 16], scales uint16[tiles * tile_blocks, runs * 16]) in the
    layout of the module docstring."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"Q8_0 blocks' q must be int8 [out, in], got {q.dtype} {tuple(q.shape)}")
    out_features, in_features = q.shape
    runs = -(-in_features // Q8_BLOCK)
    _check_scales("Q8_0 blocks' d", d, out_features, runs)
    rows, tiles = tiled_rows(out_features, tile_blocks)
    padded_in = runs * Q8_BLOCK
    qp = torch.zeros(rows, padded_in, dtype=torch.int16)
    qp[:out_features, :in_features] = q.to(torch.int16)
    stored = (qp + Q8_OFFSET).to(torch.uint8).view(tiles, tile_blocks, LANES, padded_in // GROUP, GROUP)
    weight = stored.permute(0, 3, 1, 2, 4).reshape(tiles, padded_in * tile_blocks * LANES).contiguous().numpy()
    return weight, _pack_scales(d, rows)


def pack_q8(w: torch.Tensor, tile_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> `pack_q8_blocks` of `quantize_q8(w)`; scales[b, j * 16 + l] holds output 16 b + l's float16
    scale of run j, as bits."""
    return pack_q8_blocks(*quantize_q8(w), tile_blocks)


def unpack_q8(weight: np.ndarray, scales: np.ndarray, tile_blocks: int, out_features: int, in_features: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_q8_blocks`' inverse: (q int8[out, in], d float16[out, runs])."""
    tiles, blocks = weight.shape[0], scales.shape[0]
    runs = scales.shape[1] // LANES
    q = torch.from_numpy(weight).view(tiles, runs * Q8_BLOCK // GROUP, tile_blocks, LANES, GROUP)
    q = q.permute(0, 2, 3, 1, 4).reshape(blocks * LANES, runs * Q8_BLOCK)
    q = (q.to(torch.int16) - Q8_OFFSET).to(torch.int8)
    return q[:out_features, :in_features].contiguous(), _unpack_scales(scales, out_features)


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_0 (quantize_row_q4_0_ref) of w [out, in] (any float dtype): per output row and run of 32
    inputs, m = the run's weight of largest magnitude (the first, sign kept), d = m / -8, and the stored
    q = min(15, trunc(w / d + 8.5)) in [0, 15], so w ≈ (q - 8) · d; d is stored as float16. Inputs past `in`
    (a short last run) get q = 8, a zero weight. Returns (q uint8[out, runs * 32], d float16[out, runs])."""
    out_features, in_features = w.shape
    blocks = _runs(w)
    runs = blocks.shape[1]
    largest = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True))[:, :, 0]  # argmax: the first maximum
    d = largest / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(blocks * inv[:, :, None] + 8.5), max=15).to(torch.uint8)
    q = q.view(out_features, runs * Q8_BLOCK)
    q[:, in_features:] = Q4_OFFSET
    return q, d.to(torch.float16)


def _pack_nibbles(q: torch.Tensor, rows: int, runs: int, tile_blocks: int, pad: int) -> np.ndarray:
    """Stored 4-bit q uint8[out, <= runs * 32] -> nibble pairs int8-typed [tiles, runs * 16 * tile_blocks * 16]
    (Q4_0's layout), inputs and outputs past q's padded with `pad`."""
    out_features, in_features = q.shape
    tiles = rows // (LANES * tile_blocks)
    padded_in = runs * Q8_BLOCK
    qp = torch.full((rows, padded_in), pad, dtype=torch.uint8)
    qp[:out_features, :in_features] = q
    pairs = qp.view(tiles, tile_blocks, LANES, padded_in // (2 * GROUP), 2, GROUP)
    nibbles = pairs[:, :, :, :, 0, :] | (pairs[:, :, :, :, 1, :] << 4)  # [tiles, tb, 16, pairs, 4]
    weight = nibbles.permute(0, 3, 1, 2, 4).reshape(tiles, padded_in // 2 * tile_blocks * LANES).contiguous()
    return weight.numpy().view(np.int8)


def _unpack_nibbles(weight: np.ndarray, tile_blocks: int, runs: int) -> torch.Tensor:
    """`_pack_nibbles`' inverse: uint8[tiles * tile_blocks * 16, runs * 32] (padding included)."""
    tiles = weight.shape[0]
    nibbles = torch.from_numpy(weight.view(np.uint8)).view(tiles, runs * Q8_BLOCK // (2 * GROUP), tile_blocks, LANES,
                                                            GROUP)
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=4)  # [tiles, pairs, tb, 16, 2, 4]
    return q.permute(0, 2, 3, 1, 4, 5).reshape(tiles * tile_blocks * LANES, runs * Q8_BLOCK)


def pack_q4_blocks(q: torch.Tensor, d: torch.Tensor, tile_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 blocks as given — stored q uint8[out, runs * 32] in 0..15 (weight = (q - 8) · d; q may also be [out, in]
    with in <= runs * 32: the rest is padded with 8, zero weights), d float16[out, runs] — packed without
    requantizing: (weight int8-typed nibble pairs [tiles, runs * 16 * tile_blocks * 16], scales uint16[tiles *
    tile_blocks, runs * 16] float16 bits) in the layout of the module docstring."""
    _check_nibbles(q)
    out_features, runs = q.shape[0], -(-q.shape[1] // Q8_BLOCK)
    _check_scales("Q4_0 blocks' d", d, out_features, runs)
    rows, _ = tiled_rows(out_features, tile_blocks)
    return _pack_nibbles(q, rows, runs, tile_blocks, Q4_OFFSET), _pack_scales(d, rows)


def pack_q4(w: torch.Tensor, tile_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> `pack_q4_blocks` of `quantize_q4(w)`."""
    return pack_q4_blocks(*quantize_q4(w), tile_blocks)


def unpack_q4(weight: np.ndarray, scales: np.ndarray, tile_blocks: int, out_features: int, in_features: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_q4_blocks`' inverse: (stored q uint8[out, in] in [0, 15], d float16[out, runs])."""
    q = _unpack_nibbles(weight, tile_blocks, scales.shape[1] // LANES)
    return q[:out_features, :in_features].contiguous(), _unpack_scales(scales, out_features)


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 (quantize_row_q4_1_ref) of w [out, in] (any float dtype), in float32 as it computes: per
    output row and run of 32 inputs, min and max of the run, d = (max - min) / 15, id = 1 / d (0 when d is 0),
    q = min(15, trunc((w - min) · id + 0.5)) in [0, 15], d and m = min stored as float16; w ≈ q · d + m. A short
    last run (llama.cpp has none) is padded with zeros, which count in its min and max; inputs past `in` get
    q = 0. Returns (q uint8[out, runs * 32], d float16[out, runs], m float16[out, runs])."""
    out_features, in_features = w.shape
    blocks = _runs(w)
    runs = blocks.shape[1]
    lo, hi = blocks.amin(dim=2), blocks.amax(dim=2)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc((blocks - lo[:, :, None]) * inv[:, :, None] + 0.5), max=15).to(torch.uint8)
    q = q.view(out_features, runs * Q8_BLOCK)
    q[:, in_features:] = 0
    return q, d.to(torch.float16), lo.to(torch.float16)


def pack_q4_1_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, tile_blocks: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Q4_1 blocks as given — q uint8[out, runs * 32] in 0..15 (or [out, in], in <= runs * 32: the rest padded
    with 0), d and m float16[out, runs], weight = q · d + m — packed without requantizing: (weight int8-typed nibble
    pairs [tiles, runs * 16 * tile_blocks * 16], scales uint32[tiles * tile_blocks, runs * 16] holding d and m)
    in the layout of the module docstring."""
    _check_nibbles(q)
    out_features, runs = q.shape[0], -(-q.shape[1] // Q8_BLOCK)
    _check_scales("Q4_1 blocks' d", d, out_features, runs)
    _check_scales("Q4_1 blocks' m", m, out_features, runs)
    rows, _ = tiled_rows(out_features, tile_blocks)
    d_bits, m_bits = _pack_scales(d, rows), _pack_scales(m, rows)  # [blocks, runs * 16] each
    blocks = rows // LANES
    both = np.stack([d_bits.reshape(blocks, runs, LANES), m_bits.reshape(blocks, runs, LANES)], axis=2)
    scales = np.ascontiguousarray(both.reshape(blocks, runs * 2 * LANES)).view(np.uint32)
    return _pack_nibbles(q, rows, runs, tile_blocks, 0), scales


def pack_q4_1(w: torch.Tensor, tile_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> `pack_q4_1_blocks` of `quantize_q4_1(w)`."""
    return pack_q4_1_blocks(*quantize_q4_1(w), tile_blocks)


def unpack_q4_1(weight: np.ndarray, scales: np.ndarray, tile_blocks: int, out_features: int, in_features: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_q4_1_blocks`' inverse: (q uint8[out, in] in [0, 15], d float16[out, runs], m float16[out, runs])."""
    blocks, runs = scales.shape[0], scales.shape[1] // LANES
    both = scales.view(np.uint16).reshape(blocks, runs, 2, LANES)
    d = _unpack_scales(np.ascontiguousarray(both[:, :, 0]).reshape(blocks, runs * LANES), out_features)
    m = _unpack_scales(np.ascontiguousarray(both[:, :, 1]).reshape(blocks, runs * LANES), out_features)
    q = _unpack_nibbles(weight, tile_blocks, runs)
    return q[:out_features, :in_features].contiguous(), d, m
