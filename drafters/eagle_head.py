"""The EAGLE head: one decoder layer that autoregresses in the target's feature space.

Feature ``f_i`` belongs to position ``i`` (the target's feature of token ``t_i``). The head consumes
the pair ``(f_i, t_{i+1})`` at position ``i`` and outputs a feature that predicts ``f_{i+1}``; its
logits predict ``t_{i+2}``. Two modes:

- ``eagle1`` (EAGLE-1/2): ``f`` is the target's final normed hidden state (transformers' index
  ``num_layers``, what the target's LM head reads). The layer input is ``fc([embed(t); f])`` (2H→H,
  with bias) and the first layer has no input norm; the predicted feature goes straight through the
  *target's* LM head.
- ``eagle3`` (EAGLE-3): ``f`` is ``fc([low; mid; high])`` (3H→H, no bias), three target layers fused.
  Attention reads ``[input_norm(embed(t)); hidden_norm(f)]`` (2H wide) with ``f`` as the residual;
  the output goes through the head's own ``norm`` and ``lm_head`` over a draft vocabulary of
  ``draft_vocab_size`` target tokens (``draft_to_target`` maps draft ids to target ids). When the
  head drafts past the root it feeds its own output feature in place of the fused target feature.

The token embeddings (and, for ``eagle1``, the LM head) are the target's: shared, frozen, never saved.

Its files (our format and the public EAGLE layouts) are read and written by `eagle_checkpoint`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from specserve import gemv
from specserve.attention import SdpaBackend, SequenceSlice
from specserve.config import ModelConfig, config_from_hf
from specserve.kv_cache import PagedKVCache
from specserve.rope import RotaryTable

MODES = ("eagle1", "eagle3")
CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle_head.safetensors"
FORMAT_VERSION = 1
# Config fields that change with how a checkpoint is exported, not with the model it describes.


def default_feature_layers(mode: str, num_layers: int) -> tuple[int, ...]:
    """The target layers (transformers' hidden_states numbering) a head reads.

    eagle1: the final normed state. eagle3: low, mid and high layers — EAGLE-3's own choice
    ``(2, L // 2, L - 3)`` for targets of 8+ layers; for smaller ones ``(1, L // 2, L - 1)``
    (6 layers: 1, 3, 5), which keeps the three distinct as long as possible.
    """
    if mode == "eagle1":
        return (num_layers,)
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return (min(1, num_layers), num_layers // 2, max(num_layers - 1, 0))


@dataclass(frozen=True)
class EagleHeadConfig:
    """What a head is. ``layer``: a Llama-style config dict of its decoder layer (hidden_size, heads,
    intermediate_size, rms_norm_eps, RoPE, max_position_embeddings). ``target``: what the target must
    be (``hidden_size``, ``vocab_size``, optionally ``num_layers``, ``model_type``, ``config_sha256``,
    ``tokenizer``)."""

    mode: str
    layer: dict
    vocab_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...]
    fc_bias: bool = True
    input_norm: bool = False  # eagle1: whether the layer normalises its input (public EAGLE-1: no)
    target: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"EAGLE head mode must be one of {MODES}, got {self.mode!r}")
        want = 1 if self.mode == "eagle1" else 3
        if len(self.feature_layers) != want:
            raise ValueError(f"an {self.mode} head reads {want} target layer(s), got feature_layers={self.feature_layers}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        if self.mode == "eagle1" and self.draft_vocab_size != self.vocab_size:
            raise ValueError("an eagle1 head uses the target's LM head: its draft vocabulary is the full vocabulary")

    @cached_property
    def model_config(self) -> ModelConfig:
        from transformers import LlamaConfig

        raw = {k: v for k, v in self.layer.items() if k not in ("architectures", "auto_map")}
        raw.update(model_type="llama", num_hidden_layers=1, vocab_size=self.vocab_size, hidden_act="silu",
                   attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
        try:
            return config_from_hf(LlamaConfig(**raw))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid EAGLE head layer config: {exc}") from exc

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d


class EagleHead(nn.Module):
    """The head's weights (fused q|k|v and gate|up, stored [out, in]) and its forward passes.

    embed: float[V, H], the target's token embeddings; target_lm_head: float[V, H] (eagle1 only).
    Both are shared with the target and are not parameters of this module.
    """

    def __init__(self, cfg: EagleHeadConfig, embed: torch.Tensor, target_lm_head: torch.Tensor | None = None,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        mc = cfg.model_config
        self.cfg, self.mc = cfg, mc
        h, hd = mc.hidden_size, mc.head_dim
        self.hidden_size, self.head_dim = h, hd
        self.num_heads, self.num_kv_heads = mc.num_heads, mc.num_kv_heads
        self.q_size, self.kv_size = mc.num_heads * hd, mc.num_kv_heads * hd
        self.eps = mc.rms_norm_eps
        device = device or embed.device
        if tuple(embed.shape) != (cfg.vocab_size, h):
            raise ValueError(f"the target's embeddings are {tuple(embed.shape)}, the head needs [{cfg.vocab_size}, {h}]")
        eagle3 = cfg.mode == "eagle3"
        attn_in = 2 * h if eagle3 else h

        def p(*shape, fill=None):
            t = torch.empty(*shape, device=device, dtype=dtype)
            if fill is not None:
                t.fill_(fill)
            return nn.Parameter(t)

        self.fc = p(h, (3 if eagle3 else 2) * h)
        self.fc_bias = p(h, fill=0.0) if (cfg.fc_bias and not eagle3) else None
        self.input_norm = p(h, fill=1.0) if (eagle3 or cfg.input_norm) else None
        self.hidden_norm = p(h, fill=1.0) if eagle3 else None
        self.qkv = p(self.q_size + 2 * self.kv_size, attn_in)
        self.o_proj = p(h, self.q_size)
        self.post_norm = p(h, fill=1.0)
        self.gate_up = p(2 * mc.intermediate_size, h)
        self.down = p(h, mc.intermediate_size)
        self.norm = p(h, fill=1.0) if eagle3 else None
        self.lm_head = p(cfg.draft_vocab_size, h) if eagle3 else None
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size, device=device))
        for w in (self.fc, self.qkv, self.o_proj, self.gate_up, self.down, self.lm_head):
            if w is not None:
                nn.init.normal_(w, std=0.02)
        # Shared with the target (plain attributes: not parameters, not in the state dict).
        self.embed = embed.detach()
        if not eagle3:
            if target_lm_head is None or tuple(target_lm_head.shape) != (cfg.vocab_size, h):
                raise ValueError("an eagle1 head needs the target's LM head [vocab, hidden]")
            self.target_lm_head = target_lm_head.detach()
        else:
            self.target_lm_head = None
        self.rope = RotaryTable(mc, device, dtype)
        self.backend = SdpaBackend()
        # What GrowingKV reads to size a cache for this head (one layer).
        self.kv_spec = SimpleNamespace(config=SimpleNamespace(num_layers=1, num_kv_heads=self.num_kv_heads, head_dim=hd),
                                       device=device, dtype=dtype)

    @property
    def mode(self) -> str:
        return self.cfg.mode

    # ---- pieces shared by inference and training -------------------------------------------------

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def fuse(self, layers: list[torch.Tensor]) -> torch.Tensor:
        """Target features of the `feature_layers` ([..., H] each, in that order) → the head's input feature [..., H]."""
        if self.mode == "eagle1":
            return layers[0]
        return gemv.linear(torch.cat(layers, dim=-1), self.fc)

    def _inputs(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual x [..., H], attention input [..., H or 2H]) of pairs (feature, token)."""
        e = self.embed[tokens]
        if self.mode == "eagle1":
            x = gemv.linear(torch.cat([e, feats], dim=-1), self.fc, self.fc_bias)
            return x, (self._rms(x, self.input_norm) if self.input_norm is not None else x)
        return feats, torch.cat([self._rms(e, self.input_norm), self._rms(feats, self.hidden_norm)], dim=-1)

    def _qkv(self, h: torch.Tensor, positions: torch.Tensor):
        """h [..., T, in] → q [..., T, heads, hd], k, v [..., T, kv_heads, hd], RoPE applied at `positions` [T]."""
        q, k, v = gemv.linear(h, self.qkv).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        q, k = self.rope.apply(q, k, positions)
        return q, k, v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + gemv.linear(attn, self.o_proj)
        gate, up = gemv.linear(self._rms(x, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return x + gemv.linear(F.silu(gate) * up, self.down)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output features [R, H] → logits over the draft vocabulary [R, Vd] (float32)."""
        if self.mode == "eagle1":
            return gemv.linear(out, self.target_lm_head).float()
        return gemv.linear(self._rms(out, self.norm), self.lm_head).float()

    # ---- inference: paged cache, tree masks ------------------------------------------------------

    @torch.inference_mode()
    def forward_paged(self, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                      seqs: list[SequenceSlice], cache: PagedKVCache) -> torch.Tensor:
        """Pairs of several sequences through the head over its own one-layer paged cache.

        tokens int64[T] (target ids), feats [T, H] (fused target features or the head's own outputs),
        positions int64[T]; `seqs` as for `LlamaModel.forward`. Returns the output features [T, H].
        """
        meta = self.backend.prepare(seqs, cache)
        x, h = self._inputs(tokens, feats)
        q, k, v = self._qkv(h, positions)
        return self._finish(x, self.backend.attend(0, q, k, v, meta, cache))

    # ---- training: every position at once, unrolled on the head's own outputs --------------------

    def unroll(self, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: ``steps`` passes over whole sequences.

        tokens int64[B, T]: ``t_{i+1}`` at pair position i; feats [B, T, H]: the input features of
        step 0 (fused target features ``f_i``). Step s >= 1 feeds at position i the output of step
        s-1 at position i-1 — what drafting feeds at depth s+1 — and attends like a drafted node:
        to step-0 entries at positions <= i-s and to the step-j entry at position i-s+j (j = 1..s),
        its own chain. Positions i < s have no such chain; their outputs are meaningless (mask them).
        Returns the output features [B, T, H] of each step.
        """
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        i = positions[:, None]
        keys, values, outs = [], [], []
        x_in = feats
        for s in range(steps):
            if s:
                x_in = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # output at i-1 feeds position i
            x, h = self._inputs(tokens, x_in)
            q, k, v = self._qkv(h, positions)
            keys.append(k)
            values.append(v)
            blocks = [positions[None, :] <= i - s]  # step 0: causal, shifted by s
            blocks += [positions[None, :] == i - s + j for j in range(1, s + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, (s+1) T]
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2), torch.cat(values, 1).transpose(1, 2),
                attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads,
            )  # [B, heads, T, hd]
            outs.append(self._finish(x, attn.transpose(1, 2).flatten(-2)))
        return outs
