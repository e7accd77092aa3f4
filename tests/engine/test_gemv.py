"""The CPU few-row products equal torch's, for every row count around the kernel's blocking.

`gemv.linear` takes its own path only outside autograd (as in every inference forward), so the tests
run under inference mode."""

from __future__ import annotations

import pytest
import torch

from specserve import gemv


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_torch(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(77, 33, generator=g)
    bias = torch.randn(77, generator=g) if with_bias else None
    x = torch.randn(33, rows, generator=g).t()  # non-contiguous input rows
    with torch.inference_mode():
        got = gemv.linear(x, weight, bias)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias),
                               atol=1e-5, rtol=1e-5)


def test_rows_matmul_writes_every_output():
    x = torch.ones(6, 5)
    weight = torch.arange(15, dtype=torch.float32).view(3, 5)
    with torch.inference_mode():
        out = gemv.linear(x, weight)
    assert out.shape == (6, 3)
    torch.testing.assert_close(out, weight.sum(1).expand(6, 3))
