"""Rotary position embeddings: cos/sin tables for every position, gathered per token.

Inverse frequencies come from transformers' RoPE functions (default, linear, llama3, yarn), so every
scaling variant matches the reference implementation exactly.
"""

from __future__ import annotations

import torch

from specserve.config import ModelConfig, _rope_parameters


class RotaryTable:
    """cos/sin of shape [max_positions, head_dim] (HF's half-rotation layout), fp32 math."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        params = _rope_parameters(config.hf_config)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = config.head_dim
            theta = float(params.get("rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            scale = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config, torch.device("cpu"))
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)  # [max_pos, head_dim]
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] by their positions [T]."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
