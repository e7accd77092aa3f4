"""Device and dtype choice: on CUDA bf16; on the CPU the checkpoint's own storage (see below).

On the CPU the dtype is how weights are *stored*: the CPU kernels widen bfloat16/float16 weights as they
load them and always compute in float32 (bf16 arithmetic is pathologically slow there), so half-size
storage halves the bytes read per token. By default a checkpoint saved in float16 or bfloat16 keeps its
weights at that size — exactly its own values, so the logits equal float32 storage's bitwise (measured on
the embedded model, BENCHMARKS.md) at half the bytes — and anything else is stored float32. Without the
kernels (a model they do not cover) torch computes in the dtype itself, which is slow on the CPU for
anything but float32, so such models stay float32 by default.
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


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device,
                  checkpoint_dtype: torch.dtype | None = None, cpu_kernels: bool = False) -> torch.dtype:
    """The dtype asked for, or the default: bf16 on CUDA; on the CPU the checkpoint's own half-size
    storage when the CPU kernels will run the model, else float32."""
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16
        if cpu_kernels and checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    """The dtype a checkpoint says its weights are stored in (config.json's `dtype` / `torch_dtype`)."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return _DTYPES.get(str(value)) if value is not None else None
