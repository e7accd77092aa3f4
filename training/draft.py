"""``specserve train draft``: a small LM sharing the target's tokenizer, distilled from the target.

Loss: KL(p_target || q_draft) at every position of the distillation sequences, with p the target's
top-k next-token distribution renormalised over its k tokens (the rest of its mass is negligible for
k >= 16 and unknown anyway). Held-out metrics on the held-out prompts' sequences:

- ``eval_loss``   the same KL (nats/token);
- ``top1_agree``  how often the draft's argmax equals the target's (greedy acceptance of one token);
- ``accept_t1``   sum over the target's top-k of min(p, q) — a lower bound on the probability that a
                  single sampled draft token is accepted at temperature 1 (1 - total variation).

The output is a model directory in Hugging Face layout, with the target's tokenizer files and
``draft_config.json`` naming the target; ``draft:OUT`` serves it as a drafter.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from specserve.training import setup
from specserve.training.data import IndexSampler
from specserve.training.distill import DistillSettings
from specserve.training.outputs import read_json, recorded_preset, save_hf_model, write_json
from specserve.training.presets import get_preset
from specserve.training.tokenizer import copy_tokenizer, load_tokenizer, tokenizer_fingerprint
from specserve.training.trainer import Trainer, barrier


def train_draft(
    target: str | Path,
    out: str | Path,
    *,
    data: str | Path | None = None,
    preset: str | None = None,
    distill_settings: DistillSettings | None = None,
    init_layers: tuple[int, ...] | None = None,
    draft_vocab: int | None = None,
    storage: str | None = None,
    **options,
) -> dict:
    """Train (or resume) a draft model for ``target``; return the run summary. ``options``: `setup.RunOptions`.

    ``data``: self-distillation data (`train distill-data`; a new small Llama with ``preset``'s shape) or captured
    feature data (`train feature-data`; a draft cut from the target's ``init_layers``, with a ``draft_vocab``-token
    LM head: training/draft_features.py, for any target the engine loads, None the default model)."""
    from transformers import AutoConfig, LlamaForCausalLM

    from specserve.training.feature_data import is_feature_data

    run = setup.RunOptions.of("train_draft", options)
    if is_feature_data(data):
        if preset is not None:
            raise ValueError("--preset shapes a new draft model; a draft trained on feature data is cut from the "
                             "target (--init-layers)")
        from specserve.training.draft_features import train_draft_on_features

        return train_draft_on_features(target, out, data, init_layers=init_layers, draft_vocab=draft_vocab,
                                       storage=storage or "float16", run=run)
    if init_layers is not None or draft_vocab is not None or storage is not None:
        raise ValueError("--init-layers, --draft-vocab and --storage cut a draft from its target: they train on captured "
                         "feature data (`train feature-data`), passed as --data")
    if target is None:
        raise ValueError("--target is required (it may be left out only with --data from `train feature-data`)")
    out_dir = Path(out).expanduser()
    base = recorded_preset(out_dir, preset) if run.resume else get_preset(preset or "draft", "draft")
    recipe = base.with_overrides(**run.overrides())
    settings = recipe.train
    target_dir = Path(target).expanduser().resolve()
    tok = load_tokenizer(target_dir, "target directory")
    target_config = AutoConfig.from_pretrained(str(target_dir))
    if run.resume and data is None:  # the run's own data unless told otherwise
        data = read_json(out_dir / "run_config.json").get("data")
    distill_settings = setup.distill_settings_for(data, distill_settings, target_config.max_position_embeddings,
                                                  target_config.vocab_size)
    with setup.distributed_run(run.device) as dist:
        record = setup.run_record("train draft", run, dist, target_dir, data, preset=recipe.to_dict(), world_size=dist.world)
        data_dir, train_set, heldout_set, _ = setup.start_drafter_run(dist, run, target_dir, out_dir, data,
                                                                      distill_settings, run_config=record)

        shape = replace(recipe.shape, vocab_size=target_config.vocab_size,
                        max_positions=target_config.max_position_embeddings).validate()
        torch.manual_seed(settings.seed)
        model = LlamaForCausalLM(shape.llama_config(tok.eos_token_id))
        seq_len = train_set.tokens.shape[1]
        if seq_len > shape.max_positions:
            raise ValueError(
                f"distillation sequences have {seq_len} tokens, more than the target's context {shape.max_positions}"
            )
        if dist.is_main:
            print(f"draft: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters ({recipe.name}); "
                  f"{len(train_set)} train / {len(heldout_set) if heldout_set else 0} held-out sequences of <= {seq_len} tokens",
                  file=sys.stderr)
        sampler = IndexSampler(len(train_set), settings.batch_size, settings.seed)
        evalset = heldout_set if heldout_set is not None else train_set.take(settings.eval_batches * settings.batch_size)

        def batch_fn(step: int, rank: int, world: int):
            return _batch(train_set, sampler.ids(step, rank, world), dist.device)

        def eval_fn(module) -> dict[str, float]:
            sums = {"eval_loss": 0.0, "top1_agree": 0.0, "accept_t1": 0.0}
            count = 0
            limit = min(len(evalset), settings.eval_batches * settings.batch_size)
            for start in range(0, limit, settings.batch_size):
                batch = _batch(evalset, torch.arange(start, min(start + settings.batch_size, limit)), dist.device)
                metrics, n = distill_metrics(module, batch)
                for k in sums:
                    sums[k] += metrics[k] * n
                count += n
            return {k: v / max(count, 1) for k, v in sums.items()}

        mean_len = float(train_set.lengths.float().mean())
        trainer = Trainer(
            model, settings, out_dir, dist=dist, batch_fn=batch_fn, loss_fn=distill_loss, eval_fn=eval_fn,
            tokens_per_step=int(round(settings.batch_size * mean_len)),
            run_key={"shape": asdict(shape), "batch_size": settings.batch_size, "seed": settings.seed, "lr": settings.lr,
                     "data": str(data_dir.resolve()), "target": str(target_dir)},
            desc=f"train draft/{recipe.name}",
        )
        summary, started = setup.run_trainer(trainer, run)
        if dist.is_main:
            save_hf_model(trainer.module, out_dir, tok.eos_token_id)
            copy_tokenizer(target_dir, out_dir)
            write_json(out_dir / "draft_config.json", {
                "kind": "draft_model", "target": str(target_dir), "target_tokenizer": tokenizer_fingerprint(target_dir),
                "target_vocab_size": target_config.vocab_size, "distill_data": str(data_dir.resolve()),
            })
            setup.finish_run(out_dir, summary, started,
                             f"draft {recipe.name} ({shape.num_params() / 1e6:.2f}M params): KL to the target",
                             kind="draft", preset=recipe.name,
                             num_params=sum(p.numel() for p in trainer.module.parameters()),
                             shape=asdict(shape), target=str(target_dir), argv=run.argv)
        barrier(dist)
        return summary


def _batch(data, ids: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """Sequences ``ids`` cut to their longest length: tokens [B, T'], mask [B, T'], topk ids/logprobs [B, T', k]."""
    lengths = data.lengths[ids]
    t = int(lengths.max())
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return {
        "tokens": data.tokens[ids, :t].to(device),
        "mask": mask.to(device),
        "topk_ids": data.topk_ids[ids, :t].to(device),
        "topk_logprobs": data.topk_logprobs[ids, :t].float().to(device),
    }


def _kl_terms(model, batch):
    logits = model(input_ids=batch["tokens"]).logits.float()  # [B, T, V]
    logq = torch.log_softmax(logits, dim=-1)
    logq_k = logq.gather(-1, batch["topk_ids"])  # [B, T, k]
    logp_k = torch.log_softmax(batch["topk_logprobs"], dim=-1)  # target top-k, renormalised
    kl = (logp_k.exp() * (logp_k - logq_k)).sum(-1)  # [B, T]
    return logits, logq_k, kl


def distill_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean KL(p_target,topk || q_draft) over the valid positions of a batch (see `_batch`)."""
    _, _, kl = _kl_terms(model, batch)
    mask = batch["mask"]
    return (kl * mask).sum() / mask.sum()


def distill_metrics(model, batch) -> tuple[dict[str, float], int]:
    """Held-out KL, top-1 agreement and the single-token acceptance bound, averaged over valid positions."""
    logits, logq_k, kl = _kl_terms(model, batch)
    mask = batch["mask"]
    n = int(mask.sum())
    agree = (logits.argmax(-1) == batch["topk_ids"][..., 0]).float()
    accept = torch.minimum(batch["topk_logprobs"].exp(), logq_k.exp()).sum(-1)
    return {
        "eval_loss": float((kl * mask).sum()) / n,
        "top1_agree": float((agree * mask).sum()) / n,
        "accept_t1": float((accept * mask).sum()) / n,
    }, n
