"""`specserve bench gpu`: what one GPU buys us on a Llama-3-8B-shaped model, in one run under 8 minutes.

Random bf16 weights in the exact shape of Llama-3-8B (hidden 4096, 32 layers, 32/8 heads, MLP 14336,
vocabulary 128256; ~16 GB) are built in GPU memory — never written to disk — first as a transformers
`LlamaForCausalLM` (its own random init, std 0.02) whose tensors our `LlamaModel` then loads
(`load_hf_state`: norms, o_proj, down and the LM head are shared, q|k|v and gate|up fused copies), so
both stacks run the SAME weights. Timings use `time.perf_counter` around work fenced by
`specserve.evals.common.sync` (a CUDA synchronize). Sections:

1. **plain decode** at batch 1 and 8 through our `Engine` (scheduler, StepBatch building, forward,
   acceptance and commit every step: the per-step host work the server really does), against the
   bandwidth floor (weight bytes read per step ÷ measured device copy bandwidth) and transformers'
   `generate(cache_implementation="static")`, eager and auto-compiled, timed alternately with ours.
   Greedy outputs of both stacks on the same weights are compared token for token (`agreement`).
   The compiled run comes last, after section 4, in whatever is left of --budget-s: compiling takes
   minutes and must not cost the other sections.
2. **verify cost vs tree size** (0..64 draft nodes) at batch 1, 8 and 32: one target forward
   (`LlamaModel.forward` on a prebuilt StepBatch, as `specserve bench verify` times it) relative to
   the plain (0-node) step at the same batch. Speculation pays while τ exceeds that ratio.
3. **EAGLE-3 head cost**: one draft level of an EAGLE-3-shaped head (one decoder layer over
   [embed; feature], its own norm and a 32000-token draft LM head) for top-k frontier width at batch
   1, forward + logits + the copy to the host the tree builder reads, relative to a plain target step.
4. **end-to-end drafters** on the embedded model (`specserve eval`'s own machinery on held-out code,
   few prompts; static speculation by default, so τ is each drafter's own acceptance): τ and speedup
   of every drafter over plain decoding.
5. **projection**: speedup ≈ τ / (verify ratio(tree size) + levels × head level ratio) from sections
   2–3, for section 4's measured τ (or `--tau`). A model, not a measurement: it ignores acceptance
   and tree-building host work and charges every τ an EAGLE-3 head.

CUDA graphs, where the stack has them (`LlamaModel.use_cuda_graphs`), are captured per section over
that section's KV cache (a model's graphs are bound to one cache); replays are counted in the JSON.
--json and --markdown are rewritten after every section, so a run cut short keeps what finished.

Without CUDA the command runs nothing (one line, exit 2). `--device cpu --shape tiny` (testing
options) run every section's code path on a tiny fp32 model on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.cli import one_line
from specserve.evals.common import first_divergence, host, median_spread, sync, write_json

SECTION_NAMES = {1: "plain_decode", 2: "verify_cost", 3: "eagle3_head", 4: "drafters_e2e", 5: "projection"}
SHAPES = {
    # Llama-3-8B's architecture (rope theta 500000 as shipped; RoPE does not change costs).
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               initializer_range=0.02),
    # Tests only: every code path in seconds on a CPU. A wider init than 8B's keeps greedy argmaxes apart.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0,
                 initializer_range=0.2),
}
DRAFT_VOCAB = {"8b": 32000, "tiny": 256}  # EAGLE-3 heads for Llama-3-8B draft over 32000 tokens
DEFAULT_DRAFTERS = "ngram,suffix,lookahead,draft,medusa,eagle,hybrid:suffix+eagle"
GRAPH_MAX_QUERY_LEN = 64  # rows per sequence `LLM` captures CUDA graphs for (root + tree)
COMPILE_MIN_LEFT_S = 200.0  # transformers' compile warm-up takes a minute or two per batch size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="a CUDA device (default cuda); 'cpu' only with --shape tiny (tests)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                   help="8b: Llama-3-8B-shaped random weights (default); tiny: a test-sized model")
    p.add_argument("--attention", default=None, help="attention backend (default: the stack's default for the device)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="do not capture CUDA graphs for our decode steps")
    p.add_argument("--sections", default="1,2,3,4,5",
                   help="comma-separated: 1 plain decode, 2 verify cost, 3 EAGLE-3 head, 4 drafters end to end, "
                        "5 projection (needs 2 and 3)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed generations per contender in section 1 (forward timings: 10x this)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request in section 1")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt (sections 1) and cached prefix (2, 3) length")
    p.add_argument("--batch-sizes", default="1,8", help="section 1's batch sizes")
    p.add_argument("--verify-batch-sizes", default="1,8,32", help="section 2's batch sizes")
    p.add_argument("--tree-sizes", default="0,4,8,16,32,64", help="section 2's draft tree sizes (nodes)")
    p.add_argument("--branching", type=int, default=4, help="children per node of section 2's breadth-first trees")
    p.add_argument("--head-topk", type=int, default=8, help="section 3's frontier width (EAGLE's top-k)")
    p.add_argument("--draft-levels", type=int, default=6, help="head levels charged per step in section 5")
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS, help="section 4's drafter specs, comma-separated")
    p.add_argument("--speculation", choices=("static", "adaptive"), default="static",
                   help="section 4: static (default: every drafter at its own budget every step, so τ is the "
                        "drafter's acceptance, what section 5 projects from) or adaptive (what `specserve eval` and "
                        "users get: trees sized by measured cost, plain steps where speculation does not pay)")
    p.add_argument("--eval-prompts", type=int, default=4, help="section 4's held-out prompts")
    p.add_argument("--eval-tokens", type=int, default=64, help="section 4's tokens per prompt")
    p.add_argument("--eval-repeats", type=int, default=3,
                   help="section 4's timed passes over the prompts (median): a first pass at a new prompt length "
                        "pays Triton's compilation for the shapes it meets, which one pass alone would report")
    p.add_argument("--tau", default="2.0,2.5,3.0,3.5", help="section 5's τ values when section 4 does not run")
    p.add_argument("--no-compile", action="store_true", help="skip transformers' torch.compile'd generate")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="the compiled transformers run is skipped once less than 200 s of this budget are left")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables as markdown")


# ---- options ------------------------------------------------------------------------------------


def _int_list(text: str, flag: str, low: int) -> list[int]:
    try:
        values = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values or values[0] < low:
        raise ValueError(f"{flag} must be integers >= {low}, got {text!r}")
    return values


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{flag} must be positive numbers, got {text!r}")
    return values


@dataclass
class Settings:
    """The checked options; built before anything heavy runs, so bad input costs nothing."""

    device: torch.device
    shape: str
    dtype: torch.dtype
    attention: str
    cuda_graphs: bool
    sections: list[int]
    repeats: int
    forward_repeats: int
    new_tokens: int
    prompt_tokens: int
    batch_sizes: list[int]
    verify_batch_sizes: list[int]
    tree_sizes: list[int]
    branching: int
    head_topk: int
    draft_levels: int
    drafters: list[str]
    eval_prompts: int
    eval_tokens: int
    eval_repeats: int
    speculation: str
    tau: list[float]
    compile: bool
    budget_s: float
    deadline: float  # perf_counter time after which optional slow work is skipped


def check_args(args: argparse.Namespace) -> Settings:
    """Validate every option, and that the device is a CUDA one (or the CPU test mode)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"specserve bench gpu needs a CUDA device, and torch {torch.__version__} sees none "
                             "(torch.cuda.is_available() is False): run it on a machine with an NVIDIA GPU")
    elif device.type == "cpu":
        if args.shape != "tiny":
            raise ValueError("specserve bench gpu needs a CUDA device; --device cpu is a test mode, only with --shape tiny")
    else:
        raise ValueError(f"specserve bench gpu needs a CUDA device, got --device {args.device!r}")
    sections = _int_list(args.sections, "--sections", 1)
    if sections[-1] > 5:
        raise ValueError(f"--sections are numbers 1-5, got {args.sections!r}")
    if 5 in sections and not {2, 3} <= set(sections):
        raise ValueError("section 5 (projection) needs sections 2 and 3: add them to --sections")
    for name in ("repeats", "new_tokens", "prompt_tokens", "branching", "head_topk", "draft_levels", "eval_prompts",
                 "eval_tokens", "eval_repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (decode speed is measured after the first token), got {args.new_tokens}")
    tree_sizes = sorted({0, *_int_list(args.tree_sizes, "--tree-sizes", 0)})
    drafters = [s.strip() for s in args.drafters.split(",") if s.strip()]
    if 4 in sections and not drafters:
        raise ValueError("--drafters is empty: section 4 needs at least one drafter spec")
    attention = args.attention
    if attention is None:  # the stack's own default for the device (older stacks: sdpa everywhere)
        import specserve.attention as attention_module

        default = getattr(attention_module, "default_attention", None)
        attention = default(device) if default is not None else "sdpa"
    return Settings(
        device=device, shape=args.shape, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        attention=attention, cuda_graphs=device.type == "cuda" and not args.no_cuda_graphs, sections=sections,
        repeats=args.repeats, forward_repeats=10 * args.repeats, new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens, batch_sizes=_int_list(args.batch_sizes, "--batch-sizes", 1),
        verify_batch_sizes=_int_list(args.verify_batch_sizes, "--verify-batch-sizes", 1), tree_sizes=tree_sizes,
        branching=args.branching, head_topk=args.head_topk, draft_levels=args.draft_levels, drafters=drafters,
        eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens, eval_repeats=args.eval_repeats, speculation=args.speculation, tau=_float_list(args.tau, "--tau"),
        compile=not args.no_compile, budget_s=args.budget_s, deadline=time.perf_counter() + args.budget_s,
    )


def _log(message: str) -> None:
    print(f"bench gpu: {message}", file=sys.stderr, flush=True)


def _one_line(exc: BaseException) -> str:
    """An error for the report: its type, then its message on one line (the CLI's `one_line`)."""
    return f"{type(exc).__name__}: {one_line(exc)}"[:300]


def _timed(fn, device: torch.device) -> tuple[float, object]:
    """Seconds `fn()` takes with the device's queue drained before and after; and its result."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


# ---- the models ---------------------------------------------------------------------------------


def hf_config(shape: str):
    """transformers' LlamaConfig of `shape` (no special tokens: generation never stops early)."""
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)


@dataclass
class Models:
    hf: object  # transformers LlamaForCausalLM
    ours: object  # specserve.model.LlamaModel, sharing or copying hf's tensors


def build_models(s: Settings, seed: int = 0) -> Models:
    """Both stacks on the same random weights, built in device memory (nothing written to disk)."""
    from transformers import LlamaForCausalLM

    from specserve.config import config_from_hf
    from specserve.model import LlamaModel

    config = hf_config(s.shape)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(s.device):  # transformers initialises in place on the GPU: seconds, not minutes
        hf = LlamaForCausalLM._from_config(config, dtype=s.dtype).eval()
    hf.generation_config.pad_token_id = 0
    ours = LlamaModel(config_from_hf(config), s.device, s.dtype, s.attention)
    ours.load_hf_state(dict(hf.state_dict()))  # HF key names, exactly what from_pretrained hands it
    sync(s.device)
    _log(f"built {s.shape} models on {s.device} in {time.perf_counter() - t0:.1f}s")
    return Models(hf, ours)


def cuda_graphs(model, cache, wanted: bool, max_num_seqs: int, max_query_len: int, max_positions: int) -> str:
    """Capture `model`'s forward over `cache` in CUDA graphs where this stack has them
    (`LlamaModel.use_cuda_graphs`: buckets up to max_num_seqs x max_query_len rows). Graphs are bound to
    one cache, so each section captures over its own; returns what happened, for the report."""
    if not wanted:
        return "off"
    current = getattr(model, "graphs", None)
    if current is not None and getattr(current, "cache", None) is cache:
        return "on"  # already captured over this cache (by the engine itself)
    t0 = time.perf_counter()
    try:
        model.use_cuda_graphs(cache, max_num_seqs, max_query_len, max_positions)
    except Exception as exc:  # a capture problem is reported; the section then runs eagerly
        return f"failed: {_one_line(exc)}"
    _log(f"captured CUDA graphs ({max_num_seqs} seqs x {max_query_len} rows) in {time.perf_counter() - t0:.1f}s")
    return "on"


def graph_replays(model) -> int | None:
    """Forwards served from CUDA graphs so far on the model's current graphs (None: none captured)."""
    graphs = getattr(model, "graphs", None)
    return getattr(graphs, "replays", None) if graphs is not None else None


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> dict:
    """Device copy bandwidth: bytes READ plus bytes WRITTEN by `dst.copy_(src)` (2 × size) per second.

    Decode only reads weights, but a copy is the cleanest streaming kernel to time; counting both
    directions is the honest figure for it (a read-only reduction would be a different kernel)."""
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch, kernel load
    times = [_timed(lambda: dst.copy_(src), device)[0] for _ in range(repeats)]
    del src, dst
    return {"bytes_per_copy_read_plus_write": 2 * num_bytes, "best_GBps": 2 * num_bytes / min(times) / 1e9,
            "median_GBps": 2 * num_bytes / statistics.median(times) / 1e9, "copies": repeats}


# ---- section 1: plain decode ----------------------------------------------------------------------


def _engine(model, batch: int, max_len: int, prefill_tokens: int):
    """A plain-decoding Engine around the in-memory model: the scheduler, StepBatch building, forward,
    acceptance and commit of every real step; no tokenizer (token-id prompts) and no drafter."""
    from specserve.engine import Engine, EngineConfig

    config = EngineConfig(max_model_len=max_len, kv_cache_slots=batch * (max_len + 64), max_num_seqs=batch,
                          max_prefill_tokens=prefill_tokens)
    return Engine(model, None, None, config)


def generate_ours(engine, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict:
    """Greedy generation of `prompts` as one batch through `engine.step()`, as `LLM.generate` runs it.

    Returns wall seconds for the whole call, decode seconds (from the last first token to the last
    finish, prefill excluded) and tokens, and the output ids per prompt."""
    from specserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run() -> list:
        ids = [engine.add_request(p, params).request_id for p in prompts]
        while any(engine.requests[r].finish_reason is None for r in ids):
            engine.step()
        return [engine.pop_finished(r) for r in ids]

    seconds, reqs = _timed(run, device)
    for r in reqs:
        if r.finish_reason != "length" or len(r.output_ids) != new_tokens:
            raise RuntimeError(f"our decode stopped early: {r.finish_reason} after {len(r.output_ids)} tokens "
                               f"({getattr(r, 'error', None)})")
    first = max(r.first_token_time for r in reqs)
    last = max(r.finish_time for r in reqs)
    return {"seconds": seconds, "decode_seconds": last - first, "decode_tokens": len(reqs) * (new_tokens - 1),
            "tokens": [list(r.output_ids) for r in reqs]}


def generate_hf(hf, prompts: list[list[int]], new_tokens: int, device: torch.device, compiled: bool) -> dict:
    """transformers' greedy `generate` with a static cache; `compiled`: its own auto-compiled forward
    (transformers compiles a static-cache generate's forward on accelerators unless told not to)."""
    ids = torch.tensor(prompts, device=device)

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                               cache_implementation="static", disable_compile=not compiled)

    seconds, out = _timed(run, device)
    return {"seconds": seconds, "tokens": out[:, ids.shape[1]:].tolist()}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Token-for-token agreement of two greedy runs, row by row: after a row's first differing token the
    two continue from different prefixes, so only its common prefix counts."""
    firsts, same = [], 0
    for a, b in zip(ours, theirs):
        first = first_divergence(a, b)
        firsts.append(first)
        same += len(a) if first is None else first
    total = sum(len(a) for a in ours)
    return {"tokens_match": all(f is None for f in firsts) and [len(a) for a in ours] == [len(b) for b in theirs],
            "fraction": same / max(total, 1), "first_divergence_per_row": firsts}


def prefill_logits_gap(m: Models, prompt: list[int], device: torch.device) -> dict:
    """Both stacks' logits over one prompt (every row), eagerly, in the weights' dtype.

    Greedy agreement alone cannot tell a bug from rounding on random weights: their logits are nearly
    flat, so two correct bf16 stacks (different fusions, different summation order) pick different
    argmaxes early. The relative gap ‖ours − theirs‖ / ‖theirs‖ says whether the numbers agree (bf16
    rounding of O(1) activations: ~1e-2; a wrong layer: ~1), and transformers' own top-1 − top-2 margin
    against our gap at that token says why the argmaxes part."""
    from specserve.kv_cache import BlockAllocator
    from specserve.step_batch import StepBatchBuilder

    with torch.inference_mode():
        theirs = m.hf(torch.tensor([prompt], device=device)).logits[0].float()  # [rows, vocab]
        allocator = BlockAllocator(len(prompt) // 16 + 2, 16)
        allocator.allocate("gap", len(prompt))
        builder = StepBatchBuilder(allocator)
        builder.add("gap", 0, np.asarray(prompt, dtype=np.int64), logits="all")
        ours = m.ours.eager_forward(builder.build(), m.ours.new_cache(allocator)).logits.float()  # [rows, vocab]
    top2 = theirs.topk(2, dim=-1)
    top1 = top2.indices[:, 0]
    gap_at_top1 = (ours - theirs).gather(1, top1[:, None])[:, 0].abs()
    return {"relative_gap": float((ours - theirs).norm() / theirs.norm()),
            "top1_same": float((ours.argmax(-1) == top1).float().mean()),
            "median_top1_margin": float((top2.values[:, 0] - top2.values[:, 1]).median()),
            "median_gap_at_top1": float(gap_at_top1.median()), "rows": len(prompt)}


@dataclass
class DecodeCase:
    """One batch size of section 1: its prompts and its engine, kept for the compiled-transformers phase."""

    batch: int
    prompts: list[list[int]]  # [batch][prompt_tokens] random token ids
    engine: object
    max_len: int


def _alternate(contenders: dict, repeats: int) -> tuple[dict, dict[str, list[dict]]]:
    """Round 0 runs every contender once, not counted (warm-up and compilation; its greedy outputs are
    the ones compared); then `repeats` rounds, contenders one after another, so drift hits all alike.
    Returns (round 0's result per contender, the counted results per contender)."""
    first: dict = {}
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for rep in range(repeats + 1):
        for name, fn in contenders.items():
            result = fn()
            if rep == 0:
                first[name] = result
            else:
                runs[name].append(result)
    return first, runs


def _ours(s: Settings, m: Models, case: DecodeCase):
    """Our contender for `case`: graphs (re)captured over its engine's cache first — a model keeps the graphs
    of one cache, and other sections capture over their own."""
    # Block tables reach past max_len (the scheduler reserves slots for forced tokens): leave room.
    graphs = cuda_graphs(m.ours, case.engine.cache, s.cuda_graphs, case.batch, 1, case.max_len + 64)
    return graphs, lambda: generate_ours(case.engine, case.prompts, s.new_tokens, s.device)


def plain_decode(s: Settings, m: Models, gen: torch.Generator) -> tuple[dict, list[DecodeCase]]:
    """Section 1 (its compiled-transformers column comes later, `compiled_decode`, in whatever time is
    left): our decode at each batch size vs the bandwidth floor and eager transformers."""
    weight_bytes = m.ours.bytes_read_per_token()
    bw = copy_bandwidth(s.device, (2 << 30) if s.shape == "8b" else (64 << 20), max(5, s.repeats * 3))
    floor_steps = bw["best_GBps"] * 1e9 / weight_bytes  # steps/s if every step only streamed the weights once
    out = {"path": "Engine.step loop (scheduler, StepBatch, forward, greedy acceptance, commit), no drafter",
           "weight_bytes_per_step": weight_bytes, "copy_bandwidth": bw, "floor_steps_per_s": floor_steps,
           "floor_ms_per_step": 1e3 / floor_steps, "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
           "repeats": s.repeats, "batches": []}
    cases = []
    for batch in s.batch_sizes:
        max_len = s.prompt_tokens + s.new_tokens + 1
        case = DecodeCase(batch, torch.randint(0, m.ours.config.vocab_size, (batch, s.prompt_tokens), generator=gen).tolist(),
                          _engine(m.ours, batch, max_len, batch * s.prompt_tokens), max_len)
        graphs, ours = _ours(s, m, case)
        first, runs = _alternate({"specserve": ours, "transformers": lambda: generate_hf(
            m.hf, case.prompts, s.new_tokens, s.device, compiled=False)}, s.repeats)
        row = _decode_row(batch, s.new_tokens, runs, floor_steps)
        row["agreement"] = agreement(first["specserve"]["tokens"], first["transformers"]["tokens"])
        if batch == s.batch_sizes[0]:
            row["prefill_logits"] = prefill_logits_gap(m, case.prompts[0], s.device)
        row["cuda_graphs"], row["graph_replays"] = graphs, graph_replays(m.ours)
        row["transformers_compiled"] = {"status": "pending"}
        out["batches"].append(row)
        cases.append(case)
        _log(f"batch {batch}: plain decode timed")
    return out, cases


def compiled_decode(s: Settings, m: Models, section: dict, cases: list[DecodeCase]) -> None:
    """Section 1's last column, run after sections 2-4 because compiling takes minutes: transformers'
    auto-compiled static-cache generate, alternating with ours again, at each batch size while at least
    COMPILE_MIN_LEFT_S of --budget-s are left. A failure is reported in one line, never fatal."""
    for row, case in zip(section["batches"], cases):
        status = _compile_status(s)
        if status is not None:
            row["transformers_compiled"] = {"status": status}
            continue
        _, ours = _ours(s, m, case)
        try:
            first, runs = _alternate({"specserve": ours, "transformers_compiled": lambda: generate_hf(
                m.hf, case.prompts, s.new_tokens, s.device, compiled=True)}, s.repeats)
        except Exception as exc:  # dynamo / inductor errors: report them, keep everything else
            row["transformers_compiled"] = {"status": f"failed: {_one_line(exc)}"}
            _log(f"batch {case.batch}: transformers compiled failed: {_one_line(exc)}")
            continue
        ours_tps = statistics.median(case.batch * s.new_tokens / r["seconds"] for r in runs["specserve"])
        theirs = [case.batch * s.new_tokens / r["seconds"] for r in runs["transformers_compiled"]]
        row["transformers_compiled"] = {
            "status": "ran", "compiled": getattr(m.hf, "_compiled_call", None) is not None,
            "first_call_s": first["transformers_compiled"]["seconds"], "tokens_per_s": median_spread(theirs),
            "specserve_tokens_per_s_alongside": ours_tps, "specserve_speedup": ours_tps / statistics.median(theirs),
            "agreement": agreement(first["specserve"]["tokens"], first["transformers_compiled"]["tokens"])}
        _log(f"batch {case.batch}: transformers compiled timed (first call {first['transformers_compiled']['seconds']:.0f} s)")


def _compile_status(s: Settings) -> str | None:
    """Why the compiled transformers contender does not run (None: it runs)."""
    if not s.compile:
        return "skipped: --no-compile"
    if s.device.type != "cuda":
        return "skipped: transformers compiles generate's forward on accelerators only"
    if s.deadline - time.perf_counter() < COMPILE_MIN_LEFT_S:
        return f"skipped: under {COMPILE_MIN_LEFT_S:.0f} s of --budget-s left"
    return None


def _decode_row(batch: int, new_tokens: int, runs: dict[str, list[dict]], floor_steps: float) -> dict:
    """One batch size's figures: end-to-end tokens/s of both contenders (prefill included, the same
    clock for both), and our decode-only rate against the floor."""
    total = batch * new_tokens
    e2e = {name: [total / r["seconds"] for r in rs] for name, rs in runs.items()}
    ours_decode = [r["decode_tokens"] / r["decode_seconds"] for r in runs["specserve"]]
    decode = statistics.median(ours_decode)
    return {"batch": batch,
            "specserve": {"tokens_per_s": median_spread(e2e["specserve"]), "decode_tokens_per_s": median_spread(ours_decode),
                          "decode_ms_per_step": 1e3 * batch / decode},
            "floor_tokens_per_s": floor_steps * batch,
            "fraction_of_floor": decode / (floor_steps * batch),
            "transformers": {"tokens_per_s": median_spread(e2e["transformers"]),
                             "specserve_speedup": statistics.median(e2e["specserve"]) / statistics.median(e2e["transformers"])}}


# ---- section 2: verify cost vs tree size ------------------------------------------------------------


@contextlib.contextmanager
def _sequences(allocator, names: list[str], slots: int):
    """Cache blocks for `names` (`slots` each), freed on exit."""
    for name in names:
        allocator.allocate(name, slots)
    try:
        yield names
    finally:
        for name in names:
            allocator.free(name)


def _prefill(model, cache, names: list[str], prefix: int, gen: torch.Generator) -> None:
    """Commit a random `prefix`-token context to every sequence in one forward."""
    from specserve.step_batch import StepBatchBuilder

    builder = StepBatchBuilder(cache.allocator)
    for name in names:
        builder.add(name, 0, torch.randint(0, model.config.vocab_size, (prefix,), generator=gen).numpy(), logits="last")
    model.forward(builder.build(), cache)


def verify_batch(allocator, names: list[str], prefix: int, nodes: int, branching: int, vocab: int,
                 gen: torch.Generator):
    """One verify StepBatch: each sequence brings its root plus a breadth-first `nodes`-node draft tree
    after `prefix` cached tokens, logits at every row (what the engine's runner builds)."""
    from specserve.evals.bench_verify import tree_parents
    from specserve.step_batch import StepBatchBuilder
    from specserve.verify import DraftTree

    builder = StepBatchBuilder(allocator)
    for name in names:
        tree = DraftTree(torch.randint(0, vocab, (nodes,), generator=gen),
                         torch.tensor(tree_parents(nodes, "tree", branching), dtype=torch.int64))
        ids = torch.cat([torch.randint(0, vocab, (1,), generator=gen), tree.tokens]).numpy()
        mask = tree.ancestor_mask.numpy() if nodes else None
        builder.add(name, prefix, ids, tree.positions(prefix).numpy(), mask, logits="all")
    return builder.build()


def verify_cost(s: Settings, model, gen: torch.Generator) -> dict:
    """Section 2: median verify-forward time per (batch, tree size), relative to 0 nodes at that batch.
    Sizes are interleaved within each batch, after two warm-up rounds."""
    from specserve.kv_cache import BlockAllocator

    block = 16
    per_seq = s.prompt_tokens + s.tree_sizes[-1] + 1
    most = max(s.verify_batch_sizes)
    allocator = BlockAllocator(most * -(-per_seq // block), block)
    cache = model.new_cache(allocator)
    # Buckets as `LLM` captures them: at most 64 rows per sequence, bigger trees run eagerly there too.
    graphs = cuda_graphs(model, cache, s.cuda_graphs, most, min(GRAPH_MAX_QUERY_LEN, s.tree_sizes[-1] + 1), per_seq)
    rows = []
    for batch in s.verify_batch_sizes:
        with _sequences(allocator, [f"verify-{i}" for i in range(batch)], per_seq) as names:
            _prefill(model, cache, names, s.prompt_tokens, gen)
            steps = {n: verify_batch(allocator, names, s.prompt_tokens, n, s.branching, model.config.vocab_size, gen)
                     for n in s.tree_sizes}
            times: dict[int, list[float]] = {n: [] for n in s.tree_sizes}
            for rep in range(s.forward_repeats + 2):
                for n, step in steps.items():  # writes tree K/V past the prefix; nothing is committed
                    seconds, _ = _timed(lambda: model.forward(step, cache), s.device)
                    if rep >= 2:
                        times[n].append(seconds)
        base = statistics.median(times[0])
        for n in s.tree_sizes:
            med = statistics.median(times[n])
            rows.append({"batch": batch, "nodes": n, "rows": batch * (n + 1), "ms": 1e3 * med,
                         "ms_min": 1e3 * min(times[n]), "ms_max": 1e3 * max(times[n]), "ratio": med / base})
        _log(f"batch {batch}: verify cost timed")
    del cache
    return {"timed": "LlamaModel.forward on a prebuilt StepBatch (batch building and acceptance excluded)",
            "prefix_tokens": s.prompt_tokens, "tree": f"breadth-first, {s.branching} children per node",
            "repeats": s.forward_repeats, "cuda_graphs": graphs, "graph_replays": graph_replays(model), "rows": rows}


# ---- section 3: EAGLE-3 head cost ---------------------------------------------------------------------


def eagle3_head(s: Settings, model):
    """A random EAGLE-3 head for `model`: one decoder layer of the target's shape reading 2H, fused
    features from the target's (2, L/2, L-3) layers, its own draft LM head over DRAFT_VOCAB tokens."""
    from specserve.drafters.eagle_head import EagleHead, EagleHeadConfig, default_feature_layers

    hf = model.config.hf_config
    layer = {k: getattr(hf, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")}
    cfg = EagleHeadConfig(mode="eagle3", layer=layer, vocab_size=model.config.vocab_size,
                          draft_vocab_size=DRAFT_VOCAB[s.shape],
                          feature_layers=default_feature_layers("eagle3", model.config.num_layers), fc_bias=False)
    return EagleHead(cfg, model.embed, None, s.device, s.dtype, s.attention)


def head_cost(s: Settings, model, gen: torch.Generator) -> dict:
    """Section 3: one head level at batch 1 (`head_topk` frontier nodes fed as (parent feature, token)
    after a cached prefix: forward, logits, copy to the host) and one catch-up (the root pair: fuse
    three target features, forward, logits, copy), each relative to a plain target step at batch 1.
    The three are interleaved; tree building on the host is not included."""
    from specserve.kv_cache import BlockAllocator
    from specserve.step_batch import StepBatchBuilder

    head = eagle3_head(s, model)
    h, k, prefix = model.config.hidden_size, s.head_topk, s.prompt_tokens
    block = 16
    allocator = BlockAllocator(2 * -(-(prefix + 2 * k + 2) // block), block)
    head_cache, target_cache = head.new_cache(allocator), model.new_cache(allocator)
    graphs = cuda_graphs(model, target_cache, s.cuda_graphs, 1, 1, prefix + 2 * k + 2)

    def features(rows: int) -> list[torch.Tensor]:  # three target layers' features [rows, H] each
        return [0.5 * torch.randn(rows, h, generator=gen).to(s.device, s.dtype) for _ in head.cfg.feature_layers]

    with _sequences(allocator, ["head", "target"], prefix + 2 * k + 2):
        builder = StepBatchBuilder(allocator)
        tokens = torch.randint(0, model.config.vocab_size, (prefix,), generator=gen)
        builder.add("head", 0, tokens.numpy())
        with torch.inference_mode():
            head(tokens.to(s.device), head.fuse(features(prefix)), builder.build(), head_cache)  # committed pairs
        _prefill(model, target_cache, ["target"], prefix, gen)

        root_token = torch.randint(0, model.config.vocab_size, (1,), generator=gen)
        root_batch = StepBatchBuilder(allocator)
        root_batch.add("head", prefix, root_token.numpy())
        root_batch = root_batch.build()
        root_feats = features(1)
        level_tokens = torch.randint(0, model.config.vocab_size, (k,), generator=gen)
        level_batch = StepBatchBuilder(allocator)  # level 2: k siblings at one position, each sees only itself
        level_batch.add("head", prefix + 1, level_tokens.numpy(), np.full(k, prefix + 1, dtype=np.int64),
                        np.eye(k, dtype=np.bool_))
        level_batch = level_batch.build()
        level_feats = torch.randn(k, h, generator=gen).to(s.device, s.dtype)  # parents' predicted features [k, H]
        plain_batch = StepBatchBuilder(allocator)
        plain_batch.add("target", prefix, root_token.numpy(), logits="all")
        plain_batch = plain_batch.build()
        root_ids, level_ids = root_token.to(s.device), level_tokens.to(s.device)

        @torch.inference_mode()
        def catch_up():
            out = head(root_ids, head.fuse(root_feats), root_batch, head_cache)  # [1, H]
            return head.logits(out).float().cpu()  # [1, draft vocab] on the host

        @torch.inference_mode()
        def level():
            out = head(level_ids, level_feats, level_batch, head_cache)  # [k, H]
            return head.logits(out).float().cpu()  # [k, draft vocab] on the host, as the tree builder reads it

        def plain():  # the forward alone, as section 2 times it (the engine reduces logits on the device)
            return model.forward(plain_batch, target_cache)

        cases = {"plain_target_step": plain, "head_catch_up": catch_up, "head_level": level}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(s.forward_repeats + 2):
            for name, fn in cases.items():
                seconds, _ = _timed(fn, s.device)
                if rep >= 2:
                    times[name].append(seconds)
    base = statistics.median(times["plain_target_step"])
    out = {"head": {"mode": "eagle3", "layers": 1, "draft_vocab": head.cfg.draft_vocab_size,
                    "feature_layers": list(head.cfg.feature_layers),
                    "params": sum(p.numel() for p in head.parameters())},
           "batch": 1, "topk": k, "prefix_tokens": prefix, "repeats": s.forward_repeats,
           "cuda_graphs": {"target": graphs, "head": "eager (the head has no graphs here)"}}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"ms": 1e3 * med, "ms_min": 1e3 * min(ts), "ms_max": 1e3 * max(ts), "ratio": med / base}
    _log("EAGLE-3 head timed")
    del head, head_cache, target_cache
    return out


# ---- section 4: drafters end to end ----------------------------------------------------------------------


def drafters_e2e(s: Settings) -> dict:
    """Section 4: `specserve eval` on the embedded model (its held-out code, batch 1, greedy, --speculation)
    — τ and speedup of each drafter over plain decoding."""
    from specserve.evals.suite import EvalConfig, run_eval

    with tempfile.TemporaryDirectory() as out:
        res = run_eval(EvalConfig(drafters=s.drafters, dataset="builtin:heldout-code", out=out,
                                  max_prompts=s.eval_prompts, max_tokens=s.eval_tokens, repeats=s.eval_repeats,
                                  device=str(s.device), speculation=s.speculation, progress=False))
    rows = []
    for spec in s.drafters:
        d = res["drafters"][spec]
        rows.append({"drafter": spec, "tau": d["tau"], "speedup": d["speedup"], "tokens_per_s": d["tokens_per_s"],
                     "identical_fraction": d["identical_fraction"]})
    _log("drafters timed end to end")
    return {"model": "embedded default model", "dataset": "builtin:heldout-code", "prompts": s.eval_prompts,
            "repeats": s.eval_repeats,
            "speculation": s.speculation,
            "max_tokens": s.eval_tokens, "plain_tokens_per_s": res["plain"]["tokens_per_s"], "drafters": rows}


# ---- section 5: projection -------------------------------------------------------------------------------


def projection(s: Settings, sections: dict) -> dict:
    """Section 5: speedup ≈ τ / (verify ratio(N) + levels × head level ratio) at batch 1, for the τ
    section 4 measured (else --tau) and the measured tree sizes of 8 nodes or more (else all > 0)."""
    verify, head = sections.get(SECTION_NAMES[2]), sections.get(SECTION_NAMES[3])
    if verify is None or head is None:
        raise ValueError("section 5 (projection) needs sections 2 and 3: add them to --sections")
    ratios = {r["nodes"]: r["ratio"] for r in verify["rows"] if r["batch"] == min(s.verify_batch_sizes)}
    sizes = [n for n in ratios if n >= 8] or [n for n in ratios if n > 0]
    level = head["head_level"]["ratio"]
    e2e = sections.get(SECTION_NAMES[4])
    taus = ([(r["drafter"], r["tau"]) for r in e2e["drafters"] if r["tau"]] if e2e else
            [("--tau", t) for t in s.tau])
    rows = []
    for source, tau in taus:
        for n in sizes:
            levels = min(s.draft_levels, n)
            cost = ratios[n] + levels * level
            rows.append({"tau_from": source, "tau": tau, "nodes": n, "levels": levels, "verify_ratio": ratios[n],
                         "head_ratio": levels * level, "step_cost_ratio": cost, "projected_speedup": tau / cost})
    return {"label": "projection", "batch": min(s.verify_batch_sizes),
            "formula": "tau / (verify_ratio(nodes) + levels * head_level_ratio)", "rows": rows}


# ---- the report ------------------------------------------------------------------------------------------


def meta(s: Settings) -> dict:
    """What ran where: device, versions, date, shape and settings."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = s.device.type == "cuda"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(s.device), "device_name": torch.cuda.get_device_name(s.device) if cuda else host()["processor"],
            "torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "host": host(), "shape": s.shape, "model": SHAPES[s.shape],
            "dtype": str(s.dtype).removeprefix("torch."), "attention": s.attention,
            "cuda_graphs": "wanted" if s.cuda_graphs else "off", "budget_s": s.budget_s,
            "sections": s.sections}


def _table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _md_decode(d: dict) -> list[str]:
    bw = d["copy_bandwidth"]

    def compiled(r: dict) -> list:
        c = r["transformers_compiled"]
        return [c["tokens_per_s"]["median"], c["specserve_speedup"]] if "tokens_per_s" in c else [c["status"], "—"]

    return ["## 1. Plain decode",
            f"Ours: {d['path']}. tok/s = batch × new tokens ÷ wall time of the whole call (prefill of "
            f"{d['prompt_tokens']} tokens included, the same clock for every contender); decode tok/s and ms/step "
            f"exclude prefill. Floor = {d['weight_bytes_per_step'] / 1e9:.3g} GB of weights per step ÷ "
            f"{bw['best_GBps']:.0f} GB/s device copy bandwidth (read + write bytes, best of {bw['copies']} copies). "
            "transformers: `generate(cache_implementation=\"static\")` on the same weights, eager and auto-compiled; "
            "greedy agreement: the share of our tokens transformers' eager run matches (common prefix per row). "
            "CUDA graphs: " + ", ".join(f"batch {r['batch']} {r['cuda_graphs']} ({r['graph_replays']} replays)"
                                        for r in d["batches"]) + ".",
            _table(["batch", "ours tok/s", "ours decode tok/s", "ours ms/step", "floor ms/step", "of floor", "HF tok/s",
                    "ours/HF", "HF compiled tok/s", "ours/HF compiled", "greedy agreement"],
                   [[r["batch"], r["specserve"]["tokens_per_s"]["median"], r["specserve"]["decode_tokens_per_s"]["median"],
                     r["specserve"]["decode_ms_per_step"], d["floor_ms_per_step"], f"{r['fraction_of_floor']:.1%}",
                     r["transformers"]["tokens_per_s"]["median"], r["transformers"]["specserve_speedup"], *compiled(r),
                     f"{r['agreement']['fraction']:.0%}"] for r in d["batches"]])] + _md_logits_gap(d)


def _md_logits_gap(d: dict) -> list[str]:
    gaps = [(r["batch"], r["prefill_logits"]) for r in d["batches"] if "prefill_logits" in r]
    if not gaps:
        return []
    batch, g = gaps[0]
    return [f"Same weights, same prompt (batch {batch}'s first, {g['rows']} rows), both stacks eager: logits relative "
            f"gap ‖ours − transformers‖ / ‖transformers‖ = {g['relative_gap']:.2g}; argmax the same at "
            f"{g['top1_same']:.0%} of rows; transformers' median top-1 − top-2 margin {g['median_top1_margin']:.3g} vs "
            f"our median gap at that token {g['median_gap_at_top1']:.3g} (where the margin is smaller than the "
            "gap, two correct stacks pick different tokens: what greedy agreement measures on random weights)."]


def _md_verify(d: dict) -> list[str]:
    return ["## 2. Verify cost vs tree size",
            f"{d['timed']}; {d['tree']} trees after {d['prefix_tokens']} cached tokens; median of {d['repeats']}. "
            f"ratio = time ÷ the 0-node step at the same batch. CUDA graphs: {d['cuda_graphs']} "
            f"({d['graph_replays']} replays).",
            _table(["batch", "nodes", "rows", "ms", "ratio"],
                   [[r["batch"], r["nodes"], r["rows"], r["ms"], r["ratio"]] for r in d["rows"]])]


def _md_head(d: dict) -> list[str]:
    return ["## 3. EAGLE-3 head cost per draft level",
            f"Batch 1, top-k {d['topk']}, draft vocabulary {d['head']['draft_vocab']}, after {d['prefix_tokens']} "
            "cached pairs: a level (top-k frontier nodes) and a catch-up (the root pair, three target features "
            "fused) are forward + logits + the copy to the host the tree builder reads (tree building excluded); "
            "ratio = time ÷ a plain target forward at batch 1. CUDA graphs: "
            f"target {d['cuda_graphs']['target']}, head {d['cuda_graphs']['head']}.",
            _table(["what", "ms", "ratio"],
                   [[name, d[name]["ms"], d[name]["ratio"]] for name in ("plain_target_step", "head_catch_up", "head_level")])]


def _md_drafters(d: dict) -> list[str]:
    return ["## 4. Drafters end to end (embedded model)",
            f"`specserve eval` machinery on {d['dataset']}: {d['prompts']} prompts × {d['max_tokens']} tokens, batch 1, "
            f"median of {d.get('repeats', 1)} passes, "
            f"greedy, {d['speculation']} speculation; plain decoding {d['plain_tokens_per_s']:.1f} tok/s.",
            _table(["drafter", "τ", "speedup", "tok/s", "identical to plain"],
                   [[r["drafter"], r["tau"], r["speedup"], r["tokens_per_s"], r["identical_fraction"]]
                    for r in d["drafters"]])]


def _md_projection(d: dict) -> list[str]:
    return ["## 5. Projection (not a measurement)",
            f"speedup ≈ {d['formula']} at batch {d['batch']}, from sections 2 and 3. The head cost is charged to every τ "
            "as if an EAGLE-3 head drafted it; acceptance and tree building on the host are ignored.",
            _table(["τ from", "τ", "nodes", "levels", "verify ratio", "head ratio", "projected speedup"],
                   [[r["tau_from"], r["tau"], r["nodes"], r["levels"], r["verify_ratio"], r["head_ratio"],
                     r["projected_speedup"]] for r in d["rows"]])]


RENDERERS = {1: _md_decode, 2: _md_verify, 3: _md_head, 4: _md_drafters, 5: _md_projection}


def markdown(result: dict) -> str:
    """Every section that ran as a markdown table, each with what was timed and how."""
    m = result["meta"]
    parts = [f"# specserve bench gpu — {m['device_name']}, {m['date']}",
             f"{m['shape']} random-weight Llama ({m['dtype']}), attention {m['attention']}, CUDA graphs "
             f"{m['cuda_graphs']}, {m['wall_s']:.0f} s in all; torch {m['torch']}, triton {m['triton']}, "
             f"transformers {m['transformers']}."]
    for number, render in RENDERERS.items():
        if (body := result["sections"].get(SECTION_NAMES[number])) is not None:
            parts += render(body)
    return "\n\n".join(parts) + "\n"


def run(args: argparse.Namespace) -> int:
    s = check_args(args)  # raises before anything is built: no CUDA, bad options
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    models = build_models(s) if any(n in s.sections for n in (1, 2, 3)) else None
    result = {"meta": meta(s), "sections": {}}
    sections = result["sections"]

    def timed_section(number: int, fn) -> None:
        """Run one section, then rewrite the outputs: a run cut short keeps every finished section."""
        t0 = time.perf_counter()
        body = fn()  # None: the function filled in an existing section (compiled_decode)
        name = SECTION_NAMES[number]
        if body is not None:
            sections[name] = body
        sections[name]["wall_s"] = sections[name].get("wall_s", 0.0) + time.perf_counter() - t0
        result["meta"]["wall_s"] = time.perf_counter() - started
        _write(result, args)

    decode_cases: list[DecodeCase] = []

    def section_1() -> dict:
        body, cases = plain_decode(s, models, gen)
        decode_cases.extend(cases)
        return body

    steps = {1: section_1, 2: lambda: verify_cost(s, models.ours, gen), 3: lambda: head_cost(s, models.ours, gen),
             4: lambda: drafters_e2e(s)}
    for number in s.sections:
        if number in steps:
            timed_section(number, steps[number])
    if decode_cases:  # compiling takes minutes: last, in the time left
        timed_section(1, lambda: compiled_decode(s, models, sections[SECTION_NAMES[1]], decode_cases))
    if 5 in s.sections:
        timed_section(5, lambda: projection(s, sections))
    print(markdown(result))
    return 0


def _write(result: dict, args: argparse.Namespace) -> None:
    """--json and --markdown, rewritten after every section."""
    write_json(result, args.json)
    if args.markdown:
        Path(args.markdown).write_text(markdown(result))
