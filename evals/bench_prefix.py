"""`specserve bench prefix`: prefix caching on vs off, in one run, on the same model and drafter.

Three workloads, each measured on two LLMs (caching on, caching off) built once, their runs alternating
(which goes first too) so the machine's noise falls on both alike; TTFT is the engine's (request added →
first token), greedy:

(a) shared system prompt — one ~330-token system prompt (``--system-tokens``) answered for several
    questions, one request at a time: with caching, the first request is cold (the cache cleared before
    it), the others find the system prompt's blocks. Goal: cached TTFT >= 4x lower than cold.
(b) chat — a 10-turn conversation, each turn's prompt the chat template over every earlier message and
    answer (what a chat client sends): median TTFT of turns 8-10 over that of turns 1-3. Goal: <= 1.3x
    with caching (without it, every turn prefills the whole history).
(c) no sharing — distinct raw-text prompts (no template, nothing in common): what caching costs when it
    never hits (hashing, registering, an ever-fuller cache): TTFT and decode tokens/s (tokens after the
    first over the time after it). Goal: <= 2 % worse. Measured on its own pair of LLMs with static
    speculation: adaptive budgets are learnt from measured step times, so two engines' budgets drift apart
    by chance (seen: ±5-10 % decode speed either way, with or without caching), which would swamp 2 %.

Every output with caching is checked equal to the output without (greedy: lossless).

``--server`` runs (a) and (b) through `specserve serve`'s OpenAI API on loopback instead, with the real
`openai` client streaming (TTFT: request sent → first content chunk), as a chat client sees it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from specserve.evals.common import check_positive, clear_prefix_cache, machine, set_threads, write_json
from specserve.cli import MODEL_HELP

QUESTIONS = ["Write a function that reverses a linked list.", "How do I read a CSV file line by line?",
             "Explain what a Python generator is.", "Fix: list index out of range in my loop.",
             "Sort a dict by value.", "What does `yield from` do?", "Time a block of code.",
             "Parse JSON from a string.", "Make a dataclass immutable.", "Merge two sorted lists."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafter", default="auto", help="drafter spec (default: auto, the bundle's default)")
    p.add_argument("--system-tokens", type=int, default=330, help="length of the shared system prompt (a)")
    p.add_argument("--questions", type=int, default=6, help="requests answered on the shared system prompt (a)")
    p.add_argument("--turns", type=int, default=10, help="turns of the chat (b)")
    p.add_argument("--answer-tokens", type=int, default=32, help="tokens each answer/turn generates")
    p.add_argument("--unshared", type=int, default=12, help="distinct prompts of the no-sharing workload (c)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per no-sharing prompt (c)")
    p.add_argument("--repeats", type=int, default=3, help="times each workload runs on each LLM (alternating)")
    p.add_argument("--server", action="store_true",
                   help="(a) and (b) through a server on loopback with the openai client (TTFT as the client sees it)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE")


def _generate(llm, prompt: list[int], max_tokens: int):
    from specserve import SamplingParams

    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]


def _chat_prompt(llm, messages: list[dict]) -> list[int]:
    """The prompt the server builds for these messages (so engine and server mode time the same ids)."""
    from specserve.server.prompts import prompt_ids

    return prompt_ids(llm, None, messages)


class _EngineChat:
    """Chat requests straight to the engine: TTFT from `add_request` to the first token."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def ask(self, messages: list[dict], max_tokens: int) -> tuple[float, str, int, float]:
        """(TTFT ms, answer text, prompt tokens, the server's own TTFT ms: here the same) of one greedy request."""
        prompt = _chat_prompt(self.llm, messages)
        out = _generate(self.llm, prompt, max_tokens)
        return out.ttft_s * 1e3, out.text, len(prompt), out.ttft_s * 1e3

    def clear(self) -> None:
        clear_prefix_cache(self.llm.engine)

    def close(self) -> None:
        pass


class _ServerChat:
    """Chat requests through a server's OpenAI API on loopback, the real `openai` client streaming: TTFT
    from sending the request to the first content chunk."""

    def __init__(self, llm) -> None:
        import openai

        from specserve.server import BackgroundServer, ServerConfig

        self.srv = BackgroundServer(llm, ServerConfig(port=0, threads=1)).start()
        self.client = openai.OpenAI(base_url=self.srv.openai_base_url, api_key="unused", max_retries=0, timeout=120)
        self.model = self.srv.server.model_name

    def ask(self, messages: list[dict], max_tokens: int) -> tuple[float, str, int, float]:
        """... and the server's own TTFT (receipt → first token, from the stream's last chunk): the client's
        side adds its own work per message (the openai client's request building: ~0.1 ms a message)."""
        start = time.perf_counter()
        first, text, prompt_tokens, server_ttft = None, [], 0, float("nan")
        for chunk in self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first if first is not None else time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
            server_ttft = (chunk.model_extra or {}).get("timing", {}).get("ttft_ms", server_ttft)
        return first * 1e3, "".join(text), prompt_tokens, server_ttft

    def clear(self) -> None:
        self.srv.engine_call(clear_prefix_cache)  # on the engine thread, between its steps

    def close(self) -> None:
        self.srv.stop()


def _shared_system(chat, system: str, questions: list[str], max_tokens: int) -> dict:
    """(a): TTFT (ms) of each question's request, one at a time, from an empty cache."""
    chat.clear()
    ttft, outputs = [], []
    for q in questions:
        ms, text, _, _ = chat.ask([{"role": "system", "content": system}, {"role": "user", "content": q}], max_tokens)
        ttft.append(ms)
        outputs.append(text)
    return {"ttft_ms": ttft, "outputs": outputs}


def _chat(chat, turns: int, max_tokens: int) -> dict:
    """(b): TTFT (ms) per turn of one conversation, each turn's prompt the whole chat so far (the answers
    sent back as the client received them)."""
    chat.clear()
    messages = [{"role": "system", "content": "You are a concise coding assistant."}]
    ttft, outputs, lengths, server_ttft = [], [], [], []
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        ms, text, prompt_tokens, server_ms = chat.ask(messages, max_tokens)
        ttft.append(ms)
        server_ttft.append(server_ms)
        outputs.append(text)
        lengths.append(prompt_tokens)
        messages.append({"role": "assistant", "content": text})
    return {"ttft_ms": ttft, "outputs": outputs, "prompt_tokens": lengths, "server_ttft_ms": server_ttft}


def _unshared(llms: dict, order: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    """(c): per mode, TTFT (ms) and decode tokens/s of prompts that share nothing (the cache is not
    cleared); each prompt runs on both LLMs back to back, so drift falls on both."""
    out = {mode: {"ttft_ms": [], "tokens_per_s": [], "outputs": []} for mode in order}
    for p in prompts:
        for mode in order:
            r = _generate(llms[mode], p, max_tokens)
            out[mode]["ttft_ms"].append(r.ttft_s * 1e3)
            out[mode]["tokens_per_s"].append((len(r.token_ids) - 1) / (r.e2e_s - r.ttft_s))
            out[mode]["outputs"].append(r.token_ids)
    return out


def _system_prompt(llm, tokens: int) -> str:
    from specserve.evals.datasets import heldout_prompts

    text = "You are a coding assistant for this repository. Follow its conventions:\n"
    for chunk in heldout_prompts(64, 600):
        if len(llm.tokenizer.encode(text + chunk)) > tokens:
            break
        text += chunk + "\n"
    return text


def run(args: argparse.Namespace) -> int:
    from specserve import LLM
    from specserve.evals.datasets import heldout_prompts

    set_threads(args.threads)
    check_positive(args, "system_tokens", "questions", "turns", "answer_tokens", "unshared", "decode_tokens", "repeats")
    if args.questions < 2 or args.turns < 6:
        raise ValueError("--questions must be >= 2 (one cold, the rest cached) and --turns >= 6 (first and last three)")
    llms = {"on": LLM(args.model, drafter=args.drafter, enable_prefix_caching=True),
            "off": LLM(args.model, drafter=args.drafter, enable_prefix_caching=False)}
    static = {mode: LLM(args.model, drafter=args.drafter, speculation="static", enable_prefix_caching=mode == "on")
              for mode in llms}
    any_llm = llms["on"]
    system = _system_prompt(any_llm, args.system_tokens)
    questions = [QUESTIONS[i % len(QUESTIONS)] + f" (#{i})" for i in range(args.questions)]
    # (c): a numbered first line makes every prompt of every repeat differ from its first block on (a
    # prompt seen before would hit), so nothing is shared even where the held-out texts repeat.
    texts = heldout_prompts(args.unshared, 400)
    unshared = [[any_llm.encode(f"# file {r}-{i}\n" + t) for i, t in enumerate(texts)] for r in range(args.repeats)]
    for llm in [*llms.values(), *static.values()]:  # warm-up: compile and touch every path once
        _generate(llm, unshared[0][0], 4)
    chats = {mode: (_ServerChat if args.server else _EngineChat)(llm) for mode, llm in llms.items()}
    runs = {mode: {"a": [], "b": [], "c": []} for mode in llms}
    try:
        for repeat in range(args.repeats):
            order = ["on", "off"] if repeat % 2 == 0 else ["off", "on"]
            for mode in order:
                runs[mode]["a"].append(_shared_system(chats[mode], system, questions, args.answer_tokens))
                runs[mode]["b"].append(_chat(chats[mode], args.turns, args.answer_tokens))
            for mode, result in _unshared(static, order, unshared[repeat], args.decode_tokens).items():
                runs[mode]["c"].append(result)
    finally:
        for chat in chats.values():
            chat.close()
    for part in "abc":  # lossless: every output with caching equals the output without
        for on, off in zip(runs["on"][part], runs["off"][part]):
            if on["outputs"] != off["outputs"]:
                raise AssertionError(f"workload ({part}): greedy output with prefix caching differs from without")
    result = _summarize(runs, args)
    result["system_prompt_tokens"] = len(_chat_prompt(any_llm, [{"role": "system", "content": system},
                                                               {"role": "user", "content": questions[0]}]))
    result["machine"] = machine(any_llm)
    _print(result, args)
    write_json(result, args.json)
    return 0


def _summarize(runs: dict, args) -> dict:
    out = {"drafter": args.drafter, "repeats": args.repeats, "ttft": "client (openai, loopback)" if args.server else "engine"}
    for mode in runs:
        a = runs[mode]["a"]
        b = runs[mode]["b"]
        c = runs[mode]["c"]
        turns = [statistics.median(r["ttft_ms"][t] for r in b) for t in range(args.turns)]
        server_turns = [statistics.median(r["server_ttft_ms"][t] for r in b) for t in range(args.turns)]
        out[mode] = {
            "a_cold_ttft_ms": statistics.median(r["ttft_ms"][0] for r in a),
            "a_cached_ttft_ms": statistics.median(x for r in a for x in r["ttft_ms"][1:]),
            "b_turn_ttft_ms": turns,
            "b_first3_ttft_ms": statistics.median(turns[:3]),
            "b_last3_ttft_ms": statistics.median(turns[-3:]),
            "b_server_growth": statistics.median(server_turns[-3:]) / statistics.median(server_turns[:3]),
            "c_ttft_ms": statistics.median(x for r in c for x in r["ttft_ms"]),
            "c_tokens_per_s": statistics.median(x for r in c for x in r["tokens_per_s"]),
        }
        out[mode]["a_speedup"] = out[mode]["a_cold_ttft_ms"] / out[mode]["a_cached_ttft_ms"]
        out[mode]["b_growth"] = out[mode]["b_last3_ttft_ms"] / out[mode]["b_first3_ttft_ms"]
    out["b_prompt_tokens"] = runs["on"]["b"][0]["prompt_tokens"]
    out["c_ttft_cost"] = out["on"]["c_ttft_ms"] / out["off"]["c_ttft_ms"] - 1
    out["c_decode_cost"] = 1 - out["on"]["c_tokens_per_s"] / out["off"]["c_tokens_per_s"]
    return out


def _print(r: dict, args) -> None:
    on, off = r["on"], r["off"]
    where = "(a), (b): the openai client against a server on loopback" if args.server else "TTFT in the engine"
    print(f"prefix caching on vs off (drafter {args.drafter}, median of {args.repeats} runs, greedy outputs identical; "
          f"{where})")
    print(f"(a) shared {r['system_prompt_tokens']}-token system prompt, {args.questions} requests one at a time:")
    print(f"    off: TTFT {off['a_cold_ttft_ms']:.1f} ms first, {off['a_cached_ttft_ms']:.1f} ms the others")
    print(f"    on:  TTFT {on['a_cold_ttft_ms']:.1f} ms cold, {on['a_cached_ttft_ms']:.1f} ms cached "
          f"({on['a_speedup']:.1f}x lower; goal >= 4x)")
    print(f"(b) {args.turns}-turn chat (prompts {r['b_prompt_tokens'][0]} -> {r['b_prompt_tokens'][-1]} tokens), "
          f"TTFT per turn ms:")
    for mode in ("off", "on"):
        print(f"    {mode:>3}: " + " ".join(f"{x:.1f}" for x in r[mode]["b_turn_ttft_ms"])
              + f"  | turns 8-10 / 1-3: {r[mode]['b_growth']:.2f}x" + ("  (goal <= 1.3x)" if mode == "on" else "")
              + (f"; the server's own TTFT: {r[mode]['b_server_growth']:.2f}x" if args.server else ""))
    print(f"(c) {args.unshared} prompts sharing nothing, {args.decode_tokens} tokens each (static speculation):")
    print(f"    off: TTFT {off['c_ttft_ms']:.1f} ms, decode {off['c_tokens_per_s']:.1f} tok/s")
    print(f"    on:  TTFT {on['c_ttft_ms']:.1f} ms ({100 * r['c_ttft_cost']:+.1f} %), decode {on['c_tokens_per_s']:.1f} tok/s "
          f"({-100 * r['c_decode_cost']:+.1f} %; goal: cost <= 2 %)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
