"""The EAGLE head: a decoder layer (or a few) that autoregresses in the target's feature space.

Feature ``f_i`` belongs to position ``i`` (the target's feature of token ``t_i``). The head consumes
the pair ``(f_i, t_{i+1})`` at position ``i`` and outputs a feature that predicts ``f_{i+1}``; its
logits predict ``t_{i+2}``. Two modes:

- ``eagle1`` (EAGLE-1/2): ``f`` is the target's final normed hidden state (transformers' index
  ``num_layers``, what the target's LM head reads). The layer input is ``fc([embed(t); f])`` (2H→H,
  with bias) and the first layer has no input norm; the predicted feature goes straight through the
  *target's* LM head.
- ``eagle3`` (EAGLE-3): ``f`` is ``fc([low; mid; high])`` (3H→H, no bias), three target layers fused.
  Attention reads ``[input_norm(embed(t)); hidden_norm(f)]`` (2H wide) with ``f`` as the residual
  (``hidden_norm(f)`` with ``norm_before_residual``, a SpecForge/speculators option);
  the output goes through the head's own ``norm`` and ``lm_head`` over a draft vocabulary of
  ``draft_vocab_size`` target tokens (``draft_to_target`` maps draft ids to target ids). When the
  head drafts past the root it feeds its own output feature in place of the fused target feature.

Heads of ``num_layers`` > 1 (speculators / SpecForge multi-layer drafts, EAGLE-1 ``layers.N``) run
layers 2..N as ordinary pre-norm decoder layers over the first layer's output (the residual
stream); the last layer's output is the head's output feature, as upstream feeds it back.

The token embeddings are the target's (shared, frozen, never saved) unless the head brings its own
that differ (``own_embed``: then they are a buffer of this module); the LM head of ``eagle1`` is
always the target's.

Its files (our format and the public EAGLE layouts) are read and written by `eagle_checkpoint`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import default_attention, make_backend
from specserve.config import ModelConfig, config_from_hf, llama_config
from specserve.kernels.attention import visible_keys
from specserve.kernels.linear import as_numpy
from specserve.kv_cache import BlockAllocator, PagedKVCache
from specserve.model import DecoderLayer
from specserve.rope import RotaryTable
from specserve.step_batch import StepBatch

MODES = ("eagle1", "eagle3")
CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle_head.safetensors"
FORMAT_VERSION = 2  # 2: the layer's tensors under ``layer.`` (DecoderLayer names); 1 still loads
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
    """What a head is. ``layer``: a Llama-style config dict of its decoder layers (hidden_size, heads,
    intermediate_size, rms_norm_eps, RoPE, max_position_embeddings). ``target``: what the target must
    be (``hidden_size``, ``vocab_size``, optionally ``num_layers``, ``model_type``, ``config_sha256``,
    ``tokenizer``). ``num_layers``: decoder layers (the first reads the head's input; the rest are
    plain layers over H). ``qkv_bias`` / ``o_bias`` / ``qk_norm``: the layers' Qwen2 biases, Llama's
    ``attention_bias`` (q/k/v and o), Qwen3's per-head norms. ``own_embed``: the head carries its own
    token embeddings (they differ from the target's). ``source``: what the loader detected (format,
    version, ...), for `describe_head`; not part of what the head is, never compared."""

    mode: str
    layer: dict
    vocab_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...]
    fc_bias: bool = True
    input_norm: bool = False  # eagle1: whether the layer normalises its input (public EAGLE-1: no)
    target: dict = field(default_factory=dict)
    num_layers: int = 1
    norm_before_residual: bool = False  # eagle3: the residual is hidden_norm(f) instead of f
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    own_embed: bool = False
    source: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"EAGLE head mode must be one of {MODES}, got {self.mode!r}")
        # eagle3's fc reads len(feature_layers) * H: three layers in EAGLE-3, any number in speculators.
        if (self.mode == "eagle1" and len(self.feature_layers) != 1) or not self.feature_layers:
            want = "1 target layer" if self.mode == "eagle1" else "at least one target layer"
            raise ValueError(f"an {self.mode} head reads {want}, got feature_layers={self.feature_layers}")
        if self.num_layers < 1:
            raise ValueError(f"an EAGLE head has at least one decoder layer, got num_layers={self.num_layers}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        if self.mode == "eagle1" and self.draft_vocab_size != self.vocab_size:
            raise ValueError("an eagle1 head uses the target's LM head: its draft vocabulary is the full vocabulary")

    @cached_property
    def model_config(self) -> ModelConfig:
        raw = {k: v for k, v in self.layer.items() if k not in ("architectures", "auto_map")}
        raw.update(model_type="llama", num_hidden_layers=self.num_layers, vocab_size=self.vocab_size,
                   hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
        try:
            mc = config_from_hf(llama_config(raw))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid EAGLE head layer config: {exc}") from exc
        # The one DecoderLayer reads these switches: set them from the head's own fields (the layer
        # family — Llama, Qwen2, Qwen3 — is a matter of these three, the rest is Llama's).
        return replace(mc, attention_bias=self.qkv_bias, o_proj_bias=self.o_bias, qk_norm=self.qk_norm)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        del d["source"]  # what a loader detected, not what the head is
        return d


class EagleHead(nn.Module):
    """The head: its input stage (``fc``, norms), target-style `DecoderLayer`s (``layer``, then
    ``later`` when ``num_layers`` > 1), its output stage.

    embed: float[V, H], the target's token embeddings; target_lm_head: float[V, H] (eagle1 only).
    Both are shared with the target and are not parameters of this module (with ``own_embed`` the
    head's own embeddings are the buffer ``embed_tokens`` and the target's are not used).

    Inference (`forward`) runs the layer over a `StepBatch` like any target layer: through the CPU
    kernels (`use_cpu_kernels`) or the torch layer with the target's attention backend, so a new
    kernel or backend reaches the head too. Training (`unroll`) reuses the same layer's projections.
    """

    def __init__(self, cfg: EagleHeadConfig, embed: torch.Tensor, target_lm_head: torch.Tensor | None = None,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32, attention: str | None = None) -> None:
        super().__init__()
        mc = cfg.model_config
        self.cfg, self.mc = cfg, mc
        h = mc.hidden_size
        self.hidden_size = h
        self.eps = mc.rms_norm_eps
        device = device or embed.device
        if tuple(embed.shape) != (cfg.vocab_size, h):
            raise ValueError(f"the target's embeddings are {tuple(embed.shape)}, the head needs [{cfg.vocab_size}, {h}]")
        eagle3 = cfg.mode == "eagle3"

        def p(*shape, fill=None):
            t = torch.empty(*shape, device=device, dtype=dtype)
            if fill is not None:
                t.fill_(fill)
            return nn.Parameter(t)

        self.fc = p(h, (len(cfg.feature_layers) if eagle3 else 2) * h)
        self.fc_bias = p(h, fill=0.0) if (cfg.fc_bias and not eagle3) else None
        # EAGLE-3 normalises the token embedding and the feature separately and attends over both.
        self.input_norm = p(h, fill=1.0) if eagle3 else None
        self.hidden_norm = p(h, fill=1.0) if eagle3 else None
        self.layer = DecoderLayer(mc, attn_in=2 * h if eagle3 else h, input_norm=not eagle3 and cfg.input_norm)
        # Layers 2..N (upstream's layers.1..): ordinary pre-norm layers over the residual stream.
        self.later = nn.ModuleList(DecoderLayer(mc) for _ in range(cfg.num_layers - 1))
        for layer in (self.layer, *self.later):
            layer.to(device=device, dtype=dtype)
            for name, w in layer.named_parameters():
                w.requires_grad_(True)
                if name in ("qkv", "o_proj", "gate_up", "down"):
                    nn.init.normal_(w, std=0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(w)
                else:
                    nn.init.ones_(w)
        self.norm = p(h, fill=1.0) if eagle3 else None
        self.lm_head = p(cfg.draft_vocab_size, h) if eagle3 else None
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size, device=device))
        for w in (self.fc, self.lm_head):
            if w is not None:
                nn.init.normal_(w, std=0.02)
        # Shared with the target (plain attributes: not parameters, not in the state dict), unless
        # the head brings its own embeddings: a frozen buffer, saved with the head.
        if cfg.own_embed:
            self.register_buffer("embed_tokens", torch.zeros(cfg.vocab_size, h, device=device, dtype=dtype))
        self._target_embed = embed.detach()
        if not eagle3:
            if target_lm_head is None or tuple(target_lm_head.shape) != (cfg.vocab_size, h):
                raise ValueError("an eagle1 head needs the target's LM head [vocab, hidden]")
            self.target_lm_head = target_lm_head.detach()
        else:
            self.target_lm_head = None
        self.rope = RotaryTable(mc, device, dtype)
        self.backend = make_backend(attention or default_attention(device), device)
        self.kernels: _HeadKernels | None = None

    @property
    def mode(self) -> str:
        return self.cfg.mode

    @property
    def embed(self) -> torch.Tensor:
        """The token embeddings the head reads [V, H]: its own when it has them, else the target's."""
        return self.embed_tokens if self.cfg.own_embed else self._target_embed

    @property
    def layers(self) -> list[DecoderLayer]:
        """Every decoder layer in order (index = the layer's place in the head's KV cache)."""
        return [self.layer, *self.later]

    def new_cache(self, allocator: BlockAllocator) -> PagedKVCache:
        """The head's KV cache (one layer per decoder layer) on the engine's block allocator."""
        dtype = torch.float32 if self.kernels is not None else self.fc.dtype
        return PagedKVCache(allocator, self.cfg.num_layers, self.mc.num_kv_heads, self.mc.head_dim, self.fc.device,
                            dtype)

    def kv_bytes_per_slot(self) -> int:
        """Cache bytes one token position takes in every layer of the head (fp32, the kernels' dtype and
        the widest one the head's cache uses)."""
        return PagedKVCache.bytes_per_slot(self.cfg.num_layers, self.mc.num_kv_heads, self.mc.head_dim, torch.float32)

    def use_cpu_kernels(self, target_kernels=None, storage: str | None = None) -> bool:
        """Run inference through `specserve.kernels` when the device and dtype allow it. target_kernels:
        the target's `ModelKernels` (an eagle1 head reads through the target's packed LM head); storage: the
        products' (None: `kernels.drafter_storage`'s beside a quantized target, else the head's dtype)."""
        from specserve.kernels import kernels_unsupported

        if kernels_unsupported(self.fc.device, self.fc.dtype, self.mc.head_dim) is not None:
            return False
        if self.mode == "eagle1" and target_kernels is None:
            return False
        self.kernels = _HeadKernels(self, target_kernels, storage)
        return True

    # ---- pieces shared by inference and training -------------------------------------------------

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def fuse(self, layers: list[torch.Tensor]) -> torch.Tensor:
        """Target features of the `feature_layers` ([..., H] each, in that order) → the head's input feature [..., H]."""
        if self.mode == "eagle1":
            return layers[0]
        if self.kernels is not None:
            return self.kernels.fc(torch.cat(layers, dim=-1))
        return F.linear(torch.cat(layers, dim=-1), self.fc)

    def _inputs(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual x [..., H], attention input [..., H or 2H] or None: the layer normalises x itself)."""
        e = self.embed[tokens]
        if self.mode == "eagle1":
            x = F.linear(torch.cat([e, feats], dim=-1), self.fc, self.fc_bias)
            return x, (None if self.layer.input_norm is not None else x)
        normed = self._rms(feats, self.hidden_norm)
        residual = normed if self.cfg.norm_before_residual else feats
        return residual, torch.cat([self._rms(e, self.input_norm), normed], dim=-1)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output features [R, H] → logits over the draft vocabulary [R, Vd] (float32)."""
        if self.kernels is not None:
            return self.kernels.logits(out)
        if self.mode == "eagle1":
            return F.linear(out, self.target_lm_head).float()
        return F.linear(self._rms(out, self.norm), self.lm_head).float()

    # ---- inference: paged cache, tree masks ------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, batch: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """Pairs (feature, token) of several sequences through the head over its paged cache.

        tokens int64[T] (target ids) and feats [T, H] (fused target features or the head's own
        outputs) are the StepBatch's rows; returns the output features [T, H].
        """
        if self.kernels is not None:
            return self.kernels.forward(tokens, feats, batch, cache)
        x, attn_input = self._inputs(tokens, feats)
        d = batch.device_arrays(cache.device)
        meta = self.backend.prepare(batch, cache)
        self.rope.cover(batch.num_positions)
        x = self.layer(0, x, d.positions, self.rope, self.backend, meta, cache, attn_input)
        for i, layer in enumerate(self.later, 1):
            x = layer(i, x, d.positions, self.rope, self.backend, meta, cache)
        return x

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
        self.rope.cover(t)
        i = positions[:, None]
        layers = self.layers
        keys, values = [[] for _ in layers], [[] for _ in layers]  # per layer: one entry per step
        outs = []
        x_in = feats
        for s in range(steps):
            if s:
                x_in = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # output at i-1 feeds position i
            blocks = [positions[None, :] <= i - s]  # step 0: causal, shifted by s
            blocks += [positions[None, :] == i - s + j for j in range(1, s + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, (s+1) T]
            x, h = self._inputs(tokens, x_in)
            for n, layer in enumerate(layers):
                if n or h is None:
                    h = self._rms(x, layer.input_norm)
                q, k, v = layer.project_qkv(h, positions, self.rope)
                keys[n].append(k)
                values[n].append(v)
                attn = F.scaled_dot_product_attention(
                    q.transpose(1, 2), torch.cat(keys[n], 1).transpose(1, 2), torch.cat(values[n], 1).transpose(1, 2),
                    attn_mask=mask, enable_gqa=layer.num_heads != layer.num_kv_heads,
                )  # [B, heads, T, hd]
                x = layer.finish(x, attn.transpose(1, 2).flatten(-2))
            outs.append(x)
        return outs


class _HeadKernels:
    """The head's products and its decoder layers on the CPU kernels (weights packed once)."""

    def __init__(self, head: EagleHead, target_kernels, storage: str | None = None) -> None:
        from specserve.kernels import LayerKernels, PackedLinear, drafter_storage

        # A quantized target's head runs quantized too (`drafter_storage`: 4-bit beside 4-bit layers, else 8-bit).
        storage = storage or drafter_storage(target_kernels) or {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(
            head.fc.dtype, "float32")
        self.head = head
        self.layers = [LayerKernels(layer, storage) for layer in head.layers]
        self.fc = PackedLinear(head.fc, head.fc_bias, storage)
        if head.mode == "eagle3":
            self.lm_head = PackedLinear(head.lm_head, None, storage)
            self.norm = head.norm.detach().float().numpy()
        else:
            self.lm_head = target_kernels.lm_head  # the target's own packed LM head, shared
            self.norm = None
        self.rope = RotaryTable(head.mc, torch.device("cpu"), torch.float32)  # fp32 tables whatever the weights' dtype
        self.embed = head.embed.float().numpy()
        self.input_norm = head.input_norm.detach().float().numpy() if head.input_norm is not None else None
        self.hidden_norm = head.hidden_norm.detach().float().numpy() if head.hidden_norm is not None else None
        from specserve.kernels.model_kernels import move_to_arena

        own = [*(p for layer in self.layers for p in layer.products()), self.fc] + ([self.lm_head] if head.mode == "eagle3" else [])
        self._arena = move_to_arena(own)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, batch: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """The head over a StepBatch, inputs included, in numpy and compiled calls (no torch ops)."""
        from specserve.kernels.layer import rms_norm
        from specserve.kernels.threads import apply_threads

        apply_threads()
        head = self.head
        ids = tokens.numpy()
        f = np.ascontiguousarray(as_numpy(feats))
        e = self.embed[ids]  # [T, H] float32
        eps = np.float32(head.eps)
        if head.mode == "eagle3":  # attention reads [input_norm(e); hidden_norm(f)], the residual is f
            # (hidden_norm(f) with norm_before_residual)
            hidden = f.shape[1]
            attn = np.empty((len(ids), 2 * hidden), dtype=np.float32)
            left, right = np.empty_like(e), np.empty_like(f)
            rms_norm(e, self.input_norm, eps, left)
            rms_norm(f, self.hidden_norm, eps, right)
            attn[:, :hidden], attn[:, hidden:] = left, right
            x = right.copy() if head.cfg.norm_before_residual else f.copy()
        else:  # x = fc([e; f]) + b, which the layer normalises itself when it has an input norm
            x = np.array(self.fc(torch.from_numpy(np.concatenate([e, f], axis=1))).numpy())
            attn = None if head.layer.input_norm is not None else x.copy()
        cos, sin = self.rope.arrays_for_batch(batch.num_positions)
        visible = visible_keys(batch, 0)
        for n, (layer, (k, v)) in enumerate(zip(self.layers, cache.layer_arrays())):
            layer(x, batch, k, v, cos, sin, visible, attn if n == 0 else None)  # later layers norm x themselves
        return torch.from_numpy(x)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            from specserve.kernels.layer import rms_norm

            rows = np.ascontiguousarray(as_numpy(out))
            normed = np.empty_like(rows)
            rms_norm(rows, self.norm, np.float32(self.head.eps), normed)
            out = torch.from_numpy(normed)
        return self.lm_head(out)
