"""`specserve bench batch`: decode throughput against batch size.

For each batch size B, B prompts of --prompt-tokens random token ids run as one `generate` batch
(greedy, EOS ignored). Each timed run is paired with a prefill-only run (max_tokens=1) of the same
prompts, so the decode rate excludes prefill: decode tokens/s = B·(T−1) / (t_T − t_1). Sizes are
measured interleaved, --repeats times each, after a warm-up; figures are medians [min–max].
Plain decoding by default; --drafter measures a drafter the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specserve.evals.common import model_label, parse_batch_sizes, set_threads, sync, write_json
from specserve.cli import MODEL_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafter", default=None, help="drafter spec (default: plain decoding)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16", help="comma-separated batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE")


def run(args: argparse.Namespace) -> int:
    import torch

    from specserve import LLM, SamplingParams

    sizes = parse_batch_sizes(args.batch_sizes)
    for name in ("repeats", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2 (one token comes from prefill), got {args.max_tokens}")
    set_threads(args.threads)
    llm = LLM(args.model, drafter=args.drafter, device=args.device, max_num_seqs=sizes[-1])
    if args.prompt_tokens + args.max_tokens > llm.engine.config.max_model_len:
        raise ValueError(f"--prompt-tokens + --max-tokens exceed the context window ({llm.engine.config.max_model_len})")
    gen = torch.Generator().manual_seed(0)
    vocab = llm.model.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(sizes[-1])]
    device = llm.device

    def timed(batch: int, max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sync(device)
        t0 = time.perf_counter()
        llm.generate(prompts[:batch], params)
        sync(device)
        return time.perf_counter() - t0

    for b in sizes:  # warm-up
        timed(b, 4)
    full: dict[int, list[float]] = {b: [] for b in sizes}
    prefill: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(args.repeats):
        for b in sizes:
            prefill[b].append(timed(b, 1))
            full[b].append(timed(b, args.max_tokens))
    rows = []
    t = args.max_tokens
    for b in sizes:
        decode = [b * (t - 1) / max(f - p, 1e-9) for f, p in zip(full[b], prefill[b])]
        overall = [b * t / f for f in full[b]]
        rows.append({
            "batch": b,
            "decode_tokens_per_s": statistics.median(decode), "decode_min": min(decode), "decode_max": max(decode),
            "decode_tokens_per_s_per_request": statistics.median(decode) / b,
            "tokens_per_s_with_prefill": statistics.median(overall),
        })
    base = rows[0]["decode_tokens_per_s"]
    for r in rows:
        r["relative_to_smallest"] = r["decode_tokens_per_s"] / base
    result = {"model": model_label(args.model), "drafter": args.drafter,
              "prompt_tokens": args.prompt_tokens, "max_tokens": t, "repeats": args.repeats, "device": str(device), "dtype": str(llm.dtype),
              "threads": torch.get_num_threads(), "batches": rows}
    print(f"throughput vs batch size ({args.drafter or 'plain'} decoding, prompt {args.prompt_tokens}, "
          f"{t} new tokens, {device}, {torch.get_num_threads()} threads)")
    head = f"x B={sizes[0]}"
    print(f"{'batch':>6} {'decode tok/s':>13} {'min-max':>17} {'per request':>12} {'with prefill':>13} {head:>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['decode_tokens_per_s']:>13.1f} {r['decode_min']:>8.1f}-{r['decode_max']:<8.1f} "
              f"{r['decode_tokens_per_s_per_request']:>12.1f} {r['tokens_per_s_with_prefill']:>13.1f} {r['relative_to_smallest']:>7.2f}")
    write_json(result, args.json)
    return 0
