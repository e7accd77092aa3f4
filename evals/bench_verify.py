"""`specserve bench verify`: what one target forward costs as the draft tree it verifies grows, against its floor.

For each tree size N, one request with a committed prefix of --prefix-tokens runs the verify forward
the engine runs (root + N tree nodes under the tree's ancestor mask, logits for all N + 1 rows);
the figure is its median time relative to N = 0 (plain decoding's forward). Speculation pays while
τ exceeds that ratio. Sizes are measured interleaved, --repeats times each, after a warm-up.

On the CPU kernels each size also gets its floor (`roofline`): max(weight bytes / measured bandwidth, the rows'
multiply-adds / the measured peak rate of each product's arithmetic), and efficiency = floor / measured. Attention
and the per-row glue (norms, rotary) are left out of the floor: at a 128-token prefix they are a few percent of a
row's work. With --peer llama.cpp the same chains run through llama.cpp on the same file (one `llama_decode` of
the N + 1 rows, every row's logits), beside ours.
"""

from __future__ import annotations

import argparse
import statistics
import time

import sys

from specserve.cli import MODEL_HELP, QUANTIZATION_HELP
from specserve.defaults import QUANTIZATIONS
from specserve.evals import llamacpp_peer
from specserve.evals.common import set_threads, sync, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--sizes", default="0,1,2,4,8,16,32,64", help="comma-separated tree sizes (draft nodes)")
    p.add_argument("--shape", choices=("chain", "tree"), default="chain",
                   help="chain: one path N deep; tree: each node has --branching children (breadth first)")
    p.add_argument("--branching", type=int, default=2)
    p.add_argument("--prefix-tokens", type=int, default=128, help="committed tokens before the tree")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="weight storage float32, bfloat16 or float16 (a float checkpoint)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="skip measuring this machine's bandwidth and peak rates (the floor columns)")
    p.add_argument("--peer", choices=["llama.cpp"], default=None,
                   help="also time llama.cpp on the same file (chains only; skipped with one line when unavailable)")
    llamacpp_peer.add_arguments(p)
    p.add_argument("--json", default=None, metavar="FILE")


def tree_parents(n: int, shape: str, branching: int) -> list[int]:
    """Parents of an N-node chain ([-1, 0, 1, ...]) or breadth-first tree with `branching` children per node."""
    if shape == "chain":
        return [i - 1 for i in range(n)]
    return [i // branching - 1 for i in range(n)]


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--sizes expects comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 0:
        raise ValueError(f"--sizes must be non-negative integers, got {text!r}")
    return sorted({0, *sizes})


def forward_floor(kernels, rows: int, bandwidth: float, rates) -> float:
    """Seconds a forward of `rows` rows (every row's logits) cannot beat on the CPU kernels `kernels`: the weights
    streamed once, or every product's multiply-adds at its arithmetic's peak rate, whichever takes longer."""
    streaming = kernels.bytes_read_per_token() / bandwidth
    arithmetic = sum(rows * p.out_features * p.in_features / rates.for_storage(p.storage) for p in kernels.products())
    return max(streaming, arithmetic)


def measure_peer(args, sizes: list[int], prefix_ids: list[int], threads: int) -> dict | None:
    """llama.cpp's cost of a chain of N + 1 rows after the same prefix, per size (None when it cannot run)."""
    if args.peer != "llama.cpp":
        return None
    tree = llamacpp_peer.locate(args.llama_cpp_source, args.model)
    if isinstance(tree, llamacpp_peer.PeerUnavailable):
        print(llamacpp_peer.skip_line(tree), file=sys.stderr)
        return None
    from specserve.loading import resolve_model

    peer = llamacpp_peer.load(resolve_model(args.model), tree, dtype=args.quantization or args.dtype or "float32",
                              threads=threads, n_ctx=len(prefix_ids) + sizes[-1] + 8, cache_dir=args.llama_cpp_cache,
                              log=lambda m: print(m, file=sys.stderr), logits_all=True)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(args.repeats + 2):
        for n in sizes:
            seconds = peer.verify_seconds(prefix_ids, [(7 * i + rep) % 1000 + 100 for i in range(n + 1)])
            if rep >= 2:
                times[n].append(seconds)
    base = statistics.median(times[0])
    return {"file": str(peer.gguf), "sizes": [{"nodes": n, "ms": 1e3 * statistics.median(times[n]),
                                                "relative": statistics.median(times[n]) / base} for n in sizes]}


def run(args: argparse.Namespace) -> int:
    import torch

    from specserve import LLM
    from specserve.step_batch import StepBatchBuilder
    from specserve.verify import DraftTree

    sizes = parse_sizes(args.sizes)
    for name in ("repeats", "branching", "prefix_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.peer and args.shape != "chain":
        raise ValueError("--peer llama.cpp times chains only (llama.cpp's batch has no tree mask): use --shape chain")
    set_threads(args.threads)
    llm = LLM(args.model, drafter=None, device=args.device, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=1)
    model, cfg = llm.model, llm.model.config
    prefix = args.prefix_tokens
    need = prefix + sizes[-1] + 1
    if need > llm.engine.config.max_model_len:
        raise ValueError(f"--prefix-tokens {prefix} + the largest size {sizes[-1]} + 1 exceed the context window "
                         f"({llm.engine.config.max_model_len})")
    cache = llm.engine.cache
    cache.allocator.allocate("bench", need)
    gen = torch.Generator().manual_seed(0)
    device = model.device

    def batch(ids: torch.Tensor, num_cached: int, positions=None, mask=None, logits="all"):
        builder = StepBatchBuilder(cache.allocator)
        builder.add("bench", num_cached, ids.numpy(), positions, mask, logits=logits)
        return builder.build()

    prompt = torch.randint(0, cfg.vocab_size, (prefix,), generator=gen)
    model.forward(batch(prompt, 0, logits="last"), cache)  # the committed prefix
    cases = {}
    for n in sizes:
        parents = torch.tensor(tree_parents(n, args.shape, args.branching), dtype=torch.int64)
        tree = DraftTree(torch.randint(0, cfg.vocab_size, (n,), generator=gen), parents)
        ids = torch.cat([torch.randint(0, cfg.vocab_size, (1,), generator=gen), tree.tokens])
        step = batch(ids, prefix, tree.positions(prefix).numpy(), tree.ancestor_mask.numpy() if n else None)
        cases[n] = (step, tree.max_depth)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(args.repeats + 2):  # two warm-up rounds
        for n, (step, _) in cases.items():
            sync(device)
            t0 = time.perf_counter()
            model.forward(step, cache)  # writes tree KV after the prefix; nothing is committed
            sync(device)
            if rep >= 2:
                times[n].append(time.perf_counter() - t0)
    cache.allocator.free("bench")
    kernels = getattr(model, "kernels", None)
    from specserve.kernels import get_threads

    threads = get_threads() if kernels is not None else torch.get_num_threads()
    limits = None
    if args.roofline and kernels is not None:
        from specserve.evals.roofline import memory_bandwidth, peak_rates

        bandwidth, rates = memory_bandwidth(threads), peak_rates(threads)
        one_row = forward_floor(kernels, 1, bandwidth, rates)
        limits = {"bandwidth_gb_s": bandwidth / 1e9, "peak_gmac_s": {"float32": rates.float32 / 1e9,
                  "int8": rates.int8 / 1e9, "int4": rates.int4 / 1e9}, "weight_bytes": kernels.bytes_read_per_token()}
    base = statistics.median(times[0])
    rows = []
    for n in sizes:
        med = statistics.median(times[n])
        row = {"nodes": n, "depth": cases[n][1], "ms": 1e3 * med, "ms_min": 1e3 * min(times[n]),
               "ms_max": 1e3 * max(times[n]), "relative": med / base}
        if limits:
            floor = forward_floor(kernels, n + 1, bandwidth, rates)
            row.update(floor_ms=1e3 * floor, floor_relative=floor / one_row,
                       efficiency=floor / med)
        rows.append(row)
    peer = measure_peer(args, sizes, prompt.tolist(), threads)
    result = {"model": args.model or "the default model", "shape": args.shape, "branching": args.branching,
              "prefix_tokens": prefix, "repeats": args.repeats, "device": str(device), "dtype": str(llm.dtype),
              "storages": sorted({p.storage for p in kernels.products()}) if kernels is not None else None, "threads": threads, "roofline": limits,
              "sizes": rows, "llama_cpp": peer}
    storages = sorted({p.storage for p in kernels.products()}) if kernels is not None else []
    storage = f", {' + '.join(storages)} products" if storages else ""
    print(f"verify forward cost vs tree size ({args.shape}, prefix {prefix}, {device}{storage}, {threads} threads)")
    if limits:
        print(f"roofline: {limits['bandwidth_gb_s']:.1f} GB/s streaming, peak multiply-adds {rates.float32 / 1e9:.0f} "
              f"(float32 FMA) / {rates.int8 / 1e9:.0f} (8-bit) / {rates.int4 / 1e9:.0f} (4-bit) G/s, "
              f"{limits['weight_bytes'] / 1e6:.1f} MB of weights")
    header = f"{'nodes':>6} {'depth':>6} {'ms':>9} {'min-max ms':>17} {'x N=0':>7}"
    if limits:
        header += f" {'floor ms':>9} {'floor x':>8} {'effic.':>7}"
    if peer:
        header += f" {'llama.cpp ms':>13} {'x N=0':>7}"
    print(header)
    for i, r in enumerate(rows):
        line = f"{r['nodes']:>6} {r['depth']:>6} {r['ms']:>9.3f} {r['ms_min']:>8.3f}-{r['ms_max']:<8.3f} {r['relative']:>7.2f}"
        if limits:
            line += f" {r['floor_ms']:>9.3f} {r['floor_relative']:>8.2f} {r['efficiency']:>7.2f}"
        if peer:
            line += f" {peer['sizes'][i]['ms']:>13.3f} {peer['sizes'][i]['relative']:>7.2f}"
        print(line)
    write_json(result, args.json)
    return 0
