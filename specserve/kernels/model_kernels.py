"""The CPU executor of a `LlamaModel` (and of single decoder layers, for drafter heads).

`ModelKernels.for_model(model)` packs the model's weights once (`PackedLinear`: fp32, or half-size
bfloat16/float16 storage when the model's dtype asks for it, or int8 Q8_0 / int4 Q4_0 when quantized — arithmetic
stays fp32) and then runs
whole forwards over a `StepBatch`: embedding lookup, one `decoder_layer` call per layer, final norm and
LM head, hidden states of the asked layers for drafters. torch keeps the original weights (training
and the GPU path use them); the KV cache is fp32, or float16 (`LLM(kv_cache_dtype="float16")`) widened as read.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.kernels.arena import pack_into_arena
from specserve.kernels.attention import visible_keys
from specserve.kernels.layer import decoder_layer, rms_norm
from specserve.kernels.linear import PackedLinear, linear_rows
from specserve.kernels.precompile import compile_elsewhere
from specserve.kernels.simd import LANES
from specserve.kernels.threads import apply_threads, get_threads
from specserve.kv_cache import PagedKVCache
from specserve.rope import RotaryTable

if TYPE_CHECKING:  # (step_batch imports this package's batch_arrays)
    from specserve.step_batch import StepBatch

log = logging.getLogger("specserve")

_STORAGE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NO_INPUT = np.zeros((0, 0), dtype=np.float32)
_logged: set[str] = set()


def move_to_arena(products: list[PackedLinear]):
    """Put the packed weights of `products`, and their quantization scales (streamed beside the weights:
    ~15 % of a 4-bit product's bytes), into one huge-page-backed arena (see `arena`), each product's scales
    right after its weights; returns the mapping, which must live as long as they do."""
    moved, mapping = pack_into_arena([a for p in products for a in (p.weight, p.scales)])
    for i, product in enumerate(products):
        product.weight, product.scales = moved[2 * i], moved[2 * i + 1]
    return mapping


def drafter_storage(target_kernels) -> str | None:
    """A drafter's storage beside a target whose kernels run quantized products (a GGUF file's blocks or a
    quantization asked for): 4-bit ("q4_1") beside a target whose decoder layers are 4-bit (Q4_0, Q4_1), else
    "int8"; None beside float products (a drafter keeps its own storage). A draft level streams the drafter's
    weights for a row or two, so their bytes are its time (SmolLM2's EAGLE head: 30 MB as float32, 7.5 MB as
    int8): the default model's Medusa heads drafted in 1.2 ms a step as Q4_1 against 1.7 as Q8_0, for the same
    accepted tokens (BENCHMARKS.md, fifteenth session). Q4_1 rather than Q4_0: its per-run minimum keeps a
    drafter's small weights closer (the target's own layers set how coarse the drafts may be)."""
    if target_kernels is None or not getattr(target_kernels, "quantized", False):
        return None
    layer_storages = {p.storage for layer in target_kernels.layers for p in layer.products()}
    return "q4_1" if layer_storages & {"int4", "q4_1"} else "int8"


def kernels_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the CPU kernels cannot run a model, or None when they can."""
    if device.type != "cpu":
        return f"device {device} is not the CPU"
    if dtype not in _STORAGE:
        return f"dtype {dtype} is not float32, bfloat16 or float16"
    if head_dim % LANES:
        return f"head_dim {head_dim} is not a multiple of {LANES}"
    return None


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def _np(t: torch.Tensor | None) -> np.ndarray:
    return np.zeros(0, dtype=np.float32) if t is None else t.detach().to("cpu", torch.float32).contiguous().numpy()


def packed(weight: torch.Tensor, bias: torch.Tensor | None, storage: str, blocks=None) -> PackedLinear:
    """A product packed as `storage`, or from a GGUF file's quantized blocks as they are stored."""
    if blocks is not None:
        return PackedLinear.from_blocks(blocks.fmt, blocks.q, blocks.d, blocks.m, bias)
    return PackedLinear(weight, bias, storage)


class LayerKernels:
    """One `DecoderLayer`'s weights packed for `decoder_layer`, and the call itself."""

    def __init__(self, layer, storage: str, blocks: dict | None = None) -> None:
        """blocks: product name ("qkv", "o_proj", "gate_up", "down") -> `QuantBlocks` run as stored instead of
        packing the layer's float weight as `storage`."""
        self.input_norm = _np(layer.input_norm)
        self.post_norm = _np(layer.post_attn_norm)
        self.q_norm, self.k_norm = _np(layer.q_norm), _np(layer.k_norm)  # float32[head_dim], or [0]: none
        self.eps = np.float32(layer.eps)
        blocks = blocks or {}
        self.qkv = packed(layer.qkv, layer.qkv_bias, storage, blocks.get("qkv"))
        self.o_proj = packed(layer.o_proj, layer.o_bias, storage, blocks.get("o_proj"))
        self.gate_up = packed(layer.gate_up, layer.gate_up_bias, storage, blocks.get("gate_up"))
        self.down = packed(layer.down, layer.down_bias, storage, blocks.get("down"))
        self.inter = self.down.in_features
        self.num_heads, self.num_kv, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim

    def products(self) -> tuple[PackedLinear, ...]:
        return self.qkv, self.o_proj, self.gate_up, self.down

    @property
    def nbytes(self) -> int:
        return (sum(p.nbytes for p in self.products()) + 2 * self.post_norm.nbytes
                + self.q_norm.nbytes + self.k_norm.nbytes)

    def __call__(self, x: np.ndarray, batch: StepBatch, k_cache: np.ndarray, v_cache: np.ndarray,
                 cos: np.ndarray, sin: np.ndarray, visible: tuple[np.ndarray, np.ndarray],
                 attn_input: np.ndarray | None = None) -> None:
        """Run the layer on x float32[T, hidden] in place. visible: the batch's `attention.visible_keys` (found once
        per forward, the same for every layer); attn_input: see `decoder_layer`."""
        decoder_layer(
            x, _NO_INPUT if attn_input is None else attn_input, self.input_norm, self.post_norm,
            self.q_norm, self.k_norm, self.eps,
            self.qkv.weight, self.qkv.scales, self.qkv.bias, self.o_proj.weight, self.o_proj.scales, self.o_proj.bias,
            self.gate_up.weight, self.gate_up.scales, self.gate_up.bias, self.down.weight, self.down.scales,
            self.down.bias, self.inter,
            self.num_heads, self.num_kv, self.head_dim, cos, sin, k_cache, v_cache, batch.positions,
            batch.slot_mapping, *visible, get_threads(),
        )


class ModelKernels:
    """A `LlamaModel`'s forward on the CPU kernels (see the module docstring)."""

    @classmethod
    def for_model(cls, model, quantization: str | None = None) -> "ModelKernels | None":
        cfg = model.config
        reason = kernels_unsupported(model.device, model.dtype, cfg.head_dim)
        if reason is not None:
            _log_once(f"CPU kernels off for this model: {reason}; using the torch path")
            return None
        return cls(model, quantization)

    def __init__(self, model, quantization: str | None = None) -> None:
        cfg = model.config
        self.config = cfg
        self.quantization = quantization
        # The products' storage: the model's dtype, or int8 (Q8_0) / int4 (Q4_0) when quantized.
        self.storage = quantization or _STORAGE[model.dtype]
        self.embed = _np(model.embed)  # float32[V, H]: only gathered, so it stays full size
        self.norm = _np(model.norm)
        # A GGUF file's Q8_0 / Q4_0 / Q4_1 products run as stored, unless a quantization was asked for.
        blocks = getattr(model, "quant_blocks", {}) if quantization is None else {}
        self.lm_head = packed(model.lm_head, None, self.storage, blocks.get("lm_head"))
        self.layers = [LayerKernels(layer, self.storage, {name: blocks[f"layers.{i}.{name}"] for name in
                                                          ("qkv", "o_proj", "gate_up", "down") if f"layers.{i}.{name}" in blocks})
                       for i, layer in enumerate(model.layers)]
        self.rope = RotaryTable(cfg, torch.device("cpu"), torch.float32)  # fp32 tables whatever the weights' dtype
        self.window = int(cfg.sliding_window or 0)
        self.eps = np.float32(cfg.rms_norm_eps)
        self._arena = move_to_arena([self.lm_head, *(p for layer in self.layers for p in layer.products())])
        # A first start: the head's product compiles in a second process while the first forward compiles the
        # layers here (`precompile`); the head waits for it before its first call.
        self._head_compile = compile_elsewhere(linear_rows, self._head_arguments(np.zeros((1, cfg.hidden_size),
                                                                                          dtype=np.float32)))

    @property
    def quantized(self) -> bool:
        """Whether any product holds 8- or 4-bit weights (the quantized products' kernels run)."""
        return any(p.scales.size for p in self.products())

    @property
    def has_float_products(self) -> bool:
        """Whether any product holds float weights (the float products' kernel runs)."""
        return any(not p.scales.size for p in self.products())

    def products(self) -> tuple[PackedLinear, ...]:
        """Every product a forward runs: the LM head, then each layer's."""
        return (self.lm_head, *(q for layer in self.layers for q in layer.products()))

    def bytes_read_per_token(self) -> int:
        """Weight bytes one decode step streams (the floor's numerator; the embedding is only indexed)."""
        return self.lm_head.nbytes + self.norm.nbytes + sum(layer.nbytes for layer in self.layers)

    def forward(self, batch: StepBatch, cache: PagedKVCache, hidden_layers: tuple[int, ...] = ()):
        from specserve.forward_output import ForwardOutput

        apply_threads()
        x = self.embed[batch.input_ids]  # float32[T, H], a fresh copy: the residual stream
        hidden: dict[int, torch.Tensor] = {}
        kv = cache.layer_arrays()
        cos, sin = self.rope.arrays_for_batch(batch.num_positions)  # the kernels never bounds-check
        visible = visible_keys(batch, self.window)
        for i, layer in enumerate(self.layers):
            if i in hidden_layers:
                hidden[i] = torch.from_numpy(x[batch.hidden_rows])
            layer(x, batch, kv[i][0], kv[i][1], cos, sin, visible)
        num_layers = self.config.num_layers
        if num_layers in hidden_layers:
            hidden[num_layers] = torch.from_numpy(self.final_norm(x[batch.hidden_rows]))
        logits = self.head(self.final_norm(x[batch.logit_rows]))
        return ForwardOutput(logits=torch.from_numpy(logits), hidden_states=hidden)

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        """float32[R, H] -> rms_norm(x) with the model's final norm (what the LM head reads)."""
        out = np.empty_like(x)
        rms_norm(np.ascontiguousarray(x), self.norm, self.eps, out)
        return out

    def head(self, normed: np.ndarray) -> np.ndarray:
        """float32[R, H] final-normed states -> logits float32[R, head rows] (the vocabulary, or a draft
        model's draft vocabulary: `LlamaModel.restrict_lm_head`)."""
        if self._head_compile is not None:
            self._head_compile.wait()
            self._head_compile = None
        arguments = self._head_arguments(np.ascontiguousarray(normed))
        if normed.shape[0]:
            linear_rows(*arguments)
        return arguments[4]

    def _head_arguments(self, normed: np.ndarray) -> tuple:
        """`linear_rows`'s arguments for the LM head on float32[R, H] C-contiguous rows (the output allocated)."""
        out = np.empty((normed.shape[0], self.lm_head.out_features), dtype=np.float32)
        return normed, self.lm_head.weight, self.lm_head.scales, self.lm_head.bias, out, False
