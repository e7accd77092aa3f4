"""`specserve bench prefill-stall`: how long one long prompt stalls the requests already decoding.

N requests decode (greedy, EOS ignored); once each has produced a few tokens, one long prompt arrives.
Without chunking its whole prefill runs inside one step, and every running request waits for it; with
chunked prefill (`max_prefill_tokens`) it is spread over several steps between their decode steps.
Reported per setting, in one run, alternating: the running requests' worst and p99 inter-token gap
(gap between consecutive steps that gave a request tokens, divided by the tokens it got) around the
long prompt's arrival, their median gap, and the long prompt's time to first token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from specserve.evals.common import set_threads, write_json
from specserve.cli import MODEL_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafter", default="none", help="drafter spec for every request (default: none)")
    p.add_argument("--decoding", type=int, default=8, help="requests decoding when the long prompt arrives")
    p.add_argument("--prompt-tokens", type=int, default=400, help="length of the long prompt")
    p.add_argument("--chunks", default="100000,128,64",
                   help="max_prefill_tokens settings to compare (the first, larger than the prompt, is 'no chunking')")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE")


def _one_run(llm, long_prompt: list[int], short_prompts: list[list[int]]) -> dict:
    from specserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    running = [engine.add_request(p, params) for p in short_prompts]
    last: dict[str, float] = {}
    gaps: list[float] = []
    arrival = None
    long_req = None
    first_token = None
    steps = 0
    while engine.has_unfinished():
        if long_req is None and all(r.num_output >= 4 for r in running):
            long_req = engine.add_request(long_prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            arrival = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        steps += 1
        for d in deltas:
            if long_req is not None and d.request_id == long_req.request_id:
                if first_token is None and d.token_ids:
                    first_token = now - arrival
                continue
            if d.request_id in last and d.token_ids and arrival is not None:
                gaps.append((now - last[d.request_id]) / len(d.token_ids))
            last[d.request_id] = now
    for r in running + [long_req]:
        engine.pop_finished(r.request_id)
    gaps_ms = sorted(g * 1e3 for g in gaps)
    return {"worst_gap_ms": gaps_ms[-1], "p99_gap_ms": gaps_ms[int(0.99 * (len(gaps_ms) - 1))],
            "median_gap_ms": statistics.median(gaps_ms), "long_prompt_ttft_ms": 1e3 * first_token, "steps": steps}


def run(args: argparse.Namespace) -> int:
    from specserve import LLM
    from specserve.evals.datasets import heldout_prompts

    set_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    if not chunks or min(chunks) < 1:
        raise ValueError(f"--chunks must be positive integers, got {args.chunks!r}")
    if args.decoding < 1 or args.repeats < 1:
        raise ValueError("--decoding and --repeats must be >= 1")
    drafter = None if args.drafter == "none" else args.drafter
    llms = {c: LLM(args.model, drafter=drafter, max_prefill_tokens=c, max_num_seqs=args.decoding + 1) for c in chunks}
    any_llm = next(iter(llms.values()))
    context = any_llm.engine.config.max_model_len
    if args.prompt_tokens + 8 > context:
        raise ValueError(f"--prompt-tokens {args.prompt_tokens} + 8 new tokens exceed the context window ({context})")
    text = "\n".join(heldout_prompts(64, 2000))
    ids = any_llm.encode(text)
    if len(ids) < args.prompt_tokens + 64:
        raise ValueError(f"the held-out text has only {len(ids)} tokens")
    long_prompt = ids[: args.prompt_tokens]
    short_prompts = [ids[args.prompt_tokens + 8 * i: args.prompt_tokens + 8 * i + 24] for i in range(args.decoding)]
    for llm in llms.values():  # warm-up: compile and touch everything once
        _one_run(llm, long_prompt, short_prompts[:2])
    results: dict[int, list[dict]] = {c: [] for c in chunks}
    for _ in range(args.repeats):
        for c, llm in llms.items():
            results[c].append(_one_run(llm, long_prompt, short_prompts))
    summary = []
    print(f"one {args.prompt_tokens}-token prompt arriving while {args.decoding} requests decode "
          f"(drafter {args.drafter}, median of {args.repeats})")
    print(f"{'max_prefill_tokens':>18} {'worst gap ms':>13} {'p99 gap ms':>11} {'median gap ms':>14} {'long TTFT ms':>13}")
    for c in chunks:
        row = {k: statistics.median(r[k] for r in results[c]) for k in results[c][0]}
        row["max_prefill_tokens"] = c
        summary.append(row)
        label = f"{c} (no chunks)" if c >= args.prompt_tokens else str(c)
        print(f"{label:>18} {row['worst_gap_ms']:>13.2f} {row['p99_gap_ms']:>11.2f} {row['median_gap_ms']:>14.2f} "
              f"{row['long_prompt_ttft_ms']:>13.2f}")
    write_json({"prompt_tokens": args.prompt_tokens, "decoding": args.decoding, "drafter": args.drafter,
                "repeats": args.repeats, "settings": summary}, args.json)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
