"""`specserve bench quantization`: how close int8 or int4 weights (llama.cpp's Q8_0 / Q4_0, with 8-bit
activations) keep a model to its float self, on held-out text.

Per held-out prompt (the embedded model's held-out code by default, tokenized by the model's tokenizer),
the quantized model and the float32 model (the same checkpoint, unquantized) each run:
- one prefill forward returning the logits of every prompt row: the relative gap per row
  (‖quantized − float‖ / ‖float‖; median and 95th percentile over all rows) and how often the argmax agrees;
- a greedy continuation of --max-tokens: identical or not, and the common prefix's length.

A quantized model is a different model (speculation stays lossless against it, not against the float one);
these figures say how different. Plain decoding only; the speed side is `specserve bench decode
--quantization int8|int4`.
"""

from __future__ import annotations

import argparse
import statistics

from specserve.defaults import QUANTIZATIONS
from specserve.evals.common import check_positive, first_divergence, host, set_threads, write_json
from specserve.cli import MODEL_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="int8")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy continuation length (default 64)")
    p.add_argument("--threads", type=int, default=None, help="CPU kernel threads (default: every core)")
    p.add_argument("--json", default=None, metavar="FILE")


def _prompt_logits(llm, prompt: list[int]):
    """float64[len(prompt), vocab]: the logits of every prompt row, one prefill forward."""
    import numpy as np

    from specserve.kv_cache import BlockAllocator
    from specserve.step_batch import StepBatchBuilder

    block = 16
    allocator = BlockAllocator(len(prompt) // block + 2, block)
    allocator.allocate("q", len(prompt))
    builder = StepBatchBuilder(allocator)
    builder.add("q", 0, np.asarray(prompt), logits="all")
    return llm.model.forward(builder.build(), llm.model.new_cache(allocator)).logits.double()


def measure(args: argparse.Namespace) -> dict:
    import torch

    from specserve import LLM, SamplingParams
    from specserve.evals.datasets import heldout_prompts

    model = args.model
    reference = LLM(model, drafter=None, device="cpu", dtype="float32", max_num_seqs=1)
    quantized = LLM(model, drafter=None, device="cpu", quantization=args.quantization, max_num_seqs=1)
    window = reference.model.config.max_position_embeddings
    if args.max_tokens >= window:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's {window}-token window")
    texts = heldout_prompts(args.prompts)
    prompts = [reference.tokenizer.encode(text)[: window - args.max_tokens] for text in texts]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    gaps: list[float] = []
    argmax_same = rows = identical = 0
    prefixes: list[int] = []
    for prompt in prompts:
        ref, got = _prompt_logits(reference, prompt), _prompt_logits(quantized, prompt)
        gaps += ((got - ref).norm(dim=1) / ref.norm(dim=1)).tolist()
        argmax_same += int((got.argmax(dim=1) == ref.argmax(dim=1)).sum())
        rows += len(prompt)
        ours = quantized.generate([prompt], greedy)[0].token_ids
        theirs = reference.generate([prompt], greedy)[0].token_ids
        first = first_divergence(ours, theirs)
        identical += first is None
        prefixes.append(len(ours) if first is None else first)
    gaps.sort()
    return {
        "machine": host() | {"torch": torch.__version__},
        "model": {"dir": str(model or "embedded"), "params": reference.model.config.num_params,
                  "float_bytes_per_token": reference.model.bytes_read_per_token(),
                  "quantized_bytes_per_token": quantized.model.bytes_read_per_token()},
        "settings": {"quantization": args.quantization, "prompts": len(prompts), "max_tokens": args.max_tokens,
                     "prompt_rows": rows},
        "logits_relative_gap": {"median": statistics.median(gaps), "p95": gaps[int(0.95 * (len(gaps) - 1))],
                                "max": gaps[-1]},
        "argmax_agreement": argmax_same / rows,
        "greedy_identical": identical,
        "greedy_mean_common_prefix": statistics.mean(prefixes),
    }


def report(result: dict) -> str:
    s, gap = result["settings"], result["logits_relative_gap"]
    return "\n".join([
        f"{s['quantization']} vs float32, {s['prompts']} held-out prompts ({s['prompt_rows']} prompt rows), "
        f"model {result['model']['dir']}",
        f"  logits relative gap per row: median {gap['median']:.2%}, p95 {gap['p95']:.2%}, max {gap['max']:.2%}",
        f"  argmax agrees on {result['argmax_agreement']:.1%} of rows",
        f"  greedy {s['max_tokens']}-token continuations identical on {result['greedy_identical']}/{s['prompts']} "
        f"prompts, mean common prefix {result['greedy_mean_common_prefix']:.1f} tokens",
    ])


def run(args: argparse.Namespace) -> int:
    check_positive(args, "prompts", "max_tokens")
    set_threads(args.threads)
    result = measure(args)
    print(report(result))
    write_json(result, args.json)
    return 0
