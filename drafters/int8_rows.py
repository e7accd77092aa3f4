"""Row-wise 8-bit storage of a drafter's matrices in a safetensors file (what lets a shipped draft model fit the
repository's budget: half of float16).

A float matrix W [R, C] is stored as ``name`` int8 [R, C] and ``name + SCALE_SUFFIX`` float32 [R], with
W[r] ≈ scale[r] * q[r] and scale[r] = max|W[r]| / 127 (symmetric, round to nearest). Vectors stay as they are.
Loading turns them back into floats; the CPU kernels then pack them as they pack any float weight.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = ".row_scale"


def quantize_rows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every 2-D float tensor stored as int8 rows plus their scales; other tensors unchanged."""
    out = {}
    for name, tensor in state.items():
        if tensor.dim() != 2 or not tensor.is_floating_point():
            out[name] = tensor
            continue
        w = tensor.detach().float()
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
        out[name] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        out[name + SCALE_SUFFIX] = scale.contiguous()
    return out


def dequantize_rows(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The float32 tensors of a state `quantize_rows` wrote (float tensors pass through). ValueError naming
    ``where`` for an int8 tensor without its scales, or scales that do not fit it."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] not in state:
                raise ValueError(f"{where}: {name!r} scales no tensor")
            continue
        if tensor.dtype != torch.int8:
            out[name] = tensor
            continue
        scale = state.get(name + SCALE_SUFFIX)
        if scale is None or tensor.dim() != 2 or tuple(scale.shape) != (tensor.shape[0],):
            raise ValueError(f"{where}: int8 tensor {name!r} needs float row scales {name + SCALE_SUFFIX!r} "
                             f"of shape [{tensor.shape[0]}]")
        out[name] = tensor.float() * scale.float()[:, None]
    return out
