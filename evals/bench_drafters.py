"""`specserve bench drafters`: τ and speed of drafters against plain decoding on held-out code.

Prompts are windows of the default model's held-out modules (never seen in training), each ending
just after a top-level `def` line (`specserve.evals.datasets.heldout_prompts`). For each repeat,
plain decoding and every drafter run the same prompts one at a time (batch 1, greedy, EOS ignored),
interleaved, after a warm-up; outputs must be identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from specserve.evals.common import forget_shared, set_threads, write_json
from specserve.evals.metrics import SpecCounts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--drafter", action="append", default=None, help="drafter spec (repeatable; default: draft, ngram)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE")


def run(args: argparse.Namespace) -> int:
    import torch

    from specserve import LLM, SamplingParams
    from specserve.evals.datasets import heldout_prompts

    set_threads(args.threads)
    specs = args.drafter or ["draft", "ngram"]
    prompts = heldout_prompts(args.prompts, args.prompt_chars)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llms = {"plain": LLM(args.model, drafter=None)} | {spec: LLM(args.model, drafter=spec) for spec in specs}
    for llm in llms.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    rates: dict[str, list[float]] = {name: [] for name in llms}
    stats: dict[str, list] = {name: [] for name in llms}
    outputs: dict[str, list] = {name: [] for name in llms}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            forget_shared(llm)
            t0 = time.perf_counter()
            outs = [llm.generate([p], params)[0] for p in prompts]
            rates[name].append(len(prompts) * args.max_tokens / (time.perf_counter() - t0))
            stats[name] = [o.spec for o in outs]
            outputs[name] = [o.token_ids for o in outs]
    plain_rate = statistics.median(rates["plain"])
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "plain_tokens_per_s": plain_rate, "drafters": {}}
    for name in specs:
        counts = SpecCounts.total(stats[name])
        result["drafters"][name] = {
            "tokens_per_s": statistics.median(rates[name]),
            "speedup": statistics.median(rates[name]) / plain_rate,
            "tau": counts.tau,
            "acceptance_per_position": counts.acceptance_per_position,
            "identical_to_plain": outputs[name] == outputs["plain"],
        }
    print(json.dumps(result, indent=2))
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
