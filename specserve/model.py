"""Our Llama-family decoder: one forward for prefill, decode and tree verification over a paged cache.

Weights are loaded from a Hugging Face directory and stored fused (q|k|v in one matrix, gate|up in
another) so a layer is four matmuls. On CPU in fp32, products of up to 16 rows (batch-1 decode, small
verify trees) go through `specserve.gemv`, which streams weights much faster than torch's MKL there.
Hidden states follow transformers' `hidden_states` numbering:
index 0 is the embedding output, index i the output of layer i-1, and index `num_layers` the final
normed state (what the LM head reads) — so drafter heads trained against transformers line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import BACKENDS, SequenceSlice
from specserve.checkpoint import load_state_dict
from specserve.config import ModelConfig, load_config
from specserve import gemv
from specserve.kv_cache import PagedKVCache
from specserve.rope import RotaryTable


@dataclass
class ForwardOutput:
    """logits: float[M, vocab] for `logit_rows`; hidden_states: {layer: [M_h, hidden]} for `hidden_rows`."""

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.eps = cfg.rms_norm_eps
        inter = cfg.intermediate_size
        self.input_norm = _param(h)
        self.post_attn_norm = _param(h)
        self.qkv = _param(self.q_size + 2 * self.kv_size, h)  # [q | k | v, hidden]
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        self.o_proj = _param(h, self.q_size)
        self.o_bias = _param(h) if cfg.o_proj_bias else None
        self.gate_up = _param(2 * inter, h)  # [gate | up, hidden]
        self.gate_up_bias = _param(2 * inter) if cfg.mlp_bias else None
        self.down = _param(h, inter)
        self.down_bias = _param(h) if cfg.mlp_bias else None

    def forward(self, layer_idx, x, positions, rope, backend, meta, cache):  # x: [T, hidden]
        t = x.shape[0]
        qkv = gemv.linear(F.rms_norm(x, (x.shape[-1],), self.input_norm, self.eps), self.qkv, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope.apply(q, k, positions)
        attn = backend.attend(layer_idx, q, k, v, meta, cache)  # [T, heads * head_dim]
        x = x + gemv.linear(attn, self.o_proj, self.o_bias)
        normed = F.rms_norm(x, (x.shape[-1],), self.post_attn_norm, self.eps)
        gate, up = gemv.linear(normed, self.gate_up, self.gate_up_bias).chunk(2, dim=-1)
        return x + gemv.linear(F.silu(gate) * up, self.down, self.down_bias)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, attention: str = "sdpa") -> None:
        super().__init__()
        if attention not in BACKENDS:
            raise ValueError(f"unknown attention backend {attention!r}; available: {sorted(BACKENDS)}")
        self.config = cfg
        self.device, self.dtype = device, dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)  # rows looked up per token
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        if device.type == "cpu" and dtype == torch.float32:
            gemv.prepare()
        self.rope = RotaryTable(cfg, device, dtype)
        self.backend = BACKENDS[attention](sliding_window=cfg.sliding_window)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: torch.device, dtype: torch.dtype, attention: str = "sdpa") -> "LlamaModel":
        cfg = load_config(model_dir)
        model = cls(cfg, device, dtype, attention)
        model.load_hf_state(load_state_dict(model_dir, cfg, device, dtype))
        return model

    @torch.no_grad()
    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take HF-named tensors (already checked by the loader) and fuse them into our layout."""
        self.embed.data = state["model.embed_tokens.weight"]
        self.norm.data = state["model.norm.weight"]
        if not self.config.tie_word_embeddings:
            self.lm_head.data = state["lm_head.weight"]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.data = state[p + "input_layernorm.weight"]
            layer.post_attn_norm.data = state[p + "post_attention_layernorm.weight"]
            layer.qkv.data = torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            if layer.qkv_bias is not None:
                layer.qkv_bias.data = torch.cat([state[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            layer.o_proj.data = state[p + "self_attn.o_proj.weight"]
            if layer.o_bias is not None:
                layer.o_bias.data = state[p + "self_attn.o_proj.bias"]
            layer.gate_up.data = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
            if layer.gate_up_bias is not None:
                layer.gate_up_bias.data = torch.cat([state[p + "mlp.gate_proj.bias"], state[p + "mlp.up_proj.bias"]])
            layer.down.data = state[p + "mlp.down_proj.weight"]
            if layer.down_bias is not None:
                layer.down_bias.data = state[p + "mlp.down_proj.bias"]

    def bytes_read_per_token(self) -> int:
        """Weight bytes one decode step streams: every layer, the final norm and the LM head (the
        embedding table is only indexed). The numerator of the bandwidth floor."""
        tensors = [self.norm, self.lm_head, *(p for layer in self.layers for p in layer.parameters())]
        return sum(p.numel() * p.element_size() for p in tensors)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SequenceSlice],
        cache: PagedKVCache,
        logit_rows: torch.Tensor,
        hidden_layers: tuple[int, ...] = (),
        hidden_rows: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run new tokens of several sequences through the model.

        input_ids:  int64[T] new tokens of every sequence, concatenated in `seqs` order.
        positions:  int64[T] their RoPE positions.
        logit_rows: int64[M] rows of T whose logits are returned.
        hidden_rows: int64[M_h] rows of T whose hidden states of `hidden_layers` are returned
                    (default: `logit_rows`). EAGLE needs every prompt row's features, logits only the last.
        Returns logits float32[M, vocab] and {layer: [M_h, hidden]}.
        """
        if hidden_rows is None:
            hidden_rows = logit_rows
        meta = self.backend.prepare(seqs, cache)
        x = self.embed[input_ids]  # [T, hidden]
        hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in hidden_layers:
                hidden[i] = x[hidden_rows]
            x = layer(i, x, positions, self.rope, self.backend, meta, cache)
        if self.config.num_layers in hidden_layers:
            hidden[self.config.num_layers] = F.rms_norm(x[hidden_rows], (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        x = F.rms_norm(x[logit_rows], (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        head = gemv.linear(x, self.lm_head)
        logits = head.float()  # [M, vocab]
        return ForwardOutput(logits=logits, hidden_states=hidden)
