"""`specserve bench openai-features`: what the OpenAI request features cost, in one run, greedy, on
held-out code prompts (evals/datasets.py ``heldout_prompts``). Every comparison runs its two sides on
the same LLM objects in interleaved rounds (which side goes first alternates), so the machine's noise
falls on both alike; figures are medians over rounds.

(a) logprobs — tokens/s with ``SamplingParams(logprobs=k)`` (``--top-logprobs``, default 5) vs none,
    at each batch size (``--batch-sizes``, default 1,8), on the default drafter. Goal: cost <= 5 %.
(b) penalties — the speculative speedup (drafter tokens/s over plain tokens/s) with penalties
    (frequency 0.5 + presence 0.3, on both sides) over the speedup without them, for the draft model
    with static speculation (the goal's figure: >= 90 % kept) and for the default drafter (reported).
(c) n choices — through a real server on loopback (the default drafter, prefix caching on): a streamed
    ``/v1/completions`` request with ``n`` = ``--n`` (default 4), time from sending it to the first
    chunk of each choice, over the same for ``n`` = 1; every request's prompt is new (a numbered first
    line), so each prefills cold. Goal: the last choice's TTFT <= 1.3x one sequence's. For comparison,
    the engine alone with the n requests added at once (``LLM.generate``, the cache cleared before each).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from specserve.cli import MODEL_HELP
from specserve.evals.common import (check_positive, clear_prefix_cache, machine, parse_batch_sizes, set_threads,
                                    write_json)

PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.3}
GOALS = {"logprobs_cost": 0.05, "penalty_speedup_kept": 0.90, "n_ttft_ratio": 1.3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafter", default="auto", help="the default drafter spec (default: auto, the bundle's default)")
    p.add_argument("--batch-sizes", default="1,8", help="batch sizes of (a) (comma-separated)")
    p.add_argument("--top-logprobs", type=int, default=5, help="SamplingParams.logprobs of (a)")
    p.add_argument("--n", type=int, default=4, help="choices of (c)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (one per request of a batch)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per comparison")
    p.add_argument("--no-draft-model", action="store_true", help="(b) without the draft-model drafter")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE")


def _params(max_tokens: int, **kw):
    from specserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _timed(llm, prompts: list[list[int]], params) -> tuple[int, float]:
    """(output tokens, seconds) of one generate call over `prompts` (one batch)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - start


def _interleaved(sides: dict, items: list, rounds: int) -> dict[str, list[float]]:
    """sides: name -> f(item) -> (tokens, seconds). Each round runs every item on every side back to back,
    the sides' order rotating from item to item and round to round; a side's figure for the round is its
    tokens over its seconds. Returns name -> tokens/s per round."""
    names = list(sides)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        totals = {name: [0, 0.0] for name in names}
        for i, item in enumerate(items):
            shift = (r + i) % len(names)
            for name in names[shift:] + names[:shift]:
                tokens, seconds = sides[name](item)
                totals[name][0] += tokens
                totals[name][1] += seconds
        for name in names:
            out[name].append(totals[name][0] / totals[name][1])
    return out


def _logprobs(llm, prompts, batch_sizes: list[int], args) -> list[dict]:
    rows = []
    for batch in batch_sizes:
        # Every prompt, `batch` at a time (at least one full batch).
        chosen = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
        groups = [chosen[i:i + batch] for i in range(0, len(chosen), batch)]
        plain, asked = _params(args.max_tokens), _params(args.max_tokens, logprobs=args.top_logprobs)
        runs = _interleaved({"none": lambda g: _timed(llm, g, plain), "logprobs": lambda g: _timed(llm, g, asked)},
                            groups, args.rounds)
        none, with_lp = statistics.median(runs["none"]), statistics.median(runs["logprobs"])
        rows.append({"batch": batch, "none_tokens_per_s": none, "logprobs_tokens_per_s": with_lp,
                     "cost": 1 - with_lp / none, "runs": runs})
    return rows


def _penalties(plain, spec: dict, prompts, args) -> dict:
    """Batch 1, one prompt after another: tokens/s of each (LLM, penalties on/off) pair, interleaved."""
    sides = {}
    for name, llm in {"plain": plain, **spec}.items():
        for pen in (False, True):
            params = _params(args.max_tokens, **(PENALTIES if pen else {}))
            sides[f"{name}{'+pen' if pen else ''}"] = lambda p, llm=llm, params=params: _timed(llm, [p], params)
    runs = _interleaved(sides, prompts, args.rounds)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {"tokens_per_s": med, "runs": runs, "drafters": {}}
    for name in spec:
        without = med[name] / med["plain"]
        with_pen = med[f"{name}+pen"] / med["plain+pen"]
        out["drafters"][name] = {"speedup": without, "speedup_with_penalties": with_pen, "kept": with_pen / without}
    return out


def _ttft(llm, prompt: list[int], n: int, max_tokens: int) -> tuple[float, float]:
    """(first, last) engine TTFT in ms of n requests of `prompt` added together, from a cleared cache."""
    clear_prefix_cache(llm.engine)
    outs = llm.generate([prompt] * n, _params(max_tokens))
    ttfts = [o.ttft_s * 1e3 for o in outs]
    return min(ttfts), max(ttfts)


def _http_ttft(srv, prompt: str, n: int, max_tokens: int) -> tuple[float, float]:
    """(first, last) client TTFT in ms over the n choices of one streamed /v1/completions request."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    body = json.dumps({"prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"/v1/completions answered {resp.status}: {resp.read()[:300]!r}")
    first: dict[int, float] = {}
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            if choice["index"] not in first and (choice.get("text") or choice.get("finish_reason")):
                first[choice["index"]] = (time.perf_counter() - start) * 1e3
    conn.close()
    if len(first) != n:
        raise RuntimeError(f"expected {n} choices, saw {sorted(first)}")
    return min(first.values()), max(first.values())


def _n_choices(srv, llm, texts: list[str], args) -> dict:
    """Server: n choices vs 1, interleaved; engine alone: n requests added together vs 1."""
    runs = {"1": [], "n": [], "engine 1": [], "engine n": []}
    for r in range(args.rounds):
        for i, text in enumerate(texts):
            for n in ((1, args.n) if (r + i) % 2 == 0 else (args.n, 1)):
                prompt = f"# file {r}-{i}-{n}\n" + text  # new from its first block: nothing cached hits
                runs["1" if n == 1 else "n"].append(_http_ttft(srv, prompt, n, 4))
                runs["engine 1" if n == 1 else "engine n"].append(_ttft(llm, llm.encode(prompt), n, 4))
    med = {key: (statistics.median(f for f, _ in v), statistics.median(last for _, last in v)) for key, v in runs.items()}
    return {"prompt_tokens": [len(llm.encode(t)) for t in texts], "ttft_1_ms": med["1"][1],
            "ttft_n_first_ms": med["n"][0], "ttft_n_last_ms": med["n"][1], "ratio_last": med["n"][1] / med["1"][1],
            "ratio_first": med["n"][0] / med["1"][1], "engine_ttft_1_ms": med["engine 1"][1],
            "engine_ttft_n_last_ms": med["engine n"][1], "engine_ratio_last": med["engine n"][1] / med["engine 1"][1],
            "prefix_caching": llm.engine.prefix_cache is not None, "runs": runs}


def run(args: argparse.Namespace) -> int:
    from specserve import LLM
    from specserve.evals.datasets import heldout_prompts

    set_threads(args.threads)
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    check_positive(args, "prompts", "max_tokens", "rounds", "n")
    if not 0 <= args.top_logprobs <= 20:
        raise ValueError(f"--top-logprobs must be in [0, 20], got {args.top_logprobs}")
    default = LLM(args.model, drafter=args.drafter)
    plain = LLM(args.model, drafter=None)
    spec = {}
    if not args.no_draft_model:
        spec["draft (static)"] = LLM(args.model, drafter="draft", speculation="static")
    spec[f"{args.drafter} (default)"] = default
    texts = heldout_prompts(args.prompts, 400)
    prompts = [default.encode(t) for t in texts]
    for llm in {id(x): x for x in (default, plain, *spec.values())}.values():  # warm-up: compile every path once
        llm.generate([prompts[0]], _params(4, logprobs=args.top_logprobs, **PENALTIES))
        llm.generate([prompts[0]], _params(4))
    result = {"top_logprobs": args.top_logprobs, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "prompts": args.prompts, "penalties": PENALTIES, "n": args.n}
    result["a_logprobs"] = _logprobs(default, prompts, batch_sizes, args)
    result["b_penalties"] = _penalties(plain, spec, prompts, args)
    from specserve.server import BackgroundServer, ServerConfig

    served = LLM(args.model, drafter=args.drafter)  # the server's engine thread owns it once started
    served.generate([prompts[0]], _params(4))
    with BackgroundServer(served, ServerConfig(port=0, threads=args.threads)) as srv:
        _http_ttft(srv, texts[0], args.n, 4)  # warm-up
        result["c_n"] = _n_choices(srv, default, texts, args)
    result["machine"] = machine(default)
    result["verdicts"] = _verdicts(result)
    _print(result, args)
    write_json(result, args.json)
    return 0


def _verdicts(r: dict) -> dict:
    out = {f"a batch {row['batch']}": row["cost"] <= GOALS["logprobs_cost"] for row in r["a_logprobs"]}
    drafters = r["b_penalties"]["drafters"]
    goal_drafter = "draft (static)" if "draft (static)" in drafters else next(iter(drafters))
    out["b " + goal_drafter] = drafters[goal_drafter]["kept"] >= GOALS["penalty_speedup_kept"]
    out["c"] = r["c_n"]["ratio_last"] <= GOALS["n_ttft_ratio"]
    return out


def _print(r: dict, args) -> None:
    v = r["verdicts"]
    ok = {True: "met", False: "NOT met"}
    print(f"OpenAI features' cost (greedy, {args.prompts} held-out prompts, {args.max_tokens} tokens each, "
          f"median of {args.rounds} interleaved rounds, threads {r['machine']['threads']})")
    print(f"{'goal':<46} {'without':>12} {'with':>12} {'figure':>10}  verdict")
    for row in r["a_logprobs"]:
        print(f"{'(a) logprobs=' + str(args.top_logprobs) + ' batch ' + str(row['batch']) + ' tok/s, cost <= 5 %':<46} "
              f"{row['none_tokens_per_s']:>12.1f} {row['logprobs_tokens_per_s']:>12.1f} {100 * row['cost']:>9.1f}%  "
              f"{ok[v['a batch ' + str(row['batch'])]]}")
    b = r["b_penalties"]
    t = b["tokens_per_s"]
    print(f"{'    plain decoding tok/s (batch 1)':<46} {t['plain']:>12.1f} {t['plain+pen']:>12.1f}")
    for name, d in b["drafters"].items():
        key = "b " + name
        verdict = ok[v[key]] if key in v else "(reported)"
        print(f"{'    ' + name + ' tok/s':<46} {t[name]:>12.1f} {t[name + '+pen']:>12.1f}")
        print(f"{'(b) ' + name + ' speedup kept >= 90 %':<46} {d['speedup']:>11.2f}x {d['speedup_with_penalties']:>11.2f}x "
              f"{100 * d['kept']:>9.1f}%  {verdict}")
    c = r["c_n"]
    print(f"{'(c) n=' + str(args.n) + ' TTFT ms (1 vs last of n) <= 1.3x':<46} {c['ttft_1_ms']:>12.1f} "
          f"{c['ttft_n_last_ms']:>12.1f} {c['ratio_last']:>9.2f}x  {ok[v['c']]}")
    print(f"{'    first of the n choices':<46} {'':>12} {c['ttft_n_first_ms']:>12.1f} {c['ratio_first']:>9.2f}x")
    print(f"{'    engine alone, n requests added at once':<46} {c['engine_ttft_1_ms']:>12.1f} "
          f"{c['engine_ttft_n_last_ms']:>12.1f} {c['engine_ratio_last']:>9.2f}x  (for comparison)")
    print(f"    server on loopback, streamed /v1/completions, client TTFT; prompts {min(c['prompt_tokens'])}-"
          f"{max(c['prompt_tokens'])} tokens, each new; prefix caching {'on' if c['prefix_caching'] else 'off'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
