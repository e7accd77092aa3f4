"""The `specserve` command: generate, serve, chat, info, eval, bench, train.

Bad input prints one line to stderr and exits with status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

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
        sub.add_parser("train", help="train the models specserve serves: corpus, lm, distill-data, draft, medusa, eagle, bundle")
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


def add_execution_arguments(p: argparse.ArgumentParser) -> None:
    """--attention, --no-cuda-graphs and --tensor-parallel (generate and serve)."""
    p.add_argument("--attention", default=None, choices=["triton", "sdpa"],
                   help="attention backend (default: triton on CUDA; on the CPU the compiled kernels — naming one "
                        "runs the torch layers instead)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="run every CUDA forward eagerly (default: decode and verify steps replay CUDA graphs)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the target over N ranks (torch.distributed: N GPUs, or N CPU processes with gloo)")


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    from specserve import defaults

    gen.add_argument("--model", default=None, help="Hugging Face Llama-family model directory (default: the embedded model)")
    gen.add_argument("--drafter", default="auto",
                     help="drafter spec: 'ngram', 'NAME:PATH' or 'none' (default 'auto': the embedded model's default drafter, else none)")
    gen.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                     help="drafter knob, e.g. depth=8 (repeatable; under adaptive speculation budget and depth are upper bounds)")
    gen.add_argument("--speculation", default="adaptive", choices=("adaptive", "static"),
                     help="adaptive (default): each step's draft trees sized from measured cost and acceptance, plain "
                          "decoding when speculation does not pay; static: the drafter's budget every step")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=defaults.MAX_TOKENS, help="default: the rest of the context window")
    gen.add_argument("--temperature", type=float, default=defaults.TEMPERATURE, help="0 = greedy (default %(default)s)")
    gen.add_argument("--top-p", type=float, default=defaults.TOP_P)
    gen.add_argument("--top-k", type=int, default=defaults.TOP_K)
    gen.add_argument("--min-p", type=float, default=defaults.MIN_P)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--seed", type=int, default=defaults.SEED)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda")
    gen.add_argument("--dtype", default=None,
                     help="CPU: weight storage float32 (default), bfloat16 or float16 (compute stays float32); "
                          "CUDA: compute dtype (default bfloat16)")
    gen.add_argument("--threads", type=int, default=None, help="CPU threads for the kernels (default: every core)")
    add_execution_arguments(gen)
    gen.add_argument("--json", action="store_true",
                     help="print token ids, text, speculation stats, TTFT and tokens/s as JSON")
    add_constraint_arguments(gen)
    add_grammar_drafting_argument(gen)


GRAMMAR_DRAFTING = ("forced", "aware", "verify")  # specserve.engine.GRAMMAR_DRAFTING (not imported: no torch here)


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
    info.add_argument("--model", default=None, help="the target for --drafter (default: the embedded model)")
    info.add_argument("--device", default="auto")


def add_convert_arguments(conv: argparse.ArgumentParser) -> None:
    conv.add_argument("--drafter", required=True, metavar="eagle:DIR|medusa:DIR",
                      help="the head to convert (any layout `generate` loads)")
    conv.add_argument("--model", default=None, help="its target (default: the embedded model)")
    conv.add_argument("--to", required=True, dest="layout",
                      choices=("specserve", "eagle3-safeailab", "eagle3-speculators", "eagle1-safeailab", "medusa1", "medusa2"))
    conv.add_argument("--out", required=True, help="output directory (new or empty)")


def cmd_convert(args: argparse.Namespace) -> int:
    from specserve import LLM
    from specserve.drafters.export import export_drafter

    llm = LLM(args.model, drafter=args.drafter, device="cpu", dtype="float32")
    out = export_drafter(llm.engine.drafter, args.layout, args.out)
    print(f"wrote {args.layout} head to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed, ignore_eos=args.ignore_eos,
        **constraint_kwargs(args),
    )
    if not args.prompt:
        raise ValueError("--prompt is empty")
    llm = LLM(args.model, drafter=args.drafter, drafter_options=_drafter_options(args.drafter_option), device=args.device,
              dtype=args.dtype, threads=args.threads, speculation=args.speculation, grammar_drafting=args.grammar_drafting,
              attention=args.attention, cuda_graphs=args.cuda_graphs, tensor_parallel_size=args.tensor_parallel)
    if args.json:
        out = llm.generate([args.prompt], params)[0]
        print(json.dumps({
            "model": llm.model_dir, "drafter": llm.drafter_spec, "prompt": args.prompt,
            "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason, "spec": out.spec.to_dict(), "tau": out.spec.mean_accepted_length,
            "ttft_s": out.ttft_s, "e2e_s": out.e2e_s, "tokens_per_s": _tokens_per_s(out),
        }))
    else:
        for delta in llm.stream(args.prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


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
    from specserve.bundle_paths import default_drafter, default_drafters, default_model_dir

    info = {
        "version": specserve.__version__,
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "drafters": registered_drafters(),
        "attention_backends": sorted(BACKENDS),
        "default_attention": default_attention("cuda" if torch.cuda.is_available() else "cpu"),
        "default_model": str(default_model_dir()) if default_model_dir() else None,
        "default_drafters": default_drafters(),
        "default_drafter": default_drafter(default_model_dir()),  # what --drafter auto picks
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
        print(f"specserve: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
