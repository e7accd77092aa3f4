"""`specserve bench decode`: plain-decode speed against transformers, the weight-bandwidth floor and
(`--peer llama.cpp`) llama.cpp, and n-gram speculation against plain decoding on a prompt with
repeated structure.

llama.cpp runs the same checkpoint converted by its own converter (evals/llamacpp_peer.py), from the
same prompt token ids, greedy, with the same thread count; its weights are f32 against our float32
and f16 against our half-size storage (--dtype bfloat16 or float16). A GGUF target (`--model FILE.gguf`,
the default model's file) is the same file on both sides, no conversion.

`--chat-prompts N`: the timed prompts are N chat questions (`CHAT_QUESTIONS`) rendered by the model's chat
template, one user turn each (their token ids shared by both sides), and the greedy outputs of specserve
and llama.cpp are compared prompt by prompt (how many agree token for token over --new-tokens).

Everything is measured side by side in one run (alternating, after a warm-up) because absolute
times on shared machines drift; compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specserve.cli import KV_CACHE_DTYPES, QUANTIZATION_HELP, QUANTIZATIONS
from specserve.evals import llamacpp_peer
from specserve.evals.common import first_divergence, host, median_spread, set_threads, use_model_dir, write_json


#: Questions of the kinds people ask a small chat model (code, explanations, short writing).
CHAT_QUESTIONS = (
    "Write a Python function that checks if a number is prime.",
    "What is the difference between a list and a tuple in Python?",
    "Explain recursion to a beginner in three sentences.",
    "Write a haiku about autumn.",
    "How do I reverse a string in Python?",
    "Give me three tips for writing clean code.",
    "What does the HTTP status code 404 mean?",
    "Write a SQL query that counts the rows of a table named users.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is a closure in JavaScript?",
    "Write a bash command that lists the ten largest files in a directory.",
    "Why is the sky blue?",
    "Convert 100 degrees Fahrenheit to Celsius and show the formula.",
    "Write a Python class for a stack with push and pop.",
    "What are the main causes of climate change?",
    "Explain what a hash table is.",
)


def chat_prompts(llm, count: int) -> list[list[int]]:
    """The first `count` questions as one user turn each in the model's chat template, as token ids."""
    from specserve.chat_template import has_chat_template

    if not has_chat_template(llm.tokenizer):
        raise ValueError("--chat-prompts needs a model with a chat template")
    if not 1 <= count <= len(CHAT_QUESTIONS):
        raise ValueError(f"--chat-prompts must be in [1, {len(CHAT_QUESTIONS)}], got {count}")
    out = []
    for question in CHAT_QUESTIONS[:count]:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a GGUF file, a model directory, or 'tiny' (default: a ~110M random-weight Llama built on the fly)")
    p.add_argument("--chat-prompts", type=int, default=0, metavar="N",
                   help=f"time N chat-templated questions (at most {len(CHAT_QUESTIONS)}) instead of one random prompt, and "
                        "compare greedy outputs with llama.cpp per prompt")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="alternating timed runs per contender")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None,
                   help="CPU: weight storage float32 (default), bfloat16 or float16 (compute stays float32); "
                        "llama.cpp gets f32 weights against float32, f16 against the half-size ones")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help=QUANTIZATION_HELP + "; llama.cpp gets q8_0 / q4_0 against it")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="what specserve's KV cache stores (CPU kernels): float32 (default) or float16 — with a long "
                        "--prompt-tokens, what a long context's decode step streams; llama.cpp's cache pairs with it")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU kernel threads, and llama.cpp's n_threads and n_threads_batch (default: every core)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--peer", choices=["llama.cpp"], default=None,
                   help="also time llama.cpp (llama-cpp-python) on the same checkpoint; skipped with one line "
                        "when it or llama.cpp's converter is not available")
    llamacpp_peer.add_arguments(p)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def build_random_llama(out_dir: Path, seed: int = 0) -> Path:
    """~110M parameters: 12 layers, hidden 768, MLP 2048, 12 heads, 32k vocabulary, tied embeddings."""
    import torch

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(out_dir))
    return out_dir


def memory_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s the CPU reads a large fp32 tensor at (best of `repeats` full reductions)."""
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def _time_specserve(llm, prompt: list[int], new_tokens: int) -> tuple[float, list[int], float]:
    from specserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    elapsed = time.perf_counter() - t0
    assert len(out.token_ids) == new_tokens
    return new_tokens / elapsed, out.token_ids, out.spec.mean_accepted_length


def _time_transformers(model, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    import torch

    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - t0
    return new_tokens / elapsed, out[0, len(prompt):].tolist()


def run(args: argparse.Namespace) -> int:
    import torch

    set_threads(args.threads)
    torch.manual_seed(0)
    converter = llamacpp_peer.locate(args.llama_cpp_source, args.model) if args.peer == "llama.cpp" else None
    if isinstance(converter, llamacpp_peer.PeerUnavailable):  # said once; the rest of the benchmark runs
        print(llamacpp_peer.skip_line(converter), file=sys.stderr)
    with use_model_dir(args.model, build_random_llama, "a random ~110M Llama") as path:
        results = _measure(args, path, converter)
    print(json.dumps(results, indent=2))
    write_json(results, args.json)
    return 0


def _time_llama_cpp(peer, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    seconds, out = peer.timed(prompt, new_tokens)
    return new_tokens / seconds, out


def _agreement(ours: list[int], theirs: list[int]) -> dict:
    """How far two greedy continuations agree (only the common prefix is comparable)."""
    first = first_divergence(ours, theirs)
    same = len(ours) if first is None else first
    return {"greedy_tokens_match": first is None and len(ours) == len(theirs),
            "greedy_agreement": same / max(len(ours), 1), "first_divergence": first}


def _measure(args: argparse.Namespace, model_dir: Path, converter=None) -> dict:
    import torch

    from specserve import LLM
    from specserve.kernels import get_threads

    # No prefix caching: a repeated prompt is prefilled every run, as llama.cpp (reset each run) does.
    plain = LLM(model_dir, drafter=None, device=args.device, max_num_seqs=1, dtype=args.dtype,
                quantization=args.quantization, enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype)
    vocab = plain.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist()
    prompts = chat_prompts(plain, args.chat_prompts) if args.chat_prompts else [prompt]

    results: dict = {
        "machine": host() | {"threads": get_threads(), "torch": torch.__version__},
        "model": {"dir": str(args.model or "random ~110M Llama"), "params": plain.model.config.num_params,
                  "bytes_read_per_token": plain.model.bytes_read_per_token()},
        "settings": {"prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens, "repeats": args.repeats,
                     "device": str(plain.device), "dtype": str(plain.dtype),
                     "kv_cache_dtype": str(plain.model.cache_dtype()).removeprefix("torch.")},
    }

    hf = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        from specserve.loading.gguf_file import is_gguf

        where = {"pretrained_model_name_or_path": str(model_dir)}
        if is_gguf(model_dir):  # transformers dequantizes a GGUF file's weights (it needs the accelerate package)
            where = {"pretrained_model_name_or_path": str(Path(model_dir).parent), "gguf_file": Path(model_dir).name}
        hf = AutoModelForCausalLM.from_pretrained(**where, dtype=plain.dtype).to(plain.device).eval()

    peer = None
    if isinstance(converter, llamacpp_peer.PeerUnavailable):
        results["llama_cpp"] = {"skipped": str(converter)}
    elif converter is not None:
        peer = llamacpp_peer.load(model_dir, converter, dtype=args.quantization or plain.dtype, threads=get_threads(),
                                  n_ctx=max(map(len, prompts)) + args.new_tokens, gpu=plain.device.type == "cuda",
                                  cache_dir=args.llama_cpp_cache, log=lambda m: print(m, file=sys.stderr),
                                  kv_type="f16" if plain.model.cache_dtype() == torch.float16 else "f32")

    # Warm up every contender, check they agree, then alternate timed runs.
    _, ours_tokens, _ = _time_specserve(plain, prompt, 8)
    if hf is not None:
        _, hf_tokens = _time_transformers(hf, prompt, 8)
        results["greedy_tokens_match_transformers"] = ours_tokens == hf_tokens
    if peer is not None:
        _time_llama_cpp(peer, prompt, 8)
    ours, theirs, llama, outputs = [], [], [], {"specserve": {}, "llama.cpp": {}}
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            tps, toks, _ = _time_specserve(plain, prompt, args.new_tokens)
            ours.append(tps)
            outputs["specserve"].setdefault(i, toks)
            if hf is not None:
                theirs.append(_time_transformers(hf, prompt, args.new_tokens)[0])
            if peer is not None:
                tps, toks = _time_llama_cpp(peer, prompt, args.new_tokens)
                llama.append(tps)
                outputs["llama.cpp"].setdefault(i, toks)
    bw = memory_read_bandwidth()
    floor_tps = bw / plain.model.bytes_read_per_token()
    results["plain_decode"] = {
        "specserve_tokens_per_s": median_spread(ours),
        "transformers_tokens_per_s": median_spread(theirs) if theirs else None,
        "speedup_vs_transformers": statistics.median(ours) / statistics.median(theirs) if theirs else None,
        "memory_read_bandwidth_GBps": bw / 1e9,
        "bandwidth_floor_tokens_per_s": floor_tps,
        "fraction_of_floor": statistics.median(ours) / floor_tps,
    }
    if peer is not None:
        results["llama_cpp"] = {
            "llama_cpp_python": llamacpp_peer.require_llama_cpp(), "gguf": str(peer.gguf), "gguf_type": peer.gguf_type,
            "specserve_dtype": str(plain.dtype).removeprefix("torch."), "threads": peer.threads,
            "tokens_per_s": median_spread(llama),
            "specserve_tokens_per_s": median_spread(ours),
            "specserve_over_llama_cpp": statistics.median(ours) / statistics.median(llama),
        } | _agreement(outputs["specserve"][0], outputs["llama.cpp"][0])
        results["llama_cpp"]["prompts_greedy_equal"] = sum(outputs["specserve"][i] == outputs["llama.cpp"][i]
                                                           for i in range(len(prompts)))
        results["llama_cpp"]["prompts"] = len(prompts)
    del hf, peer

    # N-gram speculation vs plain on a prompt made of one segment repeated.
    segment = torch.randint(0, vocab, (16,), generator=gen).tolist()
    repeated = (segment * (args.prompt_tokens // 16 + 1))[: args.prompt_tokens]
    ngram = LLM(model_dir, drafter="ngram", device=args.device, max_num_seqs=1, dtype=args.dtype,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    _time_specserve(ngram, repeated, 8)
    plain_r, ngram_r, taus, identical = [], [], [], True
    for _ in range(args.repeats):
        tps_p, toks_p, _ = _time_specserve(plain, repeated, args.new_tokens)
        tps_n, toks_n, tau = _time_specserve(ngram, repeated, args.new_tokens)
        plain_r.append(tps_p)
        ngram_r.append(tps_n)
        taus.append(tau)
        identical &= toks_p == toks_n
    results["ngram_repeated_prompt"] = {
        "plain_tokens_per_s": median_spread(plain_r),
        "ngram_tokens_per_s": median_spread(ngram_r),
        "speedup": statistics.median(ngram_r) / statistics.median(plain_r),
        "tau": statistics.median(taus),
        "outputs_identical": identical,
    }
    return results
