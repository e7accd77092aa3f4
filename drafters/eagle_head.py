"""The EAGLE head: one decoder layer that autoregresses in the target's feature space, and its files.

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

Files: our format is ``eagle_config.json`` (mode, feature layers, draft vocabulary size, the head
layer's Llama-style config, and the target it was trained for: hidden size, vocabulary, layers,
model type, config and tokenizer fingerprints) + ``eagle_head.safetensors`` (this module's
state dict). The public layouts load too: EAGLE-1/2 (``config.json`` + ``pytorch_model.bin`` or
``model.safetensors`` with ``fc.weight``, ``fc.bias``, ``layers.0.self_attn.q_proj.weight``, ...)
and EAGLE-3 (``midlayer.*``, ``fc.weight`` [H, 3H], ``norm.weight``, ``lm_head.weight`` [Vd, H],
``d2t`` — target id minus draft id — and ``t2d``; ``draft_vocab_size`` in config.json).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import SdpaBackend, SequenceSlice
from specserve.config import ModelConfig, config_from_hf
from specserve import gemv
from specserve.kv_cache import PagedKVCache
from specserve.rope import RotaryTable

MODES = ("eagle1", "eagle3")
CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle_head.safetensors"
FORMAT_VERSION = 1
# Config fields that change with how a checkpoint is exported, not with the model it describes.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "torch_dtype", "dtype", "_name_or_path")


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


def new_head_config(target_dir: str | Path, mode: str, draft_vocab_size: int | None = None,
                    feature_layers: tuple[int, ...] | None = None) -> EagleHeadConfig:
    """The config of a fresh head for the target in ``target_dir``: the target's layer shape and RoPE,
    its identity (sizes, model type, fingerprints), EAGLE's feature layers unless given."""
    target_dir = Path(target_dir)
    raw = _read_json(target_dir / "config.json")
    try:
        num_layers, vocab, hidden = int(raw["num_hidden_layers"]), int(raw["vocab_size"]), int(raw["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{str(target_dir / 'config.json')!r} is not a Llama-family config: {exc}") from exc
    layer = {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
                                 "rope_parameters") if raw.get(k) is not None}
    target = {"hidden_size": hidden, "vocab_size": vocab, "num_layers": num_layers, "model_type": raw.get("model_type"),
              **target_fingerprint(target_dir)}
    if mode not in MODES:
        raise ValueError(f"EAGLE head mode must be one of {MODES}, got {mode!r}")
    if mode == "eagle1":
        draft_vocab_size = vocab
    return EagleHeadConfig(mode=mode, layer=layer, vocab_size=vocab, draft_vocab_size=draft_vocab_size or vocab,
                           feature_layers=tuple(feature_layers or default_feature_layers(mode, num_layers)),
                           fc_bias=mode == "eagle1", input_norm=False, target=target)


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
        self.use_gemv = False  # inference on CPU fp32: few-row products through specserve.gemv
        # What GrowingKV reads to size a cache for this head (one layer).
        self.kv_spec = SimpleNamespace(config=SimpleNamespace(num_layers=1, num_kv_heads=self.num_kv_heads, head_dim=hd),
                                       device=device, dtype=dtype)

    @property
    def mode(self) -> str:
        return self.cfg.mode

    # ---- pieces shared by inference and training -------------------------------------------------

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.use_gemv and x.dim() == 2:
            return gemv.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def fuse(self, layers: list[torch.Tensor]) -> torch.Tensor:
        """Target features of the `feature_layers` ([..., H] each, in that order) → the head's input feature [..., H]."""
        if self.mode == "eagle1":
            return layers[0]
        return self._linear(torch.cat(layers, dim=-1), self.fc)

    def _inputs(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual x [..., H], attention input [..., H or 2H]) of pairs (feature, token)."""
        e = self.embed[tokens]
        if self.mode == "eagle1":
            x = self._linear(torch.cat([e, feats], dim=-1), self.fc, self.fc_bias)
            return x, (self._rms(x, self.input_norm) if self.input_norm is not None else x)
        return feats, torch.cat([self._rms(e, self.input_norm), self._rms(feats, self.hidden_norm)], dim=-1)

    def _qkv(self, h: torch.Tensor, positions: torch.Tensor):
        """h [..., T, in] → q [..., T, heads, hd], k, v [..., T, kv_heads, hd], RoPE applied at `positions` [T]."""
        q, k, v = self._linear(h, self.qkv).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        q, k = self.rope.apply(q, k, positions)
        return q, k, v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self._linear(attn, self.o_proj)
        gate, up = self._linear(self._rms(x, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return x + self._linear(F.silu(gate) * up, self.down)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output features [R, H] → logits over the draft vocabulary [R, Vd] (float32)."""
        if self.mode == "eagle1":
            return self._linear(out, self.target_lm_head).float()
        return self._linear(self._rms(out, self.norm), self.lm_head).float()

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


# ---- fingerprints ---------------------------------------------------------------------------------


def target_fingerprint(model_dir: str | Path | None) -> dict:
    """``config_sha256`` (of config.json's content, without export-only fields such as dtype) and
    ``tokenizer`` (training/tokenizer.py's fingerprint) of a target directory; None where absent."""
    out: dict[str, Any] = {"config_sha256": None, "tokenizer": None}
    if model_dir is None:
        return out
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if config.is_file():
        try:
            raw = json.loads(config.read_text())
        except (OSError, ValueError):
            raw = None
        if isinstance(raw, dict):
            canon = {k: v for k, v in raw.items() if k not in _VOLATILE_CONFIG_KEYS}
            out["config_sha256"] = hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()
    if (model_dir / "tokenizer.json").is_file():
        from specserve.training.tokenizer import tokenizer_fingerprint

        try:
            out["tokenizer"] = tokenizer_fingerprint(model_dir)
        except (OSError, ValueError):
            pass
    return out


# ---- our format -------------------------------------------------------------------------------------


def save_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``eagle_config.json`` + ``eagle_head.safetensors`` (in ``dtype``, default the head's)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in head.state_dict().items():
        t = t.detach().cpu().contiguous()
        state[name] = t.to(dtype) if (dtype is not None and t.is_floating_point()) else t
    tmp = out_dir / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / WEIGHTS_FILE)
    config = {"format": FORMAT_VERSION, "kind": "eagle_head", **head.cfg.to_dict()}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


def load_head(path: str | Path, target, device: torch.device | None = None, dtype: torch.dtype | None = None) -> EagleHead:
    """Load a head (our format or a public EAGLE-1/2/3 layout) for ``target`` (a `TargetInfo` whose
    ``model`` is the target `LlamaModel`). ValueError when it was made for another target."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"EAGLE head directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"EAGLE head path {str(path)!r} is not a directory")
    if (path / CONFIG_FILE).is_file():
        cfg, state = _read_ours(path)
    elif (path / "config.json").is_file():
        cfg, state = _read_public(path, target)
    else:
        raise FileNotFoundError(f"{str(path)!r} holds no EAGLE head: expected {CONFIG_FILE} + {WEIGHTS_FILE} "
                                "(specserve train eagle) or a public EAGLE layout (config.json + weights)")
    _check_target(cfg, target, path)
    model = target.model
    if model is None:
        raise ValueError("an EAGLE head needs the target model (TargetInfo.model) for its embeddings")
    device = device or target.device
    dtype = dtype or target.dtype
    head = EagleHead(cfg, model.embed, model.lm_head if cfg.mode == "eagle1" else None, device, dtype)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"EAGLE head in {str(path)!r} does not match its config: missing {missing}, unexpected {unexpected}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"EAGLE head in {str(path)!r}: tensor {name!r} has shape {tuple(state[name].shape)}, "
                             f"its config implies {shape}")
    d2t = state["draft_to_target"]
    if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= cfg.vocab_size or d2t.unique().numel() != d2t.numel()):
        raise ValueError(f"EAGLE head in {str(path)!r}: its draft→target vocabulary map is not a set of distinct target ids")
    with torch.no_grad():
        for name, tensor in head.state_dict().items():
            tensor.copy_(state[name].to(tensor.dtype))
    head.requires_grad_(False)
    return head


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as exc:  # safetensors raises its own types for truncated/corrupt files
        raise ValueError(f"{str(file)!r} is not a readable safetensors file (corrupt or truncated?): {exc}") from exc


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{str(file)!r} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object")
    return data


def _read_ours(path: Path) -> tuple[EagleHeadConfig, dict]:
    raw = _read_json(path / CONFIG_FILE)
    if raw.get("kind") != "eagle_head":
        raise ValueError(f"{str(path / CONFIG_FILE)!r} is not an EAGLE head config (kind={raw.get('kind')!r})")
    if raw.get("format") != FORMAT_VERSION:
        raise ValueError(f"{str(path / CONFIG_FILE)!r} has format {raw.get('format')!r}; this specserve reads {FORMAT_VERSION}")
    try:
        cfg = EagleHeadConfig(mode=raw["mode"], layer=dict(raw["layer"]), vocab_size=int(raw["vocab_size"]),
                              draft_vocab_size=int(raw["draft_vocab_size"]),
                              feature_layers=tuple(int(x) for x in raw["feature_layers"]),
                              fc_bias=bool(raw.get("fc_bias", True)), input_norm=bool(raw.get("input_norm", False)),
                              target=dict(raw.get("target", {})))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{str(path / CONFIG_FILE)!r} is missing or mistypes a field: {exc}") from exc
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{str(weights)!r} not found: the head's weights are missing")
    return cfg, _read_safetensors(weights)


# ---- public layouts ---------------------------------------------------------------------------------

_PUBLIC_LAYER = {  # our name: (public names concatenated in order)
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "post_norm": ("post_attention_layernorm.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}


def _read_public_weights(path: Path) -> dict[str, torch.Tensor]:
    for name in ("model.safetensors", "pytorch_model.safetensors"):
        if (path / name).is_file():
            return _read_safetensors(path / name)
    if (path / "pytorch_model.bin").is_file():
        try:
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a truncated pickle
            raise ValueError(f"{str(path / 'pytorch_model.bin')!r} is not a readable torch checkpoint: {exc}") from exc
        if not isinstance(state, dict):
            raise ValueError(f"{str(path / 'pytorch_model.bin')!r} does not hold a state dict")
        return state
    raise FileNotFoundError(f"{str(path)!r} has a config.json but no EAGLE weights "
                            "(model.safetensors or pytorch_model.bin)")


def _read_public(path: Path, target) -> tuple[EagleHeadConfig, dict]:
    raw = _read_json(path / "config.json")
    state = _read_public_weights(path)
    eagle3 = any(k.startswith("midlayer.") for k in state)
    if not eagle3 and not any(k.startswith("layers.0.") for k in state):
        raise ValueError(f"{str(path)!r}: config.json + weights without 'midlayer.*' (EAGLE-3) or 'layers.0.*' "
                         "(EAGLE-1/2) tensors: not an EAGLE head")
    try:
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{str(path / 'config.json')!r} lacks hidden_size/vocab_size: {exc}") from exc
    if int(raw.get("num_hidden_layers", 1)) != 1 or any(k.startswith("layers.1.") for k in state):
        raise ValueError(f"{str(path)!r}: only one-layer EAGLE heads are supported (num_hidden_layers="
                         f"{raw.get('num_hidden_layers')})")
    if raw.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"{str(path)!r}: heads whose width differs from the target's (target_hidden_size="
                         f"{raw['target_hidden_size']}, hidden_size={hidden}) are not supported")
    ours: dict[str, torch.Tensor] = {}
    prefix = "midlayer." if eagle3 else "layers.0."
    used = {"embed_tokens.weight"}  # the target's own embeddings: ignored

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"EAGLE head in {str(path)!r} is missing tensor {name!r}")
        used.add(name)
        return state[name]

    for our, names in _PUBLIC_LAYER.items():
        ours[our] = torch.cat([take(prefix + n) for n in names])
    ours["fc"] = take("fc.weight")
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    if eagle3:
        ours["input_norm"] = take(prefix + "input_layernorm.weight")
        ours["hidden_norm"] = take(prefix + "hidden_norm.weight")
        ours["norm"] = take("norm.weight")
        ours["lm_head"] = take("lm_head.weight")
        draft_vocab = int(raw.get("draft_vocab_size") or ours["lm_head"].shape[0])
        if "d2t" in state:
            d2t = take("d2t").long()
            if d2t.shape != (draft_vocab,):
                raise ValueError(f"EAGLE-3 head in {str(path)!r}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
            ours["draft_to_target"] = torch.arange(draft_vocab) + d2t
            if "t2d" in state:
                t2d = take("t2d").bool()
                if t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab or not bool(t2d[ours["draft_to_target"].clamp(0, vocab - 1)].all()):
                    raise ValueError(f"EAGLE-3 head in {str(path)!r}: t2d does not agree with d2t")
        elif draft_vocab == vocab:
            ours["draft_to_target"] = torch.arange(vocab)
        else:
            raise ValueError(f"EAGLE-3 head in {str(path)!r} has a reduced draft vocabulary but no d2t map")
        num_layers = target.num_layers
        feature_layers = tuple(int(x) for x in layers) if layers else default_feature_layers("eagle3", num_layers)
        fc_bias, input_norm = False, True
        if "fc.bias" in state:
            raise ValueError(f"EAGLE-3 head in {str(path)!r} has fc.bias: EAGLE-3's fc has none")
    else:
        draft_vocab = vocab
        fc_bias = "fc.bias" in state
        if fc_bias:
            ours["fc_bias"] = take("fc.bias")
        input_norm = prefix + "input_layernorm.weight" in state
        if input_norm:
            ours["input_norm"] = take(prefix + "input_layernorm.weight")
        ours["draft_to_target"] = torch.arange(vocab)
        feature_layers = (target.num_layers,)
    unexpected = sorted(k for k in state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"EAGLE head in {str(path)!r} has tensors this layout does not have: {unexpected[:5]}")
    layer = {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
                                 "rope_parameters") if raw.get(k) is not None}
    cfg = EagleHeadConfig(mode="eagle3" if eagle3 else "eagle1", layer=layer, vocab_size=vocab,
                          draft_vocab_size=draft_vocab, feature_layers=feature_layers, fc_bias=fc_bias,
                          input_norm=input_norm, target={"hidden_size": hidden, "vocab_size": vocab})
    return cfg, ours


def _check_target(cfg: EagleHeadConfig, target, path: Path) -> None:
    """A head for another target is a ValueError naming what differs."""
    want = cfg.target
    have = {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "num_layers": target.num_layers}
    model = getattr(target, "model", None)
    if model is not None:
        have["model_type"] = model.config.model_type
    have.update(target_fingerprint(target.model_dir))
    have_hidden = cfg.model_config.hidden_size
    problems = []
    if have_hidden != target.hidden_size:
        problems.append(f"hidden size {have_hidden} vs the target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} vs the target's {target.vocab_size}")
    for key in ("num_layers", "model_type", "config_sha256", "tokenizer"):
        if want.get(key) is not None and have.get(key) is not None and want[key] != have[key]:
            problems.append(f"{key} {want[key]!r} vs the target's {have[key]!r}")
    bad_layers = [layer for layer in cfg.feature_layers if not 0 <= layer <= target.num_layers]
    if bad_layers:
        problems.append(f"feature layers {bad_layers} outside the target's 0..{target.num_layers}")
    if problems:
        raise ValueError(f"EAGLE head {str(path)!r} was made for another target: " + "; ".join(problems))
