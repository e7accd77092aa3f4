"""Attention backends: a batch of sequences, each bringing new tokens with a tree mask, over a paged cache.

A backend reads only the `StepBatch` (flat arrays: positions, slot mapping, block tables, packed tree
masks) — never per-request objects — so it serves the target, draft models and EAGLE heads alike.
`prepare(batch, cache)` runs once per forward and its result is shared by every layer;
`attend(layer, q, k, v, meta, cache)` runs per layer: it writes the step's K/V into the cache, then
attends over cached + new entries.

- ``sdpa`` (`sdpa.py`): gathers keys into a padded batch for torch's scaled_dot_product_attention —
  the reference, and the default off CUDA.
- ``triton`` (`triton_backend.py`): one Triton kernel reading K/V through the block table, GQA and
  tree masks included, for decode, verification and prefill chunks alike; its launch shapes depend
  only on the batch's bucket, so CUDA graphs replay it. The default on CUDA. Off CUDA it runs only under
  Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI checks it.
- CPU few-row forwards do not come here at all: `specserve.kernels` runs the whole layer, attention
  included, in compiled code over the same StepBatch.

Backends load lazily: importing this package never imports triton.
"""

from __future__ import annotations

import importlib
import os

import torch

# name -> (module, class): imported only when a model asks for that backend.
BACKENDS: dict[str, tuple[str, str]] = {
    "sdpa": ("specserve.attention.sdpa", "SdpaBackend"),
    "triton": ("specserve.attention.triton_backend", "TritonBackend"),
}


def default_attention(device: torch.device | str) -> str:
    """The backend a model on `device` gets when none is asked for: ``triton`` on CUDA, else ``sdpa``."""
    return "triton" if torch.device(device).type == "cuda" else "sdpa"


def make_backend(name: str, device: torch.device | str, sliding_window: int | None = None):
    """A backend instance for a model on `device`; a clear ValueError for an unknown or unusable one."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    if name == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention 'triton' runs on CUDA devices; on the CPU only under Triton's interpreter "
                         "(set TRITON_INTERPRET=1, slow: for tests) — use attention='sdpa' here")
    module, cls = BACKENDS[name]
    try:
        backend_cls = getattr(importlib.import_module(module), cls)
    except ImportError as exc:  # triton is in the `gpu` extra (and in torch's CUDA wheels)
        raise ValueError(f"attention {name!r} needs a package that is not installed: {exc}") from None
    return backend_cls(sliding_window=sliding_window)
