"""Rotary position embeddings: cos/sin tables, grown on demand, gathered per token.

Inverse frequencies come from transformers' RoPE functions (default, linear, llama3, yarn, dynamic), so
every scaling variant matches the reference implementation exactly.

The tables are sized by the positions a forward actually reaches (`cover`), not by the config's
`max_position_embeddings`: that field is a training length, not a limit (an EAGLE head trained at
2048 drafts fine at position 5000, as upstream EAGLE grows its rotary cache too), and a Llama-3
config's 131072 positions would cost 128 MiB of tables per model for contexts nobody uses.

Dynamic NTK ("dynamic") scales the rotary base with the sequence length. transformers recomputes the
frequencies from the longest position in each forward, so a prompt's keys depend on how the prompt was
chunked. A serving stack cannot have that: chunked prefill and draft trees must rotate a position the
same way plain decoding does, or speculation would change the output. Here position ``p`` is rotated
with the frequencies of sequence length ``max(p + 1, original)`` — exactly what transformers computes
when it decodes one token at a time past the original context, and identical to the plain table below
it.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.config import ModelConfig, _rope_parameters

_FIRST_POSITIONS = 4096  # initial table length; doubled as longer contexts arrive


class RotaryTable:
    """cos/sin float[positions, head_dim] (HF's half-rotation layout), fp32 math, grown by `cover`."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        params = _rope_parameters(config.hf_config)
        self.rope_type = params.get("rope_type", "default")
        self.original_positions = config.max_position_embeddings  # where dynamic scaling starts
        if self.rope_type == "default":
            dim = config.head_dim
            theta = float(params.get("rope_theta", 10000.0))
            self._inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self._scale = 1.0
        else:
            self._inv_freq, self._scale = self._init_fn(seq_len=None)
        empty = torch.empty(0, config.head_dim, device=device, dtype=dtype)
        self.cos, self.sin = empty, empty
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # `arrays_for_batch`'s views of cos, sin
        self.cover(min(_FIRST_POSITIONS, config.max_position_embeddings))

    def _init_fn(self, seq_len):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[self.rope_type](self.config.hf_config, torch.device("cpu"), seq_len=seq_len)

    @property
    def num_positions(self) -> int:
        return int(self.cos.shape[0])

    def cover(self, num_positions: int) -> None:
        """Make positions 0 .. num_positions-1 available (doubling, so growth is amortised)."""
        have = self.num_positions
        if num_positions <= have:
            return
        new = max(num_positions, 2 * have)
        positions = torch.arange(have, new, dtype=torch.float32)
        freqs = positions[:, None] * self._inv_freq_at(have, new)  # [new - have, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self._scale).to(device=self.device, dtype=self.dtype)
        sin = (emb.sin() * self._scale).to(device=self.device, dtype=self.dtype)
        self.cos, self.sin = torch.cat([self.cos, cos]), torch.cat([self.sin, sin])

    def _inv_freq_at(self, start: int, stop: int) -> torch.Tensor:
        """Inverse frequencies of positions start..stop-1: [1, head_dim/2] (fixed) or [n, head_dim/2] (dynamic)."""
        if self.rope_type != "dynamic" or stop <= self.original_positions:
            return self._inv_freq.float()[None, :]
        # transformers' own function, handed one sequence length per position (it broadcasts over them).
        seq_lens = torch.arange(start + 1, stop + 1, dtype=torch.int64)[:, None]
        inv_freq, _ = self._init_fn(seq_len=seq_lens)
        return inv_freq.float()

    def arrays_for_batch(self, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) covering positions below num_positions (a batch's `num_positions`) as numpy views of the
        tables (a CPU table: the compiled kernels' form), made again only when the tables grow: every forward
        asks, on caches the last forward emptied, where each torch call costs tens of microseconds."""
        if self._arrays is None or num_positions > self._arrays[0].shape[0]:
            self.cover(num_positions)
            self._arrays = (self.cos.numpy(), self.sin.numpy())
        return self._arrays

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] by their positions [T] (already
        covered: callers `cover` from the host-side batch, which costs no device sync)."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
