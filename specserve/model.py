"""Our Llama-family decoder: one forward for prefill, decode and tree verification over a paged cache.

Weights are loaded from a Hugging Face directory and stored fused (q|k|v in one matrix, gate|up in
another) so a layer is four products. A forward reads one `StepBatch` (flat tokens, positions, slots,
block tables, tree masks). Two executors run the same layer:

- on the CPU, `specserve.kernels` (compiled numba kernels: a whole decoder layer per call, every core,
  every output row reduced in one fixed order — batch-invariant by construction);
- elsewhere (GPU, or a model the kernels do not cover), the torch layer below with an attention
  backend from `specserve.attention`.

Hidden states follow transformers' `hidden_states` numbering:
index 0 is the embedding output, index i the output of layer i-1, and index `num_layers` the final
normed state (what the LM head reads) — so drafter heads trained against transformers line up.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import default_attention, make_backend
from specserve.config import ModelConfig
from specserve.forward_output import ForwardOutput
from specserve.kv_cache import BlockAllocator, PagedKVCache
from specserve.rope import RotaryTable
from specserve.step_batch import StepBatch


class DecoderLayer(nn.Module):
    """One Llama decoder layer: attention over the paged cache (tree masks included), then the SiLU MLP.

    Weights are stored fused ([q | k | v, in] and [gate | up, hidden]) so a layer is four products.
    attn_in: width of the attention input (hidden_size for a target layer; an EAGLE-3 head feeds the
    concatenation of two normed vectors, 2 * hidden). input_norm: whether the layer normalises its
    own attention input (False when the caller hands over an already normed input). With
    `cfg.qk_norm` (Qwen3) each q and k head is RMS-normed over head_dim (weights [head_dim], shared
    by all heads) before rotary.
    """

    def __init__(self, cfg: ModelConfig, attn_in: int | None = None, input_norm: bool = True) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.eps = cfg.rms_norm_eps
        inter = cfg.intermediate_size
        self.input_norm = _param(h) if input_norm else None
        self.post_attn_norm = _param(h)
        self.qkv = _param(self.q_size + 2 * self.kv_size, attn_in or h)  # [q | k | v, in]
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        self.q_norm = _param(hd) if cfg.qk_norm else None
        self.k_norm = _param(hd) if cfg.qk_norm else None
        self.o_proj = _param(h, self.q_size)
        self.o_bias = _param(h) if cfg.o_proj_bias else None
        self.gate_up = _param(2 * inter, h)  # [gate | up, hidden]
        self.gate_up_bias = _param(2 * inter) if cfg.mlp_bias else None
        self.down = _param(h, inter)
        self.down_bias = _param(h) if cfg.mlp_bias else None
        self.tp = None  # a `TensorParallel` when this layer holds one rank's share (`LlamaModel(tp=...)`)

    def forward(self, layer_idx: int, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, backend, meta,
                cache: PagedKVCache, attn_input: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] (the residual stream) -> [T, hidden]. attn_input [T, attn_in]: what attention
        reads (default: rms_norm(x) with the layer's input norm)."""
        if attn_input is None:
            attn_input = F.rms_norm(x, (x.shape[-1],), self.input_norm, self.eps)
        q, k, v = self.project_qkv(attn_input, positions, rope)
        attn = backend.attend(layer_idx, q, k, v, meta, cache)  # [T, heads * head_dim]
        return self.finish(x, attn)

    def project_qkv(self, attn_input: torch.Tensor, positions: torch.Tensor, rope: RotaryTable):
        """attn_input [..., T, in] -> q [..., T, heads, head_dim], k and v [..., T, kv_heads, head_dim],
        rotary applied at positions [T]."""
        q, k, v = F.linear(attn_input, self.qkv, self.qkv_bias).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:  # Qwen3: per-head norm, then rotary (transformers' order)
            q = F.rms_norm(q, (self.head_dim,), self.q_norm, self.eps)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm, self.eps)
        q, k = rope.apply(q, k, positions)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: x + o_proj(attn), then + MLP(norm(.)). attn [..., heads * head_dim]."""
        x = x + self._row_parallel(attn, self.o_proj, self.o_bias)
        normed = F.rms_norm(x, (x.shape[-1],), self.post_attn_norm, self.eps)
        gate, up = F.linear(normed, self.gate_up, self.gate_up_bias).chunk(2, dim=-1)
        return x + self._row_parallel(F.silu(gate) * up, self.down, self.down_bias)

    def _row_parallel(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """inputs @ weight.T + bias. Under tensor parallelism `weight` holds this rank's input columns: the
        partial products are summed over ranks (one all-reduce), then the bias is added once."""
        if self.tp is None:
            return F.linear(inputs, weight, bias)
        out = self.tp.all_reduce(F.linear(inputs, weight))
        return out if bias is None else out + bias


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LlamaModel(nn.Module):
    """The target (or a draft model). tp: this rank's `TensorParallel` handle — the model then holds one
    rank's share of every layer (`specserve.tensor_parallel`); `config` gives that share's head and MLP
    counts, so the KV cache it makes is the rank's share too."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, attention: str | None = None,
                 tp=None) -> None:
        super().__init__()
        self.tp = tp
        if tp is not None:
            from specserve.sharding import check_shardable, shard_config

            check_shardable(cfg, tp.shard.world)
            cfg = shard_config(cfg, tp.shard.world)
            tp.vocab_size = cfg.vocab_size
        self.config = cfg
        self.device, self.dtype = device, dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)  # rows looked up per token
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        for layer in self.layers:
            layer.tp = tp
        self.norm = _param(cfg.hidden_size)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryTable(cfg, device, dtype)
        # attention None: the device's default backend (triton on CUDA, sdpa elsewhere).
        self.backend = make_backend(attention or default_attention(device), device, cfg.sliding_window)
        self.kernels = None  # CPU compiled kernels (`use_cpu_kernels`), when they run this model
        # What `new_cache` stores K and V as; None: `cache_dtype`'s default (`LLM`'s kv_cache_dtype sets it).
        self.kv_cache_dtype: torch.dtype | None = None
        self.graphs = None  # CUDA graphs of this model's forward (`use_cuda_graphs`)
        self._vocab_rows: tuple[int, int] | None = None  # TP, a rank holding the whole LM head: its own rows
        self.quant_blocks: dict = {}  # fused product name -> QuantBlocks a GGUF file stores (see load_hf_state)
        self.checkpoint_bytes_read = 0

    @property
    def lm_head_local(self) -> torch.Tensor:
        """The LM head rows this rank computes logits for: all of them on one device, its vocabulary share under TP."""
        if self._vocab_rows is None:
            return self.lm_head
        lo, hi = self._vocab_rows
        return self.lm_head[lo:hi]

    @classmethod
    def from_pretrained(cls, model_path: str | Path, device: torch.device, dtype: torch.dtype, attention: str | None = None,
                        cpu_kernels: bool = True, tp=None, quantization: str | None = None,
                        checkpoint=None) -> "LlamaModel":
        """Load a Hugging Face directory or a GGUF file (`specserve.loading`; `checkpoint`: one already opened).
        tp: load one rank's share (only its slices of the checkpoint are read); no CPU kernels then.
        quantization: "int8" / "int4" packs the CPU kernels' products as Q8_0 / Q4_0 (`use_cpu_kernels`); None
        keeps a GGUF file's Q8_0 / Q4_0 / Q4_1 products as stored."""
        from specserve.kernels import kernels_unsupported
        from specserve.loading import open_checkpoint

        checkpoint = checkpoint if checkpoint is not None else open_checkpoint(model_path)
        model = cls(checkpoint.config, device, dtype, attention, tp)
        cpu_kernels = cpu_kernels and tp is None
        # The kernels run a GGUF file's blocks as stored: no float copies of those products are needed then.
        blocks_only = cpu_kernels and quantization is None and kernels_unsupported(device, dtype, model.config.head_dim) is None
        stats: dict = {}
        state, blocks = checkpoint.load(dtype, device, tp.shard if tp else None, stats, blocks_only=blocks_only)
        model.load_hf_state(state, blocks)
        model.checkpoint_bytes_read = stats["bytes_read"]
        if cpu_kernels:
            model.use_cpu_kernels(quantization)
        if quantization is not None and model.kernels is None:
            raise ValueError(f"quantization={quantization!r} needs the CPU kernels, which cannot run this model "
                             "(see the log line above)")
        return model

    @torch.no_grad()
    def restrict_lm_head(self, rows: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Keep only these vocabulary rows of the LM head (a draft model's draft vocabulary, as EAGLE-3 heads
        have): logits come out float32[R, len(rows)], column j for token rows[j]; the embedding keeps every
        row, so any token can still be fed. A tied head is untied (the embedding is not changed). The CPU
        kernels, when on, are repacked; call before `use_cuda_graphs`.

        rows: int64[Vd], distinct token ids in [0, vocab_size); weight: those rows' own weights [Vd, hidden] (a
        head trained over the draft vocabulary), default the current head's rows."""
        if self.tp is not None:
            raise ValueError("restrict_lm_head: not under tensor parallelism")
        rows = rows.to(torch.int64).cpu()
        vocab = self.config.vocab_size
        if rows.ndim != 1 or not len(rows) or int(rows.min()) < 0 or int(rows.max()) >= vocab or \
                rows.unique().numel() != rows.numel():
            raise ValueError(f"restrict_lm_head needs distinct token ids in [0, {vocab}), got {len(rows)} ids")
        if weight is None:
            kept = self.lm_head.data[rows.to(self.lm_head.device)].clone()
            if "lm_head" in self.quant_blocks:
                self.quant_blocks["lm_head"] = self.quant_blocks["lm_head"].take_rows(rows)
        else:
            if tuple(weight.shape) != (len(rows), self.config.hidden_size):
                raise ValueError(f"restrict_lm_head: weight must be [{len(rows)}, {self.config.hidden_size}], "
                                 f"got {list(weight.shape)}")
            kept = weight.to(self.lm_head.device, self.lm_head.dtype).clone()
            self.quant_blocks.pop("lm_head", None)
        self.lm_head = nn.Parameter(kept, requires_grad=False)
        if self.kernels is not None:
            self.use_cpu_kernels(self.kernels.quantization)

    def use_cpu_kernels(self, quantization: str | None = None) -> bool:
        """Run forwards through `specserve.kernels` (compiled, multithreaded, batch-invariant) when the
        model and device allow it; returns whether they do (the reason is logged once otherwise).
        quantization: "int8" / "int4" / "q4_1" packs every product (layers and LM head) as Q8_0 / Q4_0 / Q4_1
        (`PackedLinear`; Q4_1 is what a draft model beside 4-bit target layers gets, `kernels.drafter_storage`)."""
        from specserve.kernels import ModelKernels

        self.kernels = ModelKernels.for_model(self, quantization)
        return self.kernels is not None

    def use_cuda_graphs(self, cache: PagedKVCache, max_num_seqs: int, max_query_len: int, max_positions: int,
                        hidden_layers: tuple[int, ...] = (), capture: bool = True) -> None:
        """Capture this model's forward over `cache` in CUDA graphs for every (batch, rows) bucket up to
        max_num_seqs sequences x max_query_len rows (`specserve.cuda_graphs`); other batches stay eager.
        capture=False (or off CUDA) replays eagerly from the same static buffers: for tests."""
        from specserve.cuda_graphs import GraphedForward, make_buckets

        graphs = GraphedForward(self, cache, make_buckets(max_num_seqs, max_query_len), hidden_layers,
                                max_positions, capture=capture)
        graphs.capture_all()
        self.graphs = graphs

    @torch.no_grad()
    def load_hf_state(self, state: dict[str, torch.Tensor], blocks: dict | None = None) -> None:
        """Take HF-named tensors (already checked by the loader) and fuse them into our layout.

        blocks: HF name -> `loading.gguf_blocks.QuantBlocks` for weights a GGUF file stores as Q8_0 / Q4_0 / Q4_1;
        they are fused the same way into `quant_blocks` (keys "layers.I.qkv", ..., "lm_head"), which the CPU
        kernels run as stored. A fused product whose parts differ in format gets none (its float weights run)."""
        from specserve.loading.gguf_blocks import QuantBlocks

        blocks = blocks or {}
        self.quant_blocks = {}

        def fuse(key: str, names: list[str]) -> None:
            if all(n in blocks for n in names):
                fused = QuantBlocks.concat([blocks[n] for n in names])
                if fused is not None:
                    self.quant_blocks[key] = fused

        self.embed.data = state["model.embed_tokens.weight"]
        self.norm.data = state["model.norm.weight"]
        if not self.config.tie_word_embeddings:
            self.lm_head.data = state["lm_head.weight"]
        if self.tp is not None and self.lm_head.shape[0] == self.config.vocab_size:
            # Rank 0 (and every rank of a tied head) holds the whole table: its rows are a view; other ranks
            # read only theirs.
            self._vocab_rows = self.tp.shard.vocab_part(self.config.vocab_size)
        fuse("lm_head", ["model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.data = state[p + "input_layernorm.weight"]
            layer.post_attn_norm.data = state[p + "post_attention_layernorm.weight"]
            layer.qkv.data = torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            if layer.qkv_bias is not None:
                layer.qkv_bias.data = torch.cat([state[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            if layer.q_norm is not None:
                layer.q_norm.data = state[p + "self_attn.q_norm.weight"]
                layer.k_norm.data = state[p + "self_attn.k_norm.weight"]
            layer.o_proj.data = state[p + "self_attn.o_proj.weight"]
            if layer.o_bias is not None:
                layer.o_bias.data = state[p + "self_attn.o_proj.bias"]
            layer.gate_up.data = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
            if layer.gate_up_bias is not None:
                layer.gate_up_bias.data = torch.cat([state[p + "mlp.gate_proj.bias"], state[p + "mlp.up_proj.bias"]])
            layer.down.data = state[p + "mlp.down_proj.weight"]
            fuse(f"layers.{i}.qkv", [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
            fuse(f"layers.{i}.o_proj", [p + "self_attn.o_proj.weight"])
            fuse(f"layers.{i}.gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            fuse(f"layers.{i}.down", [p + "mlp.down_proj.weight"])
            if layer.down_bias is not None:
                layer.down_bias.data = state[p + "mlp.down_proj.bias"]

    def bytes_read_per_token(self) -> int:
        """Weight bytes one decode step streams: every layer, the final norm and the LM head (the
        embedding table is only indexed). The numerator of the bandwidth floor."""
        if self.kernels is not None:
            return self.kernels.bytes_read_per_token()
        tensors = [self.norm, self.lm_head, *(p for layer in self.layers for p in layer.parameters())]
        return sum(p.numel() * p.element_size() for p in tensors)

    def cache_dtype(self) -> torch.dtype:
        """What this model's KV cache stores: `kv_cache_dtype`, by default float32 on the CPU kernels' path (whose
        arithmetic is float32 whatever the weights) and the model's dtype elsewhere."""
        if self.kv_cache_dtype is not None:
            return self.kv_cache_dtype
        return torch.float32 if self.kernels is not None else self.dtype

    def new_cache(self, allocator: BlockAllocator) -> PagedKVCache:
        """A KV cache for this model on `allocator`'s blocks (`cache_dtype`)."""
        cfg = self.config
        dtype = self.cache_dtype()
        if self.tp is not None and self.tp.is_leader:  # every rank keeps its share of the heads
            return self.tp.new_cache(allocator, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.device, dtype)
        return PagedKVCache(allocator, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.device, dtype)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: PagedKVCache, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Run a StepBatch's new tokens through the model, writing their K/V into `cache`.

        Returns logits float32[R, vocab] for `batch.logit_rows` and {layer: [R_h, hidden]} for
        `batch.hidden_rows` (transformers' hidden_states numbering, see the module docstring).
        """
        if self.kernels is not None:
            return self.kernels.forward(batch, cache, hidden_layers)
        if self.tp is not None and self.tp.is_leader:
            self.tp.send_forward(batch, hidden_layers)  # the other ranks run the same forward on their shares
        if self.graphs is not None:
            out = self.graphs.run(batch, cache, hidden_layers)
            if out is not None:
                return out
        return self.eager_forward(batch, cache, hidden_layers)

    @torch.inference_mode()
    def eager_forward(self, batch: StepBatch, cache: PagedKVCache, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """`forward` on the torch layers, launch by launch (what a CUDA graph records)."""
        d = batch.device_arrays(self.device)
        meta = self.backend.prepare(batch, cache)
        self.rope.cover(batch.num_positions)
        x = self.embed[d.input_ids]  # [T, hidden]
        hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in hidden_layers:
                hidden[i] = x[d.hidden_rows]
            x = layer(i, x, d.positions, self.rope, self.backend, meta, cache)
        eps = self.config.rms_norm_eps
        if self.config.num_layers in hidden_layers:
            hidden[self.config.num_layers] = F.rms_norm(x[d.hidden_rows], (x.shape[-1],), self.norm, eps)
        x = F.rms_norm(x[d.logit_rows], (x.shape[-1],), self.norm, eps)
        logits = F.linear(x, self.lm_head_local).float()  # [R, vocab] (this rank's vocabulary rows under TP)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits)  # rank 0: [R, vocab]; other ranks: None
        return ForwardOutput(logits=logits, hidden_states=hidden)
