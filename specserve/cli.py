"""The `specserve` command: generate, serve, chat, info, eval, bench, train.

Bad input prints one line to stderr and exits with status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError, MemoryError)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we want one line
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description="Latency-first speculative decoding serving stack.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("--model", default=None, help="Hugging Face Llama-family model directory (default: the embedded model)")
    gen.add_argument("--drafter", default="auto",
                     help="drafter spec: 'ngram', 'NAME:PATH' or 'none' (default 'auto': the embedded model's default drafter, else none)")
    gen.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                     help="drafter knob, e.g. depth=8 (repeatable)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda")
    gen.add_argument("--json", action="store_true", help="print token ids, text and speculation stats as JSON")
    gen.set_defaults(handler=cmd_generate)

    info = sub.add_parser("info", help="version, device and registered drafters")
    info.add_argument("--json", action="store_true")
    info.set_defaults(handler=cmd_info)

    from specserve.evals import bench_batch, bench_decode, bench_drafters, bench_serve, bench_verify, suite
    from specserve.server import cli as server_cli

    _command(sub, "serve", "websocket server with a browser chat page", server_cli.add_serve_arguments, server_cli.cmd_serve)
    _command(sub, "chat", "interactive terminal chat with a running server", server_cli.add_chat_arguments, server_cli.cmd_chat)
    _command(sub, "eval", "acceptance and speed of drafters vs plain decoding and transformers peers on a dataset",
             suite.add_arguments, suite.run)
    bench = sub.add_parser("bench", help="microbenchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    _command(bench_sub, "decode", "plain decode vs transformers vs the bandwidth floor; n-gram vs plain",
             bench_decode.add_arguments, bench_decode.run)
    _command(bench_sub, "drafters", "tau and speed of drafters vs plain decoding on held-out code",
             bench_drafters.add_arguments, bench_drafters.run)
    _command(bench_sub, "serve", "websocket clients over loopback: TTFT, inter-token latency, server overhead",
             bench_serve.add_arguments, bench_serve.run)
    _command(bench_sub, "verify", "verify forward cost vs draft tree size", bench_verify.add_arguments, bench_verify.run)
    _command(bench_sub, "batch", "decode throughput vs batch size", bench_batch.add_arguments, bench_batch.run)
    from specserve.training.cli import add_train_parser

    add_train_parser(sub, _Parser)  # train corpus | lm | distill-data | draft | bundle
    # Each command: add_parser(...) + set_defaults(handler=fn(args) -> exit code). Keep imports of heavy
    # modules inside handlers so `specserve --help` stays fast.
    return parser


def _command(sub, name: str, help: str, add_arguments, handler) -> None:
    """Register a subcommand: its arguments, and the handler ``fn(args) -> exit code`` main() calls."""
    parser = sub.add_parser(name, help=help)
    add_arguments(parser)
    parser.set_defaults(handler=handler)


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


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed, ignore_eos=args.ignore_eos,
    )
    if not args.prompt:
        raise ValueError("--prompt is empty")
    llm = LLM(args.model, drafter=args.drafter, drafter_options=_drafter_options(args.drafter_option), device=args.device)
    if args.json:
        out = llm.generate([args.prompt], params)[0]
        print(json.dumps({
            "model": llm.model_dir, "drafter": llm.drafter_spec, "prompt": args.prompt,
            "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason, "spec": out.spec.to_dict(), "ttft_s": out.ttft_s, "e2e_s": out.e2e_s,
        }))
    else:
        for delta in llm.stream(args.prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import specserve
    from specserve.drafters import registered_drafters
    from specserve.training.bundle_paths import default_drafter, default_drafters, default_model_dir

    info = {
        "version": specserve.__version__,
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "drafters": registered_drafters(),
        "attention_backends": ["sdpa"],
        "default_model": str(default_model_dir()) if default_model_dir() else None,
        "default_drafters": default_drafters(),
        "default_drafter": default_drafter(default_model_dir()),  # what --drafter auto picks
    }
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except USER_ERRORS as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"specserve: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
