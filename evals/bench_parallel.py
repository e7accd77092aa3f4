"""`specserve bench parallel`: more than one device — tensor parallelism and data-parallel replicas.

1. Tensor parallelism: plain greedy decoding of the same prompts at batch 1 and 8 with the target on one
   rank and split over `--tp` ranks (gloo processes on the CPU, one GPU each on CUDA), alternated
   `--repeats` times. Both run the torch layers (the path the ranks run; the CPU kernels do not split a
   layer) with the same cores in all: one device gets `--tp` torch threads, each rank one. The CPU
   kernels' single-device figure is printed beside them for honesty: it is what specserve runs on one
   device by default. "collectives" is the share of rank 0's wall time inside the all-reduces and the
   logit gather, waiting for the slower rank included.
2. Replicas: `specserve serve --replicas N` for each N in `--replicas`, one engine thread per replica,
   `--concurrency` websocket clients sending greedy requests back to back (bench serve's clients):
   aggregate output tokens/s and TTFT / inter-token latency, on the embedded model (`--replicas-model`).

Model of part 1: the ~110M random Llama `bench decode` builds (12 layers, 12 heads: TP 2, 3, 4 and 6
split it), or `--model`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specserve.evals.common import host, set_threads, use_model_dir, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the ~110M random Llama of bench decode)")
    p.add_argument("--sections", default="tp,replicas", help="comma-separated: tp, replicas")
    p.add_argument("--tp", type=int, default=2, help="ranks of the tensor-parallel run (default 2)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--replicas", default="1,2", help="comma-separated replica counts (default 1,2)")
    p.add_argument("--replicas-model", default="embedded",
                   help="model the replicas serve: 'embedded' (default: the bundled model, with its tokenizer, so "
                        "text streams token by token) or a directory")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0, help="seconds per replica count at most")
    p.add_argument("--requests", type=int, default=16, help="measured requests per client")
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--json", default=None, metavar="FILE")


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} expects comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} must be integers >= 1, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    import torch

    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not sections or sections - {"tp", "replicas"}:
        raise ValueError(f"--sections takes tp and/or replicas, got {args.sections!r}")
    batch_sizes = _ints(args.batch_sizes, "batch-sizes")
    replica_counts = _ints(args.replicas, "replicas")
    for name in ("tp", "new_tokens", "prompt_tokens", "repeats", "concurrency", "requests", "max_output_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from specserve.evals.bench_decode import build_random_llama

    figures: dict = {"machine": host() | {"torch": torch.__version__}, "date": time.strftime("%Y-%m-%d")}
    if "tp" in sections:
        with use_model_dir(args.model, build_random_llama, "a random ~110M Llama") as path:
            figures["tensor_parallel"] = measure_tp(path, args, batch_sizes)
            figures["tensor_parallel"]["model"] = str(args.model or "random ~110M Llama (12 layers, hidden 768, "
                                                                   "12 heads, 32k vocab)")
    if "replicas" in sections:
        model = args.replicas_model
        if model == "embedded":
            from specserve.bundle_paths import default_model_dir

            model = default_model_dir()
            if model is None:
                raise ValueError("--replicas-model embedded: no embedded default model is installed")
        figures["replicas"] = measure_replicas(Path(model), args, replica_counts)
        figures["replicas"]["model"] = args.replicas_model
    write_json(figures, args.json)
    return 0


# ---- tensor parallelism --------------------------------------------------------------------------


def measure_tp(model_dir: Path, args, batch_sizes: list[int]) -> dict:
    import torch

    from specserve import LLM, SamplingParams

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(max(batch_sizes))]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    cores = args.tp
    runs = {  # name -> (LLM, torch threads while it runs)
        "kernels, 1 device": (LLM(model_dir, drafter=None, threads=cores, max_num_seqs=max(batch_sizes)), cores),
        "torch layers, 1 device": (LLM(model_dir, drafter=None, attention="sdpa", threads=cores,
                                       max_num_seqs=max(batch_sizes)), cores),
        f"torch layers, TP={args.tp}": (LLM(model_dir, drafter=None, tensor_parallel_size=args.tp, threads=1,
                                            max_num_seqs=max(batch_sizes)), 1),
    }
    tp_llm = runs[f"torch layers, TP={args.tp}"][0]
    results = {}
    try:
        outputs = {}
        for batch in batch_sizes:
            times = {name: [] for name in runs}
            shares = []
            for _ in range(args.repeats + 1):  # the first round warms up
                for name, (llm, threads) in runs.items():
                    set_threads(threads)  # the CPU kernels' threads are process-wide: set them for each run
                    torch.set_num_threads(threads)
                    tp = llm.tensor_parallel
                    if tp is not None:
                        tp.collective_s = 0.0
                    start = time.perf_counter()
                    out = llm.generate(prompts[:batch], params)
                    elapsed = time.perf_counter() - start
                    times[name].append(elapsed)
                    if tp is not None:
                        shares.append(tp.collective_s / elapsed)
                    outputs[(name, batch)] = [o.token_ids for o in out]
            tokens = batch * args.new_tokens
            row = {name: {"tokens_per_s": round(tokens / statistics.median(t[1:]), 1),
                          "spread": [round(tokens / max(t[1:]), 1), round(tokens / min(t[1:]), 1)]}
                   for name, t in times.items()}
            row[f"torch layers, TP={args.tp}"]["collective_share"] = round(statistics.median(shares[1:]), 3)
            one = outputs[("torch layers, 1 device", batch)]
            row["tp_greedy_equals_one_device"] = outputs[(f"torch layers, TP={args.tp}", batch)] == one
            results[f"batch {batch}"] = row
            _print_tp(batch, row)
    finally:
        tp_llm.close()
    return {"ranks": args.tp, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats, "by_batch": results}


def _print_tp(batch: int, row: dict) -> None:
    print(f"tensor parallelism, batch {batch} (decode tokens/s, median [min, max]):")
    for name, r in row.items():
        if isinstance(r, dict):
            share = f"   collectives {r['collective_share']:.0%} of rank 0's time" if "collective_share" in r else ""
            print(f"  {name:26s} {r['tokens_per_s']:8.1f}  {r['spread']}{share}")
    print(f"  TP greedy output == one device: {row['tp_greedy_equals_one_device']}", flush=True)


# ---- replicas ------------------------------------------------------------------------------------


def measure_replicas(model_dir: Path, args, counts: list[int]) -> dict:
    from specserve.evals.bench_serve import run_level, start_server

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    out = []
    for n in counts:
        serve_args = argparse.Namespace(threads=1, device="cpu", drafter=None, replicas=n, warmup=1,
                                        requests=args.requests, duration=args.duration, prompt_tokens=16,
                                        max_output_tokens=args.max_output_tokens)
        proc, url = start_server(model_dir, serve_args, args.concurrency)
        try:
            level = asyncio.run(run_level(url, args.concurrency, vocab, serve_args, "websocket"))
        finally:
            proc.terminate()
            proc.wait(60)
        row = {"replicas": n, "concurrency": args.concurrency, "requests": level["requests"],
               "aggregate_tokens_per_s": round(level["aggregate_tokens_per_s"], 1), "ttft_ms": level["ttft_ms"],
               "itl_ms": level["itl_ms"]}
        out.append(row)
        print(f"replicas {n}, {args.concurrency} websocket clients: {row['aggregate_tokens_per_s']:.1f} tokens/s, "
              f"TTFT p50/p99 {row['ttft_ms']['p50']}/{row['ttft_ms']['p99']} ms, "
              f"ITL p50/p99 {row['itl_ms']['p50']}/{row['itl_ms']['p99']} ms", flush=True)
    return {"by_replicas": out}
