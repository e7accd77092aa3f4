"""`LLM`: the Python API — load a target and a drafter, generate in batches or stream."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from specserve import progress
from specserve.config import context_limit, default_context
from specserve.defaults import GRAMMAR_DRAFTING, KV_CACHE_DTYPES, QUANTIZATIONS
from specserve.device import checkpoint_dtype, resolve_device, resolve_dtype
from specserve.kernels import kernels_unsupported
from specserve.drafters import TargetInfo, create_drafter
from specserve.engine import Engine, EngineConfig
from specserve.grammar.hooks import ConstraintRules
from specserve.model import LlamaModel
from specserve.penalties import PenaltyRules
from specserve.request import RequestOutput
from specserve.sampling import SamplingParams
from specserve.speculation import SPECULATION_MODES, make_budget_policy
from specserve.step_hooks import StepHooks

Prompt = str | Sequence[int]
_GRAPH_POSITION_MARGIN = 64  # rotary positions past max_model_len a tree can reach (graphs cover them)


def _graph_query_len(drafter) -> int:
    """Rows per sequence the CUDA-graph buckets cover: the root plus the drafter's largest tree, at most 64
    (bigger trees run eagerly)."""
    return min(64, 1 + (drafter.max_budget if drafter is not None else 0))


class LLM:
    """A target model (a Llama-family GGUF file or Hugging Face directory) with an optional drafter.

    model: a .gguf file, a model directory, "tiny" (the 9M code model), or None: ``$SPECSERVE_MODEL`` when set,
    else the default model, SmolLM2-135M-Instruct's Q4_1 file (fetched into the user's cache the first time;
    `specserve info` shows where).
    drafter: a spec such as ``"ngram"`` or ``"draft:PATH"``; None (or ``"none"``) decodes plainly through
    the same loop; ``"auto"`` (the default) is the drafter measured for the model (the tiny model's bundle
    records one; the default model gets the drafter its MANIFEST records, the per-request suffix drafter, under
    adaptive speculation), else plain decoding.
    kv_cache_tokens: total tokens the paged cache holds (default: max_num_seqs full contexts, capped
    at 2 GiB of cache on CPU).
    dtype: on the CPU, how weights are stored — float32, or bfloat16/float16 to halve the bytes read per
    token; the CPU kernels always compute in float32. Default: the checkpoint's own storage when it is
    float16/bfloat16 (exactly its values, half the bytes), else float32. On CUDA, the compute dtype (bf16).
    threads: CPU threads for the kernels (torch's pool keeps one thread beside them; it gets `threads`
    only when a model runs on the torch path); None = every core.
    max_prefill_tokens: prompt tokens prefilled per step; longer prompts are prefilled in chunks between
    the running requests' decode steps, so one long prompt never stalls everyone's next token.
    attention: the attention backend of the torch layers (None: ``triton`` on CUDA; on the CPU the
    compiled kernels, which bring their own attention — naming a backend there runs the torch layers).
    cuda_graphs: replay decode and verify forwards from CUDA graphs (None: on CUDA with ``triton``).
    gpu_memory_utilization: the share of the GPU the weights, the graphs' pool and the KV cache may use.
    grammar_drafting: how requests with a constraint (`SamplingParams.json_schema` / `regex` / `grammar`
    / `choice`) draft: "forced" (the default: drafters mask their proposals with the grammar and tokens
    it leaves no choice about are drafted for free), "aware" (no forced tokens) or "verify" (the grammar
    masks verification only). Output is the same either way; only speed differs.
    enable_prefix_caching: reuse the KV of full blocks earlier requests computed (a shared system prompt,
    a chat's earlier turns): a prompt's prefill starts at its first uncached token; output is unchanged.
    quantization: "int8" stores the target's products (every layer's and the LM head) as llama.cpp's Q8_0
    does — int8 weights with a float16 scale per output row and run of 32 inputs, about half float16's bytes
    per token — and "int4" as its Q4_0 does (4-bit weights, the same scales: about a quarter); quantized at
    load from the checkpoint (float32, float16 or bfloat16), multiplied as llama.cpp's q8_0 / q4_0 x q8_0
    products do (activations quantized per run of 32, integer dot products); the CPU kernels only. A
    quantized model is a different model: speculation stays lossless against it, not against the float one.
    A draft model drafter is quantized the same way; EAGLE and Medusa heads keep their weights.
    capture_layers: target layers (transformers' hidden_states numbering: 0 the embeddings, num_layers the
    final normed output) whose hidden states a request asking for them (`SamplingParams.return_hidden_states`)
    gets back in `RequestOutput.hidden_states`: the rows its prefill and decode steps computed anyway
    (EAGLE-3's training data is captured this way: `specserve train feature-data`).
    kv_cache_dtype: what the KV cache stores on the CPU kernels' path: "float32" (the default) or "float16",
    which halves the bytes a decode step streams from a long context's K and V (at a few thousand tokens of
    context as many as the weights) and the memory each cached token takes; the kernels widen it to float32
    as they read it. K and V rounded to float16 is a (slightly) different model: speculation stays lossless
    against it. Refused where the CPU kernels do not run the model.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        drafter: str | None = "auto",
        *,
        drafter_options: dict[str, Any] | None = None,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        kv_cache_tokens: int | None = None,
        block_size: int = 16,
        attention: str | None = None,
        threads: int | None = None,
        max_prefill_tokens: int = 128,
        speculation: str = "adaptive",
        grammar_drafting: str = "forced",
        cuda_graphs: bool | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        quantization: str | None = None,
        capture_layers: tuple[int, ...] = (),
        kv_cache_dtype: str | None = None,
    ) -> None:
        # What this LLM was built from: a server's replicas rebuild it in their own processes.
        self.init_args = {name: value for name, value in locals().items() if name != "self"}
        if speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}")
        if grammar_drafting not in GRAMMAR_DRAFTING:
            raise ValueError(f"grammar_drafting must be one of {', '.join(GRAMMAR_DRAFTING)}, got {grammar_drafting!r}")
        from specserve.loading import open_checkpoint, resolve_model

        model_dir = resolve_model(model)
        if threads is not None:
            from specserve.kernels import set_threads

            set_threads(threads)
        progress.begin("loading model")
        self.device = resolve_device(device)
        checkpoint = open_checkpoint(model_dir)
        cfg = checkpoint.config
        # The CPU kernels run the whole layer, attention included; naming a backend asks for the torch
        # layers with that backend instead (on the CPU: sdpa, or triton under Triton's interpreter).
        cpu_kernels = attention is None and tensor_parallel_size == 1
        unsupported = kernels_unsupported(self.device, torch.float32, cfg.head_dim)  # None: the kernels can run it
        no_kernels = _why_no_kernels(self.device, cpu_kernels, unsupported)  # None: the CPU kernels will run it
        _check_quantization(quantization, no_kernels)
        self.dtype = resolve_dtype(dtype, self.device, checkpoint_dtype(cfg.hf_config), cpu_kernels and unsupported is None)
        kv_dtype = _kv_cache_dtype(kv_cache_dtype, no_kernels, self.dtype)
        self._tp = self._launch_tensor_parallel(tensor_parallel_size, cfg, model_dir, threads)
        self.model = LlamaModel.from_pretrained(model_dir, self.device, self.dtype, attention, cpu_kernels=cpu_kernels,
                                                tp=self._tp, quantization=quantization, checkpoint=checkpoint)
        self.model.kv_cache_dtype = kv_dtype
        if threads is not None and self.model.kernels is None and self.device.type == "cpu":
            torch.set_num_threads(threads)  # the torch path does the heavy work itself here
        elif self.model.kernels is not None:
            # The compiled kernels bring their own threads; what torch still does in a step is host
            # bookkeeping on a few rows (gathers, KV moves, feature hand-offs), where its intra-op pool
            # only adds barrier waits — ruinous beside any busy process: an EAGLE step at batch 32 took
            # 79 ms of host time with torch's two threads and 4.5 ms with one (`specserve bench overhead`,
            # BENCHMARKS.md). Process-wide, as torch's setting is.
            torch.set_num_threads(1)
        cfg = self.model.config
        self.model_dir = str(model_dir)
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer()
        progress.end(_describe_model(self.model, checkpoint, max_model_len, quantization))
        if max_model_len is None:
            max_model_len = default_context(cfg)
        limit = context_limit(cfg)
        if max_model_len < 2 or (limit is not None and max_model_len > limit):
            raise ValueError(f"max_model_len must be in [2, {limit if limit is not None else 'memory'}], got {max_model_len}")
        if drafter == "auto":
            from specserve.bundle_paths import default_drafter, default_drafter_options

            drafter = default_drafter(model_dir)
            # The options measured with it (a per-request suffix drafter: shared_tokens=0); the caller's win.
            drafter_options = {**default_drafter_options(model_dir), **(drafter_options or {})} or None
        if drafter == "none":
            drafter = None
        self.drafter_spec = drafter
        drafter_obj = None
        if drafter is not None:
            target = TargetInfo(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden_size,
                num_layers=cfg.num_layers,
                device=self.device,
                dtype=self.dtype,
                model_dir=self.model_dir,
                model=self.model,
                tokenizer_dir=str(tokenizer_dir) if (tokenizer_dir := checkpoint.tokenizer_dir()) else None,
            )
            progress.begin(f"loading drafter {drafter}")
            drafter_obj = create_drafter(drafter, target, drafter_options)
            progress.end()
        if kv_cache_tokens is None:
            from specserve.kv_cache import PagedKVCache

            per_slot = PagedKVCache.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.model.cache_dtype())
            per_slot += drafter_obj.kv_bytes_per_slot() if drafter_obj is not None else 0
            kv_bytes = 2 << 30  # on the CPU: 2 GiB of cache at most
            if self.device.type == "cuda":
                kv_bytes = self._cuda_kv_bytes(max_num_seqs, max_prefill_tokens, drafter_obj, gpu_memory_utilization)
            kv_cache_tokens = min(max_num_seqs * (max_model_len + 64), kv_bytes // per_slot)
        eos_token_ids = checkpoint.eos_token_ids(self.tokenizer)
        # Output constraints (json_schema / regex / grammar / choice) reach the step as rules: this factory
        # gives each constrained request its matcher; `compile`/`compiled` let a server compile off-thread.
        self.constraints = ConstraintRules(self.tokenizer, cfg.vocab_size, eos_token_ids, grammar_drafting)
        # Penalties, logit bias and min_tokens edit logits after the grammar's mask (specserve/penalties.py).
        self.penalties = PenaltyRules(cfg.vocab_size, eos_token_ids)
        progress.begin(_engine_phase_name(self.model))
        self.engine = Engine(
            self.model,
            self.tokenizer,
            drafter_obj,
            EngineConfig(max_model_len=max_model_len, kv_cache_slots=kv_cache_tokens, block_size=block_size,
                         max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
                         enable_prefix_caching=enable_prefix_caching),
            eos_token_ids=eos_token_ids,
            budget_policy=make_budget_policy(speculation, drafter_obj),
            hooks=StepHooks(rule_factories=[self.constraints, self.penalties]),
            capture_layers=tuple(capture_layers),
        )
        progress.end(f"kernel warm-up {self.engine.warmup_s:.2f} s, calibrating speculation {self.engine.calibration_s:.2f} s"
                     if getattr(self.engine, "calibration_s", 0) else None)
        self.speculation = speculation
        if cuda_graphs is None:  # the CUDA default, where the backend allows it (not across ranks yet)
            cuda_graphs = self.device.type == "cuda" and self.model.backend.name == "triton" and self._tp is None
        if cuda_graphs:
            self.model.use_cuda_graphs(self.engine.cache, max_num_seqs, _graph_query_len(drafter_obj),
                                       max_model_len + _GRAPH_POSITION_MARGIN, self.engine.runner.hidden_layers,
                                       capture=self.device.type == "cuda")
            if drafter_obj is not None:
                drafter_obj.use_cuda_graphs(max_num_seqs, max_model_len + _GRAPH_POSITION_MARGIN)

    def _launch_tensor_parallel(self, size: int, cfg, model_dir, threads: int | None):
        """Start the other ranks (`specserve.tensor_parallel`) for size > 1; None for one device."""
        if size == 1:
            return None
        from specserve.tensor_parallel import check_shardable, launch

        check_shardable(cfg, size)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", 0)
        tp = launch(size, str(model_dir), self.device, self.dtype, threads)
        # close() runs this once; an LLM dropped without close() (or failing in __init__) still ends its ranks.
        self._stop_ranks = weakref.finalize(self, tp.stop)
        return tp

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp.shard.world if self._tp is not None else 1

    @property
    def tensor_parallel(self):
        """Rank 0's `TensorParallel` handle (its collectives' time, the group), or None on one device."""
        return self._tp

    def describe_ranks(self) -> list[dict]:
        """Per rank: its KV cache's shape and bytes, its heads, the checkpoint bytes it read (TP only)."""
        if self._tp is None:
            raise ValueError("describe_ranks() needs tensor_parallel_size > 1")
        from specserve.tensor_parallel import describe_rank

        return self._tp.describe(describe_rank(self.model, self.engine.cache))

    def warm_up(self) -> float:
        """Run one short greedy and one short sampled request through the engine (the drafter drafting, top-k /
        top-p / min-p filtering and logprobs in the sampled one), so a server's first clients do not wait while
        the kernels their requests first reach compile: numba compiles each kernel on its first call in a fresh
        install (seconds; a first sampled chat request took 8.8 s instead of ~1, BENCHMARKS.md) and loads it
        from its disk cache after. Nothing it does is kept: the prompt is shorter than a cache block (the prefix
        cache keeps none of it), and the budget policy is put back as it was — a step that compiled is no
        cost sample. Returns the seconds it took."""
        import copy
        import time

        t0 = time.perf_counter()
        speculator = self.engine.speculator
        policy = copy.deepcopy(speculator.policy)
        # Prompt and answer together stay under one block, so no block fills and none is offered to the cache.
        block = self.engine.config.block_size
        prompt = list(range(1, 1 + max(1, min(4, (block - 1) // 2))))
        new_tokens = max(1, min(8, block - 1 - len(prompt)))
        runs = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=new_tokens, temperature=1.0, top_k=40, top_p=0.95, min_p=0.01, seed=0,
                               logprobs=1, ignore_eos=True)]
        try:
            self.generate([prompt] * len(runs), runs)
        finally:
            speculator.policy = policy
        return time.perf_counter() - t0

    def close(self) -> None:
        """End the other tensor-parallel ranks (nothing to do on one device). The LLM is unusable after."""
        if self._tp is not None:
            self._stop_ranks()
            self._tp = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cuda_kv_bytes(self, max_num_seqs: int, max_prefill_tokens: int, drafter, utilization: float) -> int:
        """The KV cache's share of the GPU, after the weights and a reserve for the CUDA graphs' pool (the
        largest bucket's activations) and an eager prefill chunk's activations — counted before the cache
        is sized, since the graphs are captured over it."""
        from specserve.cuda_graphs import cuda_kv_budget, forward_activation_bytes

        if not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        cfg = self.model.config
        rows = max(max_num_seqs * _graph_query_len(drafter), max_prefill_tokens)
        reserve = 2 * forward_activation_bytes(cfg, rows, self.dtype) + (256 << 20)
        free, total = torch.cuda.mem_get_info(self.device)
        return cuda_kv_budget(free, total, utilization, reserve)

    # ---- prompts --------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir!r} has no tokenizer files: give prompts as token-id lists")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError("a token-id prompt must be a list of ints")
        return ids

    # ---- generation -----------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts as one batch through the step loop; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        param_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]  # validate everything before queueing anything
        ids = []
        try:
            for prompt_ids, p in zip(encoded, param_list):
                ids.append(self.engine.add_request(prompt_ids, p).request_id)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
            raise
        while any(self.engine.requests[rid].finish_reason is None for rid in ids):
            self.engine.step()
        return [self._output(self.engine.pop_finished(rid)) for rid in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               outputs: list[RequestOutput] | None = None) -> Iterator[str]:
        """Yield text deltas as tokens are accepted (the first comes straight from prefill). `outputs`, if
        given, receives the finished request's RequestOutput (its statistics and timings) at the end."""
        req = self.engine.add_request(self.encode(prompt), params or SamplingParams())
        try:
            while req.finish_reason is None:
                for delta in self.engine.step():
                    if delta.request_id == req.request_id and delta.text:
                        yield delta.text
        finally:
            if req.finish_reason is None:
                self.engine.abort(req.request_id)
            done = self.engine.pop_finished(req.request_id)
            if outputs is not None and done is not None:
                outputs.append(self._output(done))

    @staticmethod
    def _output(req) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.token_ids[: req.prompt_len].tolist(),
            token_ids=req.output_ids,
            text=req.detok.text,
            finish_reason=req.finish_reason,
            spec=req.stats,
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
            e2e_s=(req.finish_time - req.arrival_time) if req.finish_time else None,
            error=req.error,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            hidden_states=req.captured_hidden_states(),
        )




def _why_no_kernels(device: torch.device, cpu_kernels: bool, unsupported: str | None) -> str | None:
    """Why the CPU kernels will not run this LLM's model (None: they will), for the options only they offer."""
    if device.type == "cpu" and cpu_kernels and unsupported is None:
        return None
    return unsupported or ("an attention backend was named or the model is split over processes" if device.type == "cpu"
                           else f"the device is {device}")


def _kv_cache_dtype(name: str | None, no_kernels: str | None, model_dtype: torch.dtype) -> torch.dtype | None:
    """`LLM`'s kv_cache_dtype as a torch dtype for `LlamaModel.kv_cache_dtype` (None: the model's default), refused
    with one line, before anything loads, where it cannot run: the torch path's cache is the model's dtype."""
    if name is None:
        return None
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or None), got {name!r}")
    dtype = getattr(torch, name)
    if no_kernels is not None and dtype != model_dtype:
        raise ValueError(f"kv_cache_dtype={name!r} runs on the CPU kernels only, and here {no_kernels}")
    return dtype


def _check_quantization(quantization: str | None, no_kernels: str | None) -> None:
    """Refuse, before anything loads, a quantization this LLM cannot run (only the CPU kernels quantize)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), got {quantization!r}")
    if no_kernels is not None:
        raise ValueError(f"quantization={quantization!r} runs on the CPU kernels only, and here {no_kernels}")


def _describe_model(model, checkpoint, max_model_len: int | None, quantization: str | None) -> str:
    """What the loading line says about the model: which one, its size, weights and context window."""
    from specserve.bundle_paths import is_default_model
    from specserve.loading.default_model import DESCRIPTION, is_default_model_file

    path = checkpoint.path
    context = max_model_len if max_model_len is not None else default_context(model.config)
    if is_default_model(path):
        name = "the tiny code model, "
    elif is_default_model_file(path):
        name = f"the default model, {DESCRIPTION}, "
    else:
        name = ""
    weights = checkpoint.describe()
    if weights and quantization is not None:
        weights += f", requantized as {quantization}"
    params = model.config.num_params
    return f"{name}{params / 1e6:.0f}M parameters, {weights + ', ' if weights else ''}{context}-token context"


def _engine_phase_name(model) -> str:
    """The engine's start-up line: on the CPU kernels' first run it compiles them (numba caches them on disk)."""
    if getattr(model, "kernels", None) is not None:
        from specserve.kernels.cache import missing_from_cache

        if missing_from_cache(quantized=model.kernels.quantized, floats=model.kernels.has_float_products):
            return "compiling kernels (first run only: numba caches them on disk)"
    return "starting engine"


