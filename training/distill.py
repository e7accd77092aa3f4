"""``specserve train distill-data``: the target's own continuations of corpus prompts, with soft labels.

Drafters must learn the *target's* distribution, not the corpus'. So: take prompts (windows of corpus
text: the train split for training data, the held-out split for evaluation data), let the target
continue them with the specserve engine (batched, speculation on: the ``ngram`` drafter by default;
sampled at ``temperature`` so continuations are draws from the target), then run the target once more
over prompt + continuation and keep, at every position, the top-k of its next-token log-probabilities.

Output directory::

    distill_manifest.json           target, tokenizer fingerprint, settings, counts, speed, completeness
    train_00000.safetensors ...     shards of ``shard_size`` sequences
    heldout_00000.safetensors ...

Each shard holds, for n sequences padded to T = prompt_tokens + new_tokens:
``tokens`` int32[n, T] (padding: EOS), ``lengths`` int32[n], ``prompt_lengths`` int32[n],
``topk_ids`` int16/int32[n, T, k] and ``topk_logprobs`` float16[n, T, k] — row t is the target's
distribution of the token *after* position t (log-probabilities at temperature 1, best first).
Shards are written whole and the prompts are a pure function of the seed, so ``--resume`` skips the
shards already written and produces the same data as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from specserve.training.corpus import build_corpus, corpus_from_manifest
from specserve.training.data import encode_stream, load_stream
from specserve.training.outputs import prepare_out_dir, read_json, write_json, write_shard
from specserve.training.presets import check_float, check_int
from specserve.training.tokenizer import load_tokenizer, tokenizer_fingerprint

MANIFEST = "distill_manifest.json"
# Engine decoding of small models gains little from a second CPU thread, and OpenMP threads that
# wait on each other collapse (50x measured) when another process shares the cores: generate and
# score on one.
GEN_THREADS_CPU = 1


@dataclass(frozen=True)
class DistillSettings:
    num_prompts: int = 2048
    heldout_prompts: int = 64
    prompt_tokens: int = 48
    new_tokens: int = 160
    temperature: float = 1.0
    topk: int = 16
    batch_size: int = 32
    shard_size: int = 128
    drafter: str | None = "ngram"
    seed: int = 0

    def validate(self, max_positions: int, vocab_size: int) -> "DistillSettings":
        check_int("num_prompts", self.num_prompts, 1, 1 << 24)
        check_int("heldout_prompts", self.heldout_prompts, 0, 1 << 24)
        check_int("prompt_tokens", self.prompt_tokens, 1, max_positions - 1)
        check_int("new_tokens", self.new_tokens, 1, max_positions - self.prompt_tokens)
        check_int("topk", self.topk, 1, min(vocab_size, 256))
        check_int("batch_size", self.batch_size, 1, 4096)
        check_int("shard_size", self.shard_size, 1, 1 << 20)
        check_int("seed", self.seed, 0, 2**31 - 1)
        check_float("temperature", self.temperature, 0, 10, low_open=True)
        return self


def make_distill_data(
    target: str | Path,
    out: str | Path,
    settings: DistillSettings = DistillSettings(),
    *,
    corpus: list[str] | None = None,
    device: str = "auto",
    max_minutes: float | None = None,
    resume: bool = False,
    force: bool = False,
) -> dict:
    """Generate (or complete, with ``resume``) the distillation data of ``target``; return the manifest."""
    from transformers import AutoConfig

    target_dir = Path(target).expanduser().resolve()
    tok = load_tokenizer(target_dir, "target directory")
    config = AutoConfig.from_pretrained(str(target_dir))
    settings.validate(config.max_position_embeddings, config.vocab_size)
    if max_minutes is not None and not (isinstance(max_minutes, (int, float)) and max_minutes > 0):
        raise ValueError(f"max_minutes must be > 0, got {max_minutes!r}")
    out_dir = prepare_out_dir(Path(out), resume=resume, force=force)
    fingerprint = tokenizer_fingerprint(target_dir)
    manifest = {
        "target": str(target_dir), "target_tokenizer": fingerprint, "settings": settings.__dict__,
        "vocab_size": config.vocab_size, "shards": {"train": [], "heldout": []}, "complete": False,
    }
    if resume and (out_dir / MANIFEST).is_file():
        old = read_json(out_dir / MANIFEST)
        if old.get("settings") != manifest["settings"] or old.get("target_tokenizer") != fingerprint:
            raise ValueError(f"--resume: {str(out_dir)!r} was made with other settings or another target tokenizer")
        manifest = old
        if manifest.get("complete"):
            return manifest

    prompts = {
        "train": _sample_prompts(target_dir, corpus, tok, "train", settings.num_prompts, settings, seed_offset=0),
        "heldout": _sample_prompts(target_dir, corpus, tok, "heldout", settings.heldout_prompts, settings, seed_offset=1),
    }
    from transformers import AutoModelForCausalLM

    from specserve import LLM

    # Static speculation: a seeded sample depends on the draft trees it was verified against, and the
    # adaptive policy sizes those from measured timings, so only fixed budgets make --resume reproduce
    # an uninterrupted run (any budget gives draws from the target; only the reproducibility differs).
    llm = LLM(target_dir, drafter=settings.drafter, device=device, max_num_seqs=settings.batch_size,
              max_model_len=settings.prompt_tokens + settings.new_tokens, speculation="static")
    teacher = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=llm.dtype).to(llm.device).eval()
    started = time.perf_counter()
    budget_s = None if max_minutes is None else max_minutes * 60.0
    stats = manifest.setdefault("stats", {"new_tokens": 0, "steps": 0, "emitted": 0, "generate_s": 0.0, "score_s": 0.0})
    from tqdm import tqdm

    stopped = False
    for split in ("train", "heldout"):
        split_prompts = prompts[split]
        num_shards = -(-len(split_prompts) // settings.shard_size)
        done = set(manifest["shards"][split])
        bar = tqdm(total=len(split_prompts), desc=f"distill {split}", unit="seq", file=sys.stderr, dynamic_ncols=True,
                   initial=min(len(done) * settings.shard_size, len(split_prompts)))
        for shard in range(num_shards):
            name = f"{split}_{shard:05d}.safetensors"
            if name in done and (out_dir / name).is_file():
                continue
            if budget_s is not None and time.perf_counter() - started >= budget_s:
                stopped = True
                break
            lo = shard * settings.shard_size
            chunk = split_prompts[lo : lo + settings.shard_size]
            rows = []
            for b in range(0, len(chunk), settings.batch_size):
                batch = chunk[b : b + settings.batch_size]
                seeds = [settings.seed * 1_000_003 + (0 if split == "train" else 1 << 24) + lo + b + i for i in range(len(batch))]
                with cpu_threads(GEN_THREADS_CPU if llm.device.type == "cpu" else None):
                    rows.extend(_generate_and_score(llm, teacher, tok, batch, seeds, settings, stats))
                bar.update(len(batch))
            _write_shard(out_dir / name, rows, settings, tok.eos_token_id, config.vocab_size)
            manifest["shards"][split] = sorted(set(manifest["shards"][split]) | {name})
            write_json(out_dir / MANIFEST, manifest)
        bar.close()
        if stopped:
            break
    manifest["complete"] = not stopped
    manifest["counts"] = {s: _count(out_dir, manifest["shards"][s]) for s in ("train", "heldout")}
    stats["mean_accepted_length"] = round(stats["emitted"] / max(stats["steps"], 1), 3)
    stats["new_tokens_per_s"] = round(stats["new_tokens"] / max(stats["generate_s"], 1e-9), 1)
    stats["generate_threads"] = GEN_THREADS_CPU if llm.device.type == "cpu" else None
    write_json(out_dir / MANIFEST, manifest)
    print(f"distill data: {manifest['counts']['train']['sequences']} train / {manifest['counts']['heldout']['sequences']} "
          f"held-out sequences, {stats['new_tokens_per_s']:.0f} generated tokens/s (tau {stats['mean_accepted_length']:.2f})"
          + ("" if manifest["complete"] else " — stopped by the time budget, --resume to finish"), file=sys.stderr)
    return manifest


def _sample_prompts(
    target_dir: Path, corpus_paths, tok, split: str, count: int, s: DistillSettings, seed_offset: int
) -> list[list[int]]:
    """``count`` windows of ``prompt_tokens`` tokens from the split's token stream (seeded)."""
    if count == 0:
        return []
    stream_file = target_dir / "data" / f"{split}.npy"
    if corpus_paths is None and stream_file.is_file():
        stream = load_stream(stream_file)  # the target's own training streams: same tokenizer, same split
    else:
        if corpus_paths is None and (target_dir / "corpus_manifest.json").is_file():
            corpus = corpus_from_manifest(read_json(target_dir / "corpus_manifest.json"))
        else:
            corpus = build_corpus(corpus_paths)
        stream = encode_stream(corpus.texts(split, 16 << 20), tok, tok.eos_token_id).astype(np.int64)
    if len(stream) <= s.prompt_tokens:
        raise ValueError(f"the {split} split has {len(stream)} tokens, too few for prompts of {s.prompt_tokens} tokens")
    rng = np.random.default_rng([s.seed, seed_offset])
    starts = rng.integers(0, len(stream) - s.prompt_tokens, size=count)
    return [stream[a : a + s.prompt_tokens].tolist() for a in starts]


def _generate_and_score(
    llm, teacher, tok, prompts: list[list[int]], seeds: list[int], s: DistillSettings, stats: dict
) -> list[dict]:
    """Continue ``prompts`` with the engine, then score prompt + continuation with the target (top-k)."""
    from specserve import SamplingParams

    t0 = time.perf_counter()
    params = [SamplingParams(temperature=s.temperature, max_tokens=s.new_tokens, seed=seed) for seed in seeds]
    outs = llm.generate(prompts, params)
    t1 = time.perf_counter()
    stats["generate_s"] += t1 - t0
    for o in outs:
        stats["new_tokens"] += len(o.token_ids)
        stats["steps"] += o.spec.num_steps
        stats["emitted"] += o.spec.num_emitted
    total = s.prompt_tokens + s.new_tokens
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    ids = torch.full((len(seqs), total), tok.eos_token_id, dtype=torch.int64)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
    with torch.no_grad():
        logits = teacher(input_ids=ids.to(llm.device)).logits.float()  # [B, T, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        values, indices = logprobs.topk(s.topk, dim=-1)  # [B, T, k], best first
    stats["score_s"] += time.perf_counter() - t1
    return [
        {"tokens": ids[i], "length": len(seqs[i]), "prompt_length": len(prompts[i]),
         "topk_ids": indices[i].cpu(), "topk_logprobs": values[i].cpu()}
        for i in range(len(seqs))
    ]


@contextlib.contextmanager
def cpu_threads(count: int | None):
    """Run a block with ``count`` torch CPU threads (None: unchanged)."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(min(count, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_shard(path: Path, rows: list[dict], s: DistillSettings, eos_id: int, vocab_size: int) -> None:
    id_dtype = torch.int16 if vocab_size <= 32768 else torch.int32
    tensors = {
        "tokens": torch.stack([r["tokens"] for r in rows]).to(torch.int32),
        "lengths": torch.tensor([r["length"] for r in rows], dtype=torch.int32),
        "prompt_lengths": torch.tensor([r["prompt_length"] for r in rows], dtype=torch.int32),
        "topk_ids": torch.stack([r["topk_ids"] for r in rows]).to(id_dtype),
        "topk_logprobs": torch.stack([r["topk_logprobs"] for r in rows]).to(torch.float16),
    }
    write_shard(path, tensors)


def _count(out_dir: Path, shards: list[str]) -> dict:
    from safetensors import safe_open

    sequences = tokens = 0
    for name in shards:
        with safe_open(str(out_dir / name), "pt") as f:
            lengths = f.get_tensor("lengths")
        sequences += lengths.numel()
        tokens += int(lengths.sum())
    return {"sequences": sequences, "tokens": tokens}


@dataclass
class DistillSet:
    """A split of distillation data, in memory.

    tokens int64[N, T]; lengths int64[N]; topk_ids int64[N, T, k]; topk_logprobs float16[N, T, k].
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, n: int) -> DistillSet:
        """The first ``n`` sequences."""
        return DistillSet(self.tokens[:n], self.lengths[:n], self.topk_ids[:n], self.topk_logprobs[:n])


def load_distill(data_dir: str | Path, split: str) -> tuple[DistillSet | None, dict]:
    """The split's sequences (None when it has none) and the manifest. ValueError when it is not distill data."""
    from safetensors.torch import load_file

    data_dir = Path(data_dir).expanduser()
    if not (data_dir / MANIFEST).is_file():
        raise ValueError(
            f"{str(data_dir)!r} is not distillation data ({MANIFEST} is missing): run `specserve train distill-data`"
        )
    manifest = read_json(data_dir / MANIFEST)
    parts = [load_file(str(data_dir / name)) for name in manifest["shards"].get(split, [])]
    if not parts:
        return None, manifest
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return DistillSet(cat["tokens"].long(), cat["lengths"].long(), cat["topk_ids"].long(), cat["topk_logprobs"]), manifest


def run_distill_dir(out_dir: Path, data: str | Path | None) -> Path:
    """The data a drafter run trains on: ``data`` when given, else the run's own ``OUT/distill``."""
    return Path(data).expanduser() if data is not None else out_dir / "distill"


def make_run_distill_data(target_dir: Path, out_dir: Path, settings: DistillSettings, device: str) -> None:
    """Generate a drafter run's own data in ``OUT/distill`` (completing a partial one)."""
    distill_dir = run_distill_dir(out_dir, None)
    make_distill_data(target_dir, distill_dir, settings, device=device, resume=distill_dir.is_dir(), force=False)


def load_training_distill(
    data_dir: Path, target_dir: Path, *, warn: bool = True
) -> tuple[DistillSet, DistillSet | None, dict]:
    """(train, held-out or None, manifest) of the data a drafter of ``target_dir`` trains on.

    ValueError when the data has no training sequences or was made with another tokenizer than the
    target's (checked when the target has a ``tokenizer.json``); ``warn``: say so when it is incomplete.
    """
    train_set, manifest = load_distill(data_dir, "train")
    heldout_set, _ = load_distill(data_dir, "heldout")
    if train_set is None:
        raise ValueError(f"{str(data_dir)!r} holds no training sequences")
    if (target_dir / "tokenizer.json").is_file() and manifest.get("target_tokenizer") != tokenizer_fingerprint(target_dir):
        raise ValueError(f"the distillation data in {str(data_dir)!r} was made with another tokenizer than "
                         f"{str(target_dir)!r}'s")
    if warn and not manifest.get("complete", False):
        print("warning: the distillation data is incomplete (its run stopped early)", file=sys.stderr)
    return train_set, heldout_set, manifest
