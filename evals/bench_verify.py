"""`specserve bench verify`: what one target forward costs as the draft tree it verifies grows.

For each tree size N, one request with a committed prefix of --prefix-tokens runs the verify forward
the engine runs (root + N tree nodes under the tree's ancestor mask, logits for all N + 1 rows);
the figure is its median time relative to N = 0 (plain decoding's forward). Speculation pays while
τ exceeds that ratio. Sizes are measured interleaved, --repeats times each, after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specserve.evals.common import set_threads, sync, write_json
from specserve.cli import MODEL_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--sizes", default="0,1,2,4,8,16,32,64", help="comma-separated tree sizes (draft nodes)")
    p.add_argument("--shape", choices=("chain", "tree"), default="chain",
                   help="chain: one path N deep; tree: each node has --branching children (breadth first)")
    p.add_argument("--branching", type=int, default=2)
    p.add_argument("--prefix-tokens", type=int, default=128, help="committed tokens before the tree")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
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


def run(args: argparse.Namespace) -> int:
    import torch

    from specserve import LLM
    from specserve.step_batch import StepBatchBuilder
    from specserve.verify import DraftTree

    sizes = parse_sizes(args.sizes)
    for name in ("repeats", "branching", "prefix_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    set_threads(args.threads)
    llm = LLM(args.model, drafter=None, device=args.device, max_num_seqs=1)
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
    base = statistics.median(times[0])
    rows = []
    for n in sizes:
        med = statistics.median(times[n])
        rows.append({"nodes": n, "depth": cases[n][1], "ms": 1e3 * med, "ms_min": 1e3 * min(times[n]),
                     "ms_max": 1e3 * max(times[n]), "relative": med / base})
    result = {"model": args.model or "embedded default model", "shape": args.shape, "branching": args.branching,
              "prefix_tokens": prefix, "repeats": args.repeats, "device": str(device), "dtype": str(llm.dtype),
              "threads": torch.get_num_threads(), "sizes": rows}
    print(f"verify forward cost vs tree size ({args.shape}, prefix {prefix}, {device}, {torch.get_num_threads()} threads)")
    print(f"{'nodes':>6} {'depth':>6} {'ms':>9} {'min-max ms':>17} {'x N=0':>7}")
    for r in rows:
        print(f"{r['nodes']:>6} {r['depth']:>6} {r['ms']:>9.3f} {r['ms_min']:>8.3f}-{r['ms_max']:<8.3f} {r['relative']:>7.2f}")
    write_json(result, args.json)
    return 0
