"""``specserve train lm``: corpus → tokenizer → token streams → a Llama LM in Hugging Face layout.

The output directory is a model directory (``config.json``, ``model.safetensors``,
``generation_config.json``, tokenizer files) that `transformers.AutoModelForCausalLM` and
`specserve.LLM` load as is, plus the run's records: ``corpus_manifest.json``, ``train_log.jsonl``,
``loss_curve.png``, ``train_summary.json``, ``run_config.json``, the token streams (``data/``) and a
resumable ``checkpoint/``. The trainable module is transformers' `LlamaForCausalLM` (the reference
implementation); fp32 on CPU, bf16 autocast on CUDA.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from specserve.training import setup
from specserve.training.corpus import build_corpus
from specserve.training.data import (
    WindowSampler,
    encode_stream,
    eval_windows,
    load_stream,
    save_stream,
)
from specserve.training.outputs import prepare_out_dir, read_json, recorded_preset, save_hf_model, write_json
from specserve.training.presets import get_preset
from specserve.training.tokenizer import copy_tokenizer, load_tokenizer, train_tokenizer
from specserve.training.trainer import Trainer, barrier


def train_lm(
    out: str | Path,
    *,
    preset: str | None = None,
    corpus: list[str] | None = None,
    seq_len: int | None = None,
    tokenizer: str | Path | None = None,
    heldout_fraction: float = 0.05,
    **options,
) -> dict:
    """Train (or resume) one LM; return the run summary (also written to ``train_summary.json``).

    ``options``: the `setup.RunOptions` every training command takes (device, max_minutes, resume,
    force, max_steps, batch_size, lr, seed, stop_at_step, argv). A resumed run takes its recipe from its own
    ``run_config.json``; options given explicitly (e.g. ``max_minutes``, a larger ``max_steps``) override it.
    """
    run = setup.RunOptions.of("train_lm", options)
    out_dir = Path(out).expanduser()
    base = recorded_preset(out_dir, preset) if run.resume else get_preset(_require(preset), "lm")
    recipe = base.with_overrides(seq_len=seq_len, **run.overrides())
    settings = recipe.train
    with setup.distributed_run(run.device) as dist:
        if dist.is_main:
            prepare_out_dir(out_dir, resume=run.resume, force=run.force)
        barrier(dist)
        data_dir = out_dir / "data"
        if dist.is_main and not run.resume:
            _prepare_data(out_dir, recipe, corpus, tokenizer, heldout_fraction, settings.seed)
            write_json(out_dir / "run_config.json", {
                "command": "train lm", "argv": run.argv, "preset": recipe.to_dict(), "corpus": corpus,
                "tokenizer": str(tokenizer) if tokenizer else None, "heldout_fraction": heldout_fraction,
                "device": str(dist.device), "world_size": dist.world,
            })
        barrier(dist)
        if run.resume and not (data_dir / "train.npy").is_file():
            raise ValueError(f"--resume: {str(out_dir)!r} has no prepared data (data/train.npy): start a fresh run")
        tok = load_tokenizer(out_dir, "output directory")
        train_tokens, heldout_tokens = load_stream(data_dir / "train.npy"), load_stream(data_dir / "heldout.npy")

        shape = replace(recipe.shape, vocab_size=len(tok), max_positions=settings.seq_len).validate()
        torch.manual_seed(settings.seed)
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(shape.llama_config(tok.eos_token_id))
        if dist.is_main:
            print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters ({recipe.name}); "
                  f"train stream {len(train_tokens):,} tokens, held-out {len(heldout_tokens):,} tokens; device {dist.device}",
                  file=sys.stderr)
        sampler = WindowSampler(train_tokens, settings.seq_len, settings.batch_size, settings.seed)
        evalset = eval_windows(heldout_tokens, settings.seq_len, settings.eval_batches * settings.batch_size)

        def batch_fn(step: int, rank: int, world: int) -> torch.Tensor:
            return sampler.batch(step, rank, world).to(dist.device, non_blocking=True)

        def eval_fn(module) -> dict[str, float]:
            total, count = 0.0, 0
            for start in range(0, evalset.shape[0], settings.batch_size):
                chunk = evalset[start : start + settings.batch_size].to(dist.device)
                total += float(lm_loss(module, chunk)) * chunk.shape[0]
                count += chunk.shape[0]
            return {"eval_loss": total / count}

        trainer = Trainer(
            model, settings, out_dir, dist=dist, batch_fn=batch_fn, loss_fn=lm_loss, eval_fn=eval_fn,
            tokens_per_step=settings.batch_size * settings.seq_len,
            run_key={"shape": asdict(shape), "seq_len": settings.seq_len, "batch_size": settings.batch_size,
                     "seed": settings.seed, "lr": settings.lr},
            desc=f"train lm/{recipe.name}",
        )
        summary, started = setup.run_trainer(trainer, run)
        if dist.is_main:
            save_hf_model(trainer.module, out_dir, tok.eos_token_id)
            setup.finish_run(
                out_dir, summary, started, f"{recipe.name} LM ({shape.num_params() / 1e6:.2f}M params)",
                kind="lm", preset=recipe.name, num_params=sum(p.numel() for p in trainer.module.parameters()),
                shape=asdict(shape), vocab_size=len(tok),
                corpus_sha256=read_json(out_dir / "corpus_manifest.json").get("sha256"),
                tokens_per_s=round(summary["tokens"] / max(summary["train_seconds"], 1e-9), 1))
        barrier(dist)
        return summary


def _require(preset: str | None) -> str:
    if preset is None:
        raise ValueError("--preset is required for a new run (tiny or small)")
    return preset


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of windows ``batch`` int64[B, L+1] (inputs [:, :-1], targets [:, 1:])."""
    logits = model(input_ids=batch[:, :-1]).logits  # [B, L, V]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _prepare_data(out_dir: Path, recipe, corpus_paths, tokenizer_dir, heldout_fraction: float, seed: int) -> None:
    """Corpus manifest, tokenizer (trained or copied) and the encoded train / held-out streams."""
    t0 = time.perf_counter()
    corpus = build_corpus(corpus_paths, heldout_fraction=heldout_fraction, split_seed=0)
    corpus.write_manifest(out_dir / "corpus_manifest.json")
    print(corpus.summary(), file=sys.stderr)
    train_texts = corpus.texts("train", recipe.corpus_max_bytes)
    heldout_texts = corpus.texts("heldout")
    if tokenizer_dir is not None:
        load_tokenizer(tokenizer_dir, "--tokenizer directory")
        copy_tokenizer(Path(tokenizer_dir), out_dir)
    else:
        sample, size = [], 0
        for text in train_texts:
            if size >= recipe.tokenizer_sample_bytes:
                break
            sample.append(text)
            size += len(text)
        train_tokenizer(sample, recipe.vocab_size, out_dir)
    tok = load_tokenizer(out_dir, "output directory")
    data_dir = out_dir / "data"
    data_dir.mkdir(exist_ok=True)
    dtype = np.uint16 if len(tok) <= 65535 else np.int32
    train = encode_stream(train_texts, tok, tok.eos_token_id).astype(dtype)
    heldout = encode_stream(heldout_texts, tok, tok.eos_token_id).astype(dtype)
    save_stream(data_dir / "train.npy", train)
    save_stream(data_dir / "heldout.npy", heldout)
    print(f"data: {len(train):,} train / {len(heldout):,} held-out tokens "
          f"({sum(map(len, train_texts)) / max(len(train), 1):.2f} chars/token) in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
