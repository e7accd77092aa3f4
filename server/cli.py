"""Arguments and handlers of `specserve serve` and `specserve chat` (wired in by specserve/cli.py).

Handlers raise ValueError for bad input; specserve's main turns that into one line and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from specserve import defaults
from specserve.server.client import DEFAULT_URL


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from specserve.cli import DRAFTER_HELP, MODEL_HELP  # specserve.cli imports this module: resolved at call time

    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE", help="drafter knob (repeatable)")
    p.add_argument("--speculation", default="adaptive", choices=("adaptive", "static"),
                   help="adaptive (default): draft trees sized each step from measured cost and acceptance; static: "
                        "the drafter's budget every step")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free port)")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="require this key at the handshake (default: $SPECSERVE_API_KEY)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="browser origin allowed besides the server's own, e.g. http://localhost:3000 (repeatable; '*' = any)")
    p.add_argument("--max-connections", type=int, default=64)
    p.add_argument("--max-queued", type=int, default=256, help="responses that may wait for a batch slot")
    p.add_argument("--max-responses-per-connection", type=int, default=8)
    p.add_argument("--max-message-bytes", type=int, default=1 << 20)
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="engines behind this server: its own plus N-1 processes with a copy of the model (each request "
                        "goes to the least loaded; a websocket session stays on one); --threads is per engine")
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM: stop accepting, let running responses finish for up to this long, then "
                        "cancel the rest (each gets its terminal event); a second signal cuts it short (default 10)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together in one batch")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    from specserve.cli import THREADS_HELP

    p.add_argument("--threads", type=int, default=None, help=f"CPU threads for the kernels ({THREADS_HELP})")
    p.add_argument("--dtype", default=None, help="CPU: weight storage float32 (default), bfloat16 or float16")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info (the default) logs one line per finished request; warning keeps only problems")
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one JSON object per line")
    from specserve.cli import add_execution_arguments, add_grammar_drafting_argument

    add_execution_arguments(p)
    add_grammar_drafting_argument(p)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"server websocket URL (default: {DEFAULT_URL})")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"), help="default: $SPECSERVE_API_KEY")
    p.add_argument("--system", default=None, help="system message that opens the conversation")
    p.add_argument("--max-output-tokens", type=int, default=None,
                   help=f"room kept for each reply (default: the server's, {defaults.CHAT_MAX_OUTPUT_TOKENS}); "
                        "older turns are left out to keep it")
    p.add_argument("--temperature", type=float, default=None, help=f"default: the server's ({defaults.TEMPERATURE})")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--pacing", default=defaults.CHAT_STREAM_PACING, choices=["smooth", "off"],
                   help="smooth: spread each step's tokens over the step (default); off: as they come")
    p.add_argument("--drafter", default=None, help="switch the session's drafter: the server's one or 'none'")
    p.add_argument("--json", action="store_true", help="print every server event as a JSON line")
    p.add_argument("--json-schema", metavar="FILE_OR_JSON", default=None,
                   help="every reply is one JSON value valid against this schema (a .json file or inline JSON)")


def cmd_serve(args: argparse.Namespace) -> int:
    from specserve.cli import _drafter_options, check_common_arguments, import_engine, show_progress

    check_common_arguments(args)  # bad values answer before torch is imported
    show_progress(args)
    import_engine()
    from specserve.server.app import ServerConfig, SpecServer

    from specserve import LLM

    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, allowed_origins=tuple(args.allow_origin),
        max_connections=args.max_connections, max_queued=args.max_queued,
        max_responses_per_connection=args.max_responses_per_connection, max_message_bytes=args.max_message_bytes,
        shutdown_grace=args.shutdown_grace, replicas=args.replicas,
    )
    from specserve.server.request_log import configure_logging

    configure_logging(args.log_level, args.log_format)
    from specserve.cli import kernel_threads

    threads = kernel_threads(args, args.replicas * args.tensor_parallel)
    llm = LLM(args.model, drafter=args.drafter, drafter_options=_drafter_options(args.drafter_option),
              device=args.device, dtype=args.dtype, threads=threads, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, speculation=args.speculation, grammar_drafting=args.grammar_drafting,
              attention=args.attention, cuda_graphs=args.cuda_graphs, tensor_parallel_size=args.tensor_parallel,
              enable_prefix_caching=args.prefix_caching, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    from specserve import progress

    progress.begin("warming up (a greedy and a sampled request)")
    llm.warm_up()  # the first clients would otherwise wait for kernels compiling on first use
    progress.end()
    server = SpecServer(llm, config)
    try:
        return asyncio.run(_serve(server))
    finally:
        llm.close()  # tensor-parallel ranks end here, before the interpreter tears threads down


async def _serve(server) -> int:
    await server.start()
    host = server.config.host
    shown = f"[{host}]" if ":" in host else host
    print(f"specserve: serving {server.model_name} (drafter {server.drafter_spec or 'none'}{', ' + server.speculation + ' speculation' if server.speculation else ''}) "
          f"on http://{shown}:{server.port}/ — OpenAI API http://{shown}:{server.port}/v1, "
          f"websocket ws://{shown}:{server.port}/v1/ws", file=sys.stderr, flush=True)
    stop, now = asyncio.Event(), asyncio.Event()  # the first signal drains; a second cuts the grace short
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: now.set() if stop.is_set() else stop.set())
    try:
        await stop.wait()
        await server.stop_accepting()
        print(f"specserve: shutting down: no new requests; running responses get up to {server.config.shutdown_grace:g} s "
              "to finish", file=sys.stderr, flush=True)
        await server.shutdown(now=now)
    finally:
        await server.close()
    print("specserve: stopped", file=sys.stderr, flush=True)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from specserve.server.client import run_chat

    if args.max_output_tokens is not None and args.max_output_tokens < 1:
        raise ValueError(f"--max-output-tokens must be >= 1, got {args.max_output_tokens}")
    if args.json_schema is not None:
        from specserve.cli import load_json_schema

        args.json_schema = load_json_schema(args.json_schema)  # the server says whether it compiles
    return run_chat(args)
