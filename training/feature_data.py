"""``specserve train feature-data``: chat answers of the served target, with the features EAGLE-3 trains on.

Self-distillation for a GGUF (or any) target, captured once so that training never runs the target:

1. **prompts** — chat questions built offline from the corpus (training/chat_prompts.py), the corpus'
   train split for training data and its held-out split for evaluation data;
2. **answers** — the target answers them through the specserve engine on the weights it serves (a GGUF
   file's own Q4_1 kernels), batched, with its chat template; a seeded half greedy, the rest sampled at
   ``temperature`` (drafters serve both);
3. **features** — captured by the steps that decode the answer, no second pass: the engine hands each
   request the hidden states at ``feature_layers`` of every row its prefill and decode steps ran
   (``SamplingParams.return_hidden_states``) and the target's raw top-k log-probabilities after every prompt
   and answer token (``prompt_logprobs`` / ``logprobs``). These are the rows serving computes (a verify's rows
   equal them bitwise: batch invariance). The answer's last token is no row: no step fed it back.

Output directory::

    feature_manifest.json          target file and sha256, feature layers, settings, counts, throughput
    train_00000.safetensors ...    shards of ``shard_size`` sequences, packed (no padding):
    heldout_00000.safetensors ...

Each shard, for n sequences of N tokens in all: ``tokens`` int32[N], ``offsets`` int64[n+1] (sequence i
is rows offsets[i]..offsets[i+1]-1), ``prompt_lengths`` int32[n], ``features`` float16[N, F, H] (layer
order as ``feature_layers``), ``topk_ids`` int32[N, k] and ``topk_logprobs`` float16[N, k] — row t is the
target's distribution of the token *after* position t. ``--resume`` skips the shards written (prompts,
seeds and greedy/sampled choices are pure functions of the seed).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay out of the CLI's start-up: functions import them
    import numpy as np
    import torch

MANIFEST = "feature_manifest.json"


@dataclass(frozen=True)
class FeatureSettings:
    num_prompts: int = 2048
    heldout_prompts: int = 48
    new_tokens: int = 128
    max_prompt_tokens: int = 384
    greedy_fraction: float = 0.5
    temperature: float = 0.8
    topk: int = 16
    batch_size: int = 16
    shard_size: int = 64
    seed: int = 0
    # Every kind of question each definition allows (training/chat_prompts.py), not one drawn kind: ~3.4x
    # the prompts, the way past one question per definition when a drafter needs more data.
    every_kind: bool = False

    def validate(self) -> "FeatureSettings":
        from specserve.defaults import MAX_LOGPROBS
        from specserve.training.presets import check_float, check_int

        check_int("num_prompts", self.num_prompts, 1, 1 << 24)
        check_int("heldout_prompts", self.heldout_prompts, 0, 1 << 24)
        check_int("new_tokens", self.new_tokens, 1, 1 << 16)
        check_int("max_prompt_tokens", self.max_prompt_tokens, 8, 1 << 16)
        check_float("greedy_fraction", self.greedy_fraction, 0, 1)
        check_float("temperature", self.temperature, 0, 10, low_open=True)
        check_int("topk", self.topk, 1, MAX_LOGPROBS)  # the engine's log-probabilities carry at most this many
        check_int("batch_size", self.batch_size, 1, 4096)
        check_int("shard_size", self.shard_size, 1, 1 << 20)
        check_int("seed", self.seed, 0, 2**31 - 1)
        return self


def make_feature_data(
    model: str | Path | None,
    out: str | Path,
    settings: FeatureSettings = FeatureSettings(),
    *,
    feature_layers: tuple[int, ...] | None = None,
    corpus: list[str] | None = None,
    heldout_fraction: float = 0.05,
    threads: int | None = None,
    device: str = "auto",
    dtype: str | None = None,
    max_minutes: float | None = None,
    resume: bool = False,
    force: bool = False,
) -> dict:
    """Generate (or complete, with ``resume``) the feature data of ``model`` (None: the default model).

    ``device``: where the target answers — the CPU kernels, or a GPU (``cuda``; ``auto`` takes one when there
    is one), same command and same data layout either way. ``dtype``: the torch layers' (None: the engine's,
    bfloat16 on a GPU; float32 keeps a GPU's features nearer the CPU kernels' that serve the head)."""
    import torch  # noqa: F401  (heavy imports stay out of the CLI's start-up)
    from tqdm import tqdm

    from specserve import LLM
    from specserve.device import resolve_device
    from specserve.drafters.eagle_head import default_feature_layers
    from specserve.loading import open_checkpoint, resolve_model
    from specserve.training.chat_prompts import chat_prompts
    from specserve.training.corpus import build_corpus
    from specserve.training.outputs import prepare_out_dir, read_json, write_json

    settings.validate()
    if max_minutes is not None and not (isinstance(max_minutes, (int, float)) and max_minutes > 0):
        raise ValueError(f"max_minutes must be > 0, got {max_minutes!r}")
    out_dir = prepare_out_dir(Path(out), resume=resume, force=force)
    # (the engine refuses layers outside the model with one line)
    layers = tuple(feature_layers or default_feature_layers(
        "eagle3", open_checkpoint(resolve_model(model)).config.num_layers))
    on_gpu = resolve_device(device).type == "cuda"
    # A GPU prefills a whole batch's prompts in a few steps (the CPU default, 128 tokens a step, would take one
    # step per 128 prompt tokens); 16,384 rows keep the prefill's full-vocabulary logits near 3 GB.
    prefill_tokens = min(16384, settings.batch_size * settings.max_prompt_tokens) if on_gpu else 128
    llm = LLM(model, drafter=None, device=device, dtype=dtype, max_num_seqs=settings.batch_size, threads=threads,
              max_model_len=settings.max_prompt_tokens + settings.new_tokens, speculation="static",
              capture_layers=layers, max_prefill_tokens=prefill_tokens)
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError(f"{llm.model_dir!r} has no chat template: feature data is built from chat prompts")
    cfg = llm.model.config
    target = target_identity(llm.model_dir)
    manifest = {"kind": "eagle_features", "target": target, "feature_layers": list(layers), "settings": settings.__dict__,
                "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "shards": {"train": [], "heldout": []},
                "prompt_source": "training/chat_prompts.py over the corpus' splits", "complete": False}
    if resume and (out_dir / MANIFEST).is_file():
        old = read_json(out_dir / MANIFEST)
        # A setting added since the data was made reads as its default (data made before --every-kind resumes).
        old_settings = {**FeatureSettings().__dict__, **old.get("settings", {})}
        if old_settings != manifest["settings"] or old.get("target") != target or old.get("feature_layers") != list(layers):
            raise ValueError(f"--resume: {str(out_dir)!r} was made with other settings, layers or another target")
        manifest = old
        if manifest.get("complete"):
            return manifest

    source = build_corpus(corpus, heldout_fraction=heldout_fraction)
    prompts = {split: chat_prompts(source, split, count, settings.seed, every_kind=settings.every_kind)
               for split, count in (("train", settings.num_prompts), ("heldout", settings.heldout_prompts))}
    stats = manifest.setdefault("stats", {"prompts_too_long": 0, "new_tokens": 0, "tokens": 0, "generate_s": 0.0,
                                          "pack_s": 0.0})
    started = time.perf_counter()
    stopped = False
    for split in ("heldout", "train"):  # held-out first (small): a run the time budget stops can still be evaluated
        chunk_size = settings.shard_size
        split_prompts = prompts[split]
        done = set(manifest["shards"][split])
        bar = tqdm(total=len(split_prompts), desc=f"features {split}", unit="seq", file=sys.stderr, dynamic_ncols=True)
        for shard, lo in enumerate(range(0, len(split_prompts), chunk_size)):
            name = f"{split}_{shard:05d}.safetensors"
            if name in done and (out_dir / name).is_file():
                bar.update(len(split_prompts[lo : lo + chunk_size]))
                continue
            if max_minutes is not None and time.perf_counter() - started >= max_minutes * 60:
                stopped = True
                break
            rows = []
            chunk = split_prompts[lo : lo + chunk_size]
            for b in range(0, len(chunk), settings.batch_size):
                batch = chunk[b : b + settings.batch_size]
                index = [(0 if split == "train" else 1 << 24) + lo + b + i for i in range(len(batch))]
                rows.extend(_answer_and_capture(llm, batch, index, layers, settings, stats))
                bar.update(len(batch))
            if rows:
                _write_shard(out_dir / name, rows)
            manifest["shards"][split] = sorted(set(manifest["shards"][split]) | {name})
            write_json(out_dir / MANIFEST, manifest)
        bar.close()
        if stopped:
            break
    manifest["complete"] = not stopped
    manifest["counts"] = {s: _count(out_dir, manifest["shards"][s]) for s in ("train", "heldout")}
    seconds = max(stats["generate_s"] + stats["pack_s"], 1e-9)
    stats["generated_tokens_per_s"] = round(stats["new_tokens"] / seconds, 1)
    stats["rows_per_s"] = round(stats["tokens"] / seconds, 1)
    stats["threads"] = threads
    stats["device"] = str(llm.device)
    write_json(out_dir / MANIFEST, manifest)
    llm.close()
    print(f"feature data: {manifest['counts']['train']['sequences']} train / {manifest['counts']['heldout']['sequences']} "
          f"held-out sequences ({manifest['counts']['train']['tokens']} train tokens); generated "
          f"{stats['generated_tokens_per_s']:.0f} tokens/s with their features ({stats['rows_per_s']:.0f} rows/s, "
          f"prompts included)"
          + ("" if manifest["complete"] else " — stopped by the time budget, --resume to finish"), file=sys.stderr)
    return manifest


def target_identity(model_path: str | Path) -> dict:
    """What names a target: its path and fingerprint (a GGUF file: its sha256; a directory: its config's)."""
    from specserve.drafters.eagle_checkpoint import target_fingerprint

    path = Path(model_path).expanduser().resolve()
    return {"path": str(path), **target_fingerprint(path)}


def _answer_and_capture(llm, prompts, index: list[int], layers: tuple[int, ...], s: FeatureSettings,
                        stats: dict) -> list[dict]:
    """The target's answers to ``prompts`` (chat messages), each row's features and top-k labels captured by
    the very steps that decode it (no second pass)."""
    import numpy as np

    from specserve import SamplingParams

    encoded, params = [], []
    for prompt, i in zip(prompts, index):
        ids = llm.tokenizer.apply_chat_template(prompt.messages(), add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if len(ids) > s.max_prompt_tokens:
            stats["prompts_too_long"] += 1
            continue
        greedy = np.random.default_rng([s.seed, i]).random() < s.greedy_fraction
        encoded.append(ids)
        params.append(SamplingParams(temperature=0.0 if greedy else s.temperature, max_tokens=s.new_tokens,
                                     seed=s.seed * 1_000_003 + i, logprobs=s.topk, prompt_logprobs=s.topk,
                                     return_hidden_states=True))
    if not encoded:
        return []
    t0 = time.perf_counter()
    outs = llm.generate(encoded, params)
    t1 = time.perf_counter()
    stats["generate_s"] += t1 - t0
    rows = [sequence_rows(o, layers, s.topk) for o in outs]
    for o, row in zip(outs, rows):
        stats["new_tokens"] += len(o.token_ids)
        stats["tokens"] += len(row["tokens"])
    stats["pack_s"] += time.perf_counter() - t1
    return rows


def sequence_rows(out, layers: tuple[int, ...], k: int) -> dict:
    """One answered request (`RequestOutput` with hidden states, logprobs and prompt logprobs of top-k) as a
    shard's rows: row t is token t of prompt + answer with its features and the target's top-k distribution
    of token t + 1 — prompt_logprobs[t + 1] inside the prompt, logprobs[t + 1 - P] after it. Every token but
    the answer's last has such a row (no step fed the last one back)."""
    import numpy as np
    import torch

    prompt_length = len(out.prompt_token_ids)
    seq = out.prompt_token_ids + out.token_ids
    rows = min(len(next(iter(out.hidden_states.values()))), len(seq) - 1)
    labels = out.prompt_logprobs[1:] + out.logprobs  # labels[t]: the distribution of token t + 1
    top = [entry.top for entry in labels[:rows]]
    ids = np.array([[tok for tok, _ in entry] for entry in top], dtype=np.int32).reshape(rows, k)
    logprobs = np.array([[value for _, value in entry] for entry in top], dtype=np.float32).reshape(rows, k)
    return {"tokens": torch.tensor(seq[:rows], dtype=torch.int32), "prompt_length": prompt_length,
            "features": torch.stack([out.hidden_states[layer][:rows] for layer in layers], dim=1).to(torch.float16),
            "topk_ids": torch.from_numpy(ids), "topk_logprobs": torch.from_numpy(logprobs).to(torch.float16)}


def _write_shard(path: Path, rows: list[dict]) -> None:
    import numpy as np
    import torch

    from specserve.training.outputs import write_shard

    lengths = [len(r["tokens"]) for r in rows]
    tensors = {
        "tokens": torch.cat([r["tokens"] for r in rows]),
        "offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        "prompt_lengths": torch.tensor([r["prompt_length"] for r in rows], dtype=torch.int32),
        "features": torch.cat([r["features"] for r in rows]),
        "topk_ids": torch.cat([r["topk_ids"] for r in rows]),
        "topk_logprobs": torch.cat([r["topk_logprobs"] for r in rows]),
    }
    write_shard(path, tensors)


def _count(out_dir: Path, shards: list[str]) -> dict:
    from safetensors import safe_open

    sequences = tokens = 0
    for name in shards:
        if not (out_dir / name).is_file():
            continue
        with safe_open(str(out_dir / name), "pt") as f:
            offsets = f.get_tensor("offsets")
        sequences += len(offsets) - 1
        tokens += int(offsets[-1])
    return {"sequences": sequences, "tokens": tokens}


@dataclass
class FeatureSet:
    """A split of feature data in memory, packed: sequence i is rows offsets[i]..offsets[i+1]-1.

    tokens int64[N]; offsets int64[n+1]; prompt_lengths int64[n]; features float16[N, F, H];
    topk_ids int64[N, k]; topk_logprobs float16[N, k].
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    prompt_lengths: torch.Tensor
    features: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def token_counts(self, vocab: int) -> torch.Tensor:
        return torch.bincount(self.tokens, minlength=vocab)

    def padded(self, ids: torch.Tensor, layers: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Sequences ``ids`` padded to the longest: tokens int64[B, T], mask bool[B, T] (t < length), features
        float32[B, T, F', H] (the feature layers at indices ``layers``, default all), topk_ids int64[B, T, k] (0
        past a length) and topk_logprobs float32[B, T, k] (-inf past a length)."""
        import torch

        ids = torch.as_tensor(ids)
        starts, ends = self.offsets[ids], self.offsets[ids + 1]
        b, t, k = len(ids), int((ends - starts).max()), self.topk_ids.shape[1]
        layers = list(range(self.features.shape[1])) if layers is None else list(layers)
        out = {"tokens": torch.zeros(b, t, dtype=torch.int64), "mask": torch.zeros(b, t, dtype=torch.bool),
               "features": torch.zeros(b, t, len(layers), self.features.shape[2]),
               "topk_ids": torch.zeros(b, t, k, dtype=torch.int64), "topk_logprobs": torch.full((b, t, k), float("-inf"))}
        for row, (lo, hi) in enumerate(zip(starts.tolist(), ends.tolist())):
            n = hi - lo
            out["tokens"][row, :n], out["mask"][row, :n] = self.tokens[lo:hi], True
            out["features"][row, :n] = self.features[lo:hi, layers].float()  # per sequence: no copy of the whole set
            out["topk_ids"][row, :n], out["topk_logprobs"][row, :n] = self.topk_ids[lo:hi], self.topk_logprobs[lo:hi].float()
        return out


def load_features(data_dir: str | Path, split: str) -> tuple[FeatureSet | None, dict]:
    """The split's sequences (None when it has none) and the manifest; ValueError when it is not feature data."""
    import torch
    from safetensors.torch import load_file

    from specserve.training.outputs import read_json

    data_dir = Path(data_dir).expanduser()
    if not (data_dir / MANIFEST).is_file():
        raise ValueError(f"{str(data_dir)!r} is not feature data ({MANIFEST} is missing): run `specserve train feature-data`")
    manifest = read_json(data_dir / MANIFEST)
    parts = [load_file(str(data_dir / name)) for name in manifest["shards"].get(split, []) if (data_dir / name).is_file()]
    if not parts:
        return None, manifest
    offsets, base = [torch.zeros(1, dtype=torch.int64)], 0
    for p in parts:
        offsets.append(p["offsets"][1:] + base)
        base += int(p["offsets"][-1])
    cat = {k: torch.cat([p[k] for p in parts]) for k in ("tokens", "prompt_lengths", "features", "topk_ids", "topk_logprobs")}
    return FeatureSet(cat["tokens"].long(), torch.cat(offsets), cat["prompt_lengths"].long(), cat["features"],
                      cat["topk_ids"].long(), cat["topk_logprobs"]), manifest


def is_feature_data(data_dir: str | Path | None) -> bool:
    return data_dir is not None and (Path(data_dir).expanduser() / MANIFEST).is_file()


# ---- command line -------------------------------------------------------------------------------


def add_feature_data_args(p) -> None:
    """``train feature-data``'s own arguments (corpus and budget arguments come from training/cli.py)."""
    d = FeatureSettings()
    p.add_argument("--model", default=None, help="the target: a GGUF file or a model directory (default: the default model)")
    p.add_argument("--out", required=True, help="output data directory")
    p.add_argument("--feature-layers", default=None,
                   help="target layers to capture, comma-separated, transformers numbering (default: EAGLE-3's)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help=f"train prompts (default {d.num_prompts})")
    p.add_argument("--heldout-prompts", type=int, default=d.heldout_prompts,
                   help=f"held-out prompts (default {d.heldout_prompts})")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help=f"answer tokens (default {d.new_tokens})")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help=f"longer chat prompts are skipped (default {d.max_prompt_tokens})")
    p.add_argument("--greedy-fraction", type=float, default=d.greedy_fraction,
                   help=f"share of answers decoded greedily; the rest are sampled (default {d.greedy_fraction})")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help=f"temperature of the sampled answers (default {d.temperature})")
    p.add_argument("--topk", type=int, default=d.topk, help=f"soft-label top-k (default {d.topk})")
    p.add_argument("--gen-batch-size", type=int, default=d.batch_size,
                   help=f"prompts answered per engine batch (default {d.batch_size})")
    p.add_argument("--data-seed", type=int, default=d.seed, help="seed of the prompts and sampling (default 0)")
    p.add_argument("--every-kind", action="store_true",
                   help="ask every kind of question each corpus definition allows (write, explain, review, edit), "
                        "not one drawn kind: ~3.4x the prompts")


def parse_feature_layers(text: str | None, flag: str = "--feature-layers") -> tuple[int, ...] | None:
    """``--feature-layers "2,15,27"`` (or another ``flag`` naming layers) → (2, 15, 27); None when not given.
    ValueError (one line) otherwise."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from exc


def cmd_feature_data(args) -> int:
    import json

    layers = parse_feature_layers(args.feature_layers)
    settings = FeatureSettings(num_prompts=args.num_prompts, heldout_prompts=args.heldout_prompts,
                               new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                               greedy_fraction=args.greedy_fraction, temperature=args.temperature, topk=args.topk,
                               batch_size=args.gen_batch_size, seed=args.data_seed, every_kind=args.every_kind)
    manifest = make_feature_data(args.model, args.out, settings, feature_layers=layers, corpus=args.corpus,
                                 heldout_fraction=args.heldout_fraction, threads=args.threads, device=args.device,
                                 dtype=args.dtype, max_minutes=args.max_minutes, resume=args.resume, force=args.force)
    print(json.dumps({"out": args.out, "complete": manifest["complete"], "counts": manifest["counts"],
                      "stats": manifest["stats"]}))
    return 0
