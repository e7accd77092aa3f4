"""A GGUF tensor's bytes as what our kernels take: llama.cpp's Q8_0, Q4_0 and Q4_1 blocks split into their
integer weights and float16 scales (no requantization), every other type dequantized to float32.

llama.cpp's block layouts (ggml-common.h), per output row, one block per run of 32 inputs:

- Q8_0, 34 bytes: d (float16), qs int8[32]; weight = qs[i] · d.
- Q4_0, 18 bytes: d (float16), qs uint8[16]; input i < 16 is qs[i] & 0xF, input i + 16 is qs[i] >> 4;
  weight = (q - 8) · d.
- Q4_1, 20 bytes: d, m (float16), qs uint8[16] as Q4_0; weight = q · d + m.

K-quants, F16, BF16 and the rest go through the `gguf` package's own dequantizers (llama.cpp's formulas in
numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

RUN = 32  # inputs per block: QK8_0 = QK4_0 = QK4_1
NATIVE_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGML type name -> our kernels' format
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class QuantBlocks:
    """A weight [out, in] in one of llama.cpp's 32-input block formats, split for `PackedLinear.from_blocks`.

    fmt: "q8_0" | "q4_0" | "q4_1". q: int8[out, in] (q8_0) or uint8[out, in] nibble values 0..15 (q4_*);
    d: float16[out, in / 32]; m: float16[out, in / 32] (q4_1's minimum) or None.
    """

    fmt: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32[out, in] as llama.cpp's dequantize_row_* computes it (float32 products of exact values)."""
        out_features, in_features = self.q.shape
        runs = self.q.view(out_features, -1, RUN).float()  # [out, runs, 32]
        if self.fmt == "q4_0":
            runs -= 8.0
        runs *= self.d.float()[:, :, None]
        if self.fmt == "q4_1":
            runs += self.m.float()[:, :, None]
        return runs.view(out_features, in_features)

    def take_rows(self, index: torch.Tensor) -> "QuantBlocks":
        """The blocks of rows `index` (int64[out]), in that order: a row permutation moves whole rows."""
        return QuantBlocks(self.fmt, self.q[index], self.d[index], None if self.m is None else self.m[index])

    @staticmethod
    def concat(parts: list["QuantBlocks"]) -> "QuantBlocks | None":
        """Rows of `parts` stacked (a fused q|k|v or gate|up product), or None when their formats differ."""
        fmt = parts[0].fmt
        if any(p.fmt != fmt for p in parts):
            return None
        m = None if fmt != "q4_1" else torch.cat([p.m for p in parts])
        return QuantBlocks(fmt, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)


def _split(raw: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """Raw bytes of a [rows, in] tensor -> uint8[rows, in / 32, block_bytes]."""
    return np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)


def _half(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block: float16[rows, runs]."""
    return torch.from_numpy(np.ascontiguousarray(blocks[:, :, start:start + 2]).view(np.float16)[:, :, 0].copy())


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """qs uint8[rows, runs, 16] -> the 32 values per run in input order, uint8[rows, runs * 32]."""
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(qs.shape[0], -1))


def native_blocks(type_name: str, raw: np.ndarray, rows: int) -> QuantBlocks:
    """Q8_0 / Q4_0 / Q4_1 bytes of a [rows, in] tensor as `QuantBlocks` (the bits as stored)."""
    if type_name == "Q8_0":
        blocks = _split(raw, rows, 34)
        q = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, -1).copy())
        return QuantBlocks("q8_0", q, _half(blocks, 0))
    if type_name == "Q4_0":
        blocks = _split(raw, rows, 18)
        return QuantBlocks("q4_0", _nibbles(blocks[:, :, 2:]), _half(blocks, 0))
    if type_name == "Q4_1":
        blocks = _split(raw, rows, 20)
        return QuantBlocks("q4_1", _nibbles(blocks[:, :, 4:]), _half(blocks, 0), _half(blocks, 2))
    raise ValueError(f"{type_name} is not a block format the kernels run natively ({', '.join(NATIVE_FORMATS)})")


def float_weights(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Any other type's bytes as float32 of `shape` (torch order: [out, in]); F32/F16/BF16 exactly as stored."""
    if type_name == "F32":
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.float32).reshape(shape).copy())
    if type_name == "F16":
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).reshape(shape).copy()).float()
    if type_name == "BF16":
        bits = torch.from_numpy(np.ascontiguousarray(raw).view(np.int16).reshape(shape).copy())
        return bits.view(torch.bfloat16).float()
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(np.ascontiguousarray(raw).view(np.uint8), qtype)
                            .reshape(shape).astype(np.float32))


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter for q and k projections: it stores each head's rows reordered so the rotary
    pairs (i, i + head_dim / 2) of Hugging Face's rotate-half become adjacent (llama.cpp's interleaved rope).

    Returns int64[rows]: Hugging Face row r is GGUF row index[r]. (The converter wrote, per head, row
    2 j + s of GGUF = HF row s · half + j.)"""
    half = rows // heads // 2
    gguf_of_hf = torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
    return gguf_of_hf
