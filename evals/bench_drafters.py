"""`specserve bench drafters`: τ and speed of drafters against plain decoding on held-out prompts.

Prompts are windows of the tiny model's held-out modules (never seen in training), each ending just
after a top-level `def` line (`specserve.evals.datasets.heldout_prompts`); with ``--chat``, chat questions
about the standard library's held-out modules in the target's chat template (`heldout_chat_prompts`: the
split `train feature-data` never trains on). For each repeat, plain decoding and every drafter run the
same prompts one at a time (batch 1, greedy, EOS ignored), interleaved, after a warm-up, each run from a
cold prefix cache (`common.start_cold`: every prompt's prefill is timed); outputs must be identical.
``--peer llama.cpp`` / ``llama.cpp-prompt-lookup`` run llama.cpp on the same GGUF file (plain, and with its
own prompt-lookup speculative decoding) in the same loop, with the kernels' thread count.

**Roofline.** One more pass, after the timed ones, runs each system with a `KernelClock`: the seconds
spent inside model forwards — the target's and the drafter's own models or heads — at the shapes the
run really had (verify trees, catch-ups, draft levels, prefill). If the stack's host work (scheduling,
batch building, tree building, acceptance, emission) cost nothing, a run would take its forwards' time,
so the speedup the kernels allow is plain's forward seconds over the drafter's, for the same prompts
and tokens (τ is inside it: fewer, wider target forwards); `efficiency` = measured speedup ÷ that
roofline. A forward's own Python (embedding gather, rotary tables, the kernel calls) counts as kernel
time here, as in the cost curves BENCHMARKS.md quotes. On CUDA the clock synchronises after every
forward, which is why it runs in a pass of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from specserve.defaults import QUANTIZATIONS
from specserve.evals.common import set_threads, start_cold, sync, write_json
from specserve.evals.metrics import SpecCounts
from specserve.cli import MODEL_HELP
from specserve.training.chat_prompts import KINDS as CHAT_KINDS


class KernelClock:
    """Seconds spent inside the forwards of an `LLM`'s target and drafter (`bench_overhead.forward_targets`:
    the target, a draft model, an EAGLE head's layers, fusion and LM head; a hybrid's parts'), plus Medusa's
    heads, counted by wrapping their entry points on the instances."""

    def __init__(self, llm) -> None:
        from specserve.evals.bench_overhead import forward_targets

        self.seconds = 0.0
        self.device = llm.device
        for owner, name in forward_targets(llm):
            setattr(owner, name, self.timed(getattr(owner, name)))
        drafter = llm.engine.drafter
        for part in ([drafter, *getattr(drafter, "parts", [])] if drafter is not None else []):
            if getattr(part, "heads", None) is None:
                continue
            if getattr(part, "kernels", None) is not None:
                part.kernels = _Timed(part.kernels, self)  # Medusa's heads on the CPU kernels
            else:
                part.heads.forward = self.timed(part.heads.forward)

    def timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.seconds += time.perf_counter() - t0
            return out
        return call


class _Timed:
    """A callable object (Medusa's `_HeadKernels`) whose calls the clock counts; attributes pass through."""

    def __init__(self, inner, clock: KernelClock) -> None:
        self._inner, self._call = inner, clock.timed(inner.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafter", action="append", default=None, help="drafter spec (repeatable; default: draft, ngram)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="the target's weights (int8 / int4, CPU kernels; a draft model follows, heads do not)")
    p.add_argument("--speculation", choices=("adaptive", "static"), default="adaptive",
                   help="adaptive (default: what users get) or static (every step at the drafter's own budget)")
    p.add_argument("--chat", action="store_true",
                   help="held-out chat questions in the target's chat template instead of code prefixes")
    p.add_argument("--chat-kind", action="append", default=None, choices=CHAT_KINDS,
                   help="with --chat, only this kind of question (repeatable; default: all four, mixed): 'edit' "
                        "answers copy the prompt's code, what prompt lookup and n-gram drafting are for")
    p.add_argument("--peer", action="append", default=None, choices=LLAMA_PEERS,
                   help="llama.cpp on the same GGUF file in the same loop: plain, or with its prompt-lookup drafting "
                        "(repeatable; needs llama-cpp-python)")
    p.add_argument("--json", default=None, metavar="FILE")


LLAMA_PEERS = ("llama.cpp", "llama.cpp-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10  # llama-cpp-python's own example drafts 10 (our n-gram drafter's default budget is 8)


def _check_peer_target(model):
    """The target's GGUF file, which the llama.cpp peers run too; ValueError for another target or no llama.cpp."""
    from specserve.evals import llamacpp_peer
    from specserve.loading import resolve_model
    from specserve.loading.gguf_file import is_gguf

    path = resolve_model(model)
    if not is_gguf(path):
        raise ValueError("--peer runs llama.cpp on the same file: the target must be a GGUF file")
    reason = llamacpp_peer.locate(None, path)
    if isinstance(reason, llamacpp_peer.PeerUnavailable):
        raise ValueError(f"--peer: {reason}")
    return path


def _llama_peers(names: list[str], model, threads: int, n_ctx: int) -> dict:
    """One `llamacpp_peer.LlamaCpp` per peer name, on the target's own GGUF file."""
    from specserve.evals import llamacpp_peer

    if not names:
        return {}
    path = _check_peer_target(model)
    return {name: llamacpp_peer.LlamaCpp(path, threads, n_ctx,
                                          prompt_lookup=PROMPT_LOOKUP_TOKENS if name.endswith("prompt-lookup") else 0)
            for name in names}


def run(args: argparse.Namespace) -> int:
    import torch

    from specserve import LLM, SamplingParams
    from specserve.evals.datasets import heldout_chat_prompts, heldout_prompts

    set_threads(args.threads)
    if args.chat_kind and not args.chat:
        raise ValueError("--chat-kind picks among chat questions: add --chat")
    if args.peer:
        _check_peer_target(args.model)  # before anything loads
    specs = args.drafter or ["draft", "ngram"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    target = dict(quantization=args.quantization)
    llms = {"plain": LLM(args.model, drafter=None, **target)} | {
        spec: LLM(args.model, drafter=spec, speculation=args.speculation, **target) for spec in specs}
    if args.chat:
        prompts = heldout_chat_prompts(llms["plain"].tokenizer, args.prompts, kinds=args.chat_kind)
    else:
        prompts = heldout_prompts(args.prompts, args.prompt_chars)
    prompt_ids = [llms["plain"].encode(p) for p in prompts]  # what the llama.cpp peers are given
    n_ctx = max(map(len, prompt_ids)) + args.max_tokens + 16
    peers = _llama_peers(list(dict.fromkeys(args.peer or [])), args.model, torch.get_num_threads(), n_ctx)
    for llm in llms.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    names = [*llms, *peers]
    rates: dict[str, list[float]] = {name: [] for name in names}
    stats: dict[str, list] = {name: [] for name in llms}
    outputs: dict[str, list] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            start_cold(llm)
            t0 = time.perf_counter()
            outs = [llm.generate([p], params)[0] for p in prompts]
            rates[name].append(len(prompts) * args.max_tokens / (time.perf_counter() - t0))
            stats[name] = [o.spec for o in outs]
            outputs[name] = [o.token_ids for o in outs]
        for name, peer in peers.items():
            t0 = time.perf_counter()
            outputs[name] = [peer.generate(p, args.max_tokens) for p in prompt_ids]
            rates[name].append(len(prompts) * args.max_tokens / (time.perf_counter() - t0))
    kernel_s = {}
    for name, llm in llms.items():  # the roofline pass (see the module docstring)
        clock = KernelClock(llm)
        start_cold(llm)
        for p in prompts:
            llm.generate([p], params)
        kernel_s[name] = clock.seconds
    plain_rate = statistics.median(rates["plain"])
    result = {"prompts": len(prompts), "prompt_set": "chat" if args.chat else "code",
              "chat_kinds": args.chat_kind, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "threads": torch.get_num_threads(), "speculation": args.speculation,
              "quantization": args.quantization, "plain_tokens_per_s": plain_rate,
              "plain_kernel_s": kernel_s["plain"], "drafters": {}, "peers": {}}
    for name in peers:
        rate = statistics.median(rates[name])
        same = sum(a == b for a, b in zip(outputs[name], outputs["plain"]))
        result["peers"][name] = {"tokens_per_s": rate, "plain_over_peer": plain_rate / rate,
                                 "prompts_greedy_equal_to_plain": same}
    for name in specs:
        counts = SpecCounts.total(stats[name])
        speedup = statistics.median(rates[name]) / plain_rate
        roofline = kernel_s["plain"] / kernel_s[name]
        result["drafters"][name] = {
            "tokens_per_s": statistics.median(rates[name]),
            "speedup": speedup,
            "roofline_speedup": roofline,
            "efficiency": speedup / roofline,
            "kernel_s": kernel_s[name],
            "tau": counts.tau,
            "acceptance_per_position": counts.acceptance_per_position,
            "identical_to_plain": outputs[name] == outputs["plain"],
        }
    print(json.dumps(result, indent=2))
    print(f"\n{'drafter':24s} {'tau':>5s} {'speedup':>8s} {'roofline':>9s} {'efficiency':>10s}  (plain "
          f"{plain_rate:.0f} tok/s, {args.speculation} speculation{', ' + args.quantization if args.quantization else ''})")
    for name, d in result["drafters"].items():
        print(f"{name:24s} {d['tau']:5.2f} {d['speedup']:8.2f} {d['roofline_speedup']:9.2f} {d['efficiency']:10.2f}")
    for name, d in result["peers"].items():
        best = max(d["tokens_per_s"] for d in result["drafters"].values()) if result["drafters"] else plain_rate
        print(f"{name:24s} {d['tokens_per_s']:.0f} tok/s: plain specserve {d['plain_over_peer']:.2f}x it, the best "
              f"drafter {best / d['tokens_per_s']:.2f}x; greedy equal to ours on {d['prompts_greedy_equal_to_plain']}/"
              f"{len(prompts)} prompts")
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
