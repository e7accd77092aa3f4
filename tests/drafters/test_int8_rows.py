"""Row-wise int8 storage (drafters/int8_rows.py) against its definition: scale = max|row| / 127, q = round(w / scale)."""

from __future__ import annotations

import pytest
import torch

from specserve.drafters.int8_rows import SCALE_SUFFIX, dequantize_rows, quantize_rows


def test_rows_round_trip_within_half_a_step_and_vectors_pass_through():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 33, generator=g, dtype=torch.float64) * torch.tensor([1e-3, 1.0, 10.0, 0.0, 3.0])[:, None].double()
    norm = torch.randn(33, generator=g)
    stored = quantize_rows({"w": w.float(), "norm": norm})
    assert stored["w"].dtype == torch.int8 and torch.equal(stored["norm"], norm)
    scale = w.abs().amax(dim=1) / 127
    assert torch.allclose(stored["w" + SCALE_SUFFIX].double(), torch.where(scale > 0, scale, 1.0), rtol=1e-6)
    back = dequantize_rows(stored, "test")
    assert set(back) == {"w", "norm"} and back["w"].dtype == torch.float32
    err = (back["w"].double() - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all())
    assert torch.equal(back["w"][3], torch.zeros(33))  # an all-zero row
    assert int(stored["w"].abs().max()) == 127


def test_int8_without_its_scales_is_refused():
    stored = quantize_rows({"w": torch.ones(2, 4)})
    del stored["w" + SCALE_SUFFIX]
    with pytest.raises(ValueError, match="needs float row scales"):
        dequantize_rows(stored, "file.safetensors")
    with pytest.raises(ValueError, match="scales no tensor"):
        dequantize_rows({"v" + SCALE_SUFFIX: torch.ones(2)}, "file.safetensors")
