"""What a target forward returns: the one type the model, the CPU kernels and CUDA graphs all produce."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardOutput:
    """logits: float[M, vocab] for `logit_rows`; hidden_states: {layer: [M_h, hidden]} for `hidden_rows`."""

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor]
