"""Device and dtype choice: fp32 on CPU, bf16 on CUDA.

On the CPU the dtype is how weights are *stored*: the CPU kernels widen bfloat16/float16 weights as they
load them and always compute in float32 (bf16 arithmetic is pathologically slow there), so half-size
storage halves the bytes read per token. Without the kernels (a model they do not cover) torch computes
in the dtype itself, which is slow on the CPU for anything but float32.
"""

from __future__ import annotations

import logging

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
log = logging.getLogger("specserve")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available on this machine")
    return torch.device(name)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype
