"""``specserve train draft --data FEATURES``: a draft model cut from its target's own layers, for any target the
engine loads (a GGUF file included), trained on captured feature data (`train feature-data`).

Why this shape. A draft model trained from nothing needs far more text than a CPU session can make (the
default model's captured data is ~0.3 M tokens). So the draft starts as the target with most of its layers
left out: ``--init-layers`` (default the first two and the last) are copied from the target, and the draft
reads through the target's own embedding table, which it does not store: at serving time the drafter
borrows the target's (drafters/draft_model.py), so the shipped files hold only the kept layers, the final
norm and an LM head over a draft vocabulary (``--draft-vocab`` most frequent tokens of the data, initialised
from the target's tied head rows). Training then teaches the few layers to do what the many did: KL from the
target's stored top-k distribution (restricted to the draft vocabulary and renormalised, as EAGLE-3 and
Medusa heads on feature data are trained) at every position.

Held-out metrics: ``eval_loss`` (the KL), ``top1_agree`` (the draft's argmax is the target's, over every
labelled position) and ``chain{d}`` (on answer tokens: the draft's argmax agrees at d consecutive positions,
teacher-forced — what a greedy chain of d drafted tokens needs where the answer is the target's greedy one).

Output directory (served as ``draft:OUT``): ``config.json`` (a Hugging Face Llama config of the kept layers,
``vocab_size`` the target's), ``model.safetensors`` (float16; no ``model.embed_tokens.weight``;
``lm_head.weight`` [Vd, H], row j for token ``draft_to_target[j]``; ``--storage int8`` writes the matrices as
int8 rows with float scales, drafters/int8_rows.py), ``draft_vocab.safetensors`` and
``draft_config.json`` (``"embedding": "target"`` and the target's identity: file sha256 and tokenizer).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import nn

from specserve.training import setup
from specserve.training.data import IndexSampler
from specserve.training.presets import TrainSettings, check_int
from specserve.training.soft_labels import draft_columns, to_columns, topk_kl
from specserve.training.trainer import Trainer

# Sized for the default model on 2 CPU cores: a 3-layer draft at hidden 576 takes ~2.5 s a step of 8 sequences.
DEFAULT_SETTINGS = TrainSettings(seq_len=512, batch_size=8, lr=5e-4, max_steps=1200, warmup_steps=30, min_lr_ratio=0.1,
                                 weight_decay=0.0, log_every=10, eval_every=100, eval_batches=6, checkpoint_every=50,
                                 max_minutes=60.0)
DEFAULT_DRAFT_VOCAB = 4096
CHAIN_DEPTHS = 4  # chain{1..4} metrics
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "draft_config.json"
STORAGES = ("float16", "int8")


def default_init_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a draft starts from: the first two (they turn embeddings into features) and the last
    (it turns features into next-token logits)."""
    return tuple(sorted({0, min(1, num_layers - 1), num_layers - 1}))


def train_draft_on_features(target, out: str | Path, data: str | Path, *, init_layers: tuple[int, ...] | None = None,
                            draft_vocab: int | None = None, storage: str = "float16", run) -> dict:
    """Train (or resume) a draft model cut from ``target`` (None: the default model) on feature data ``data``;
    return the run summary. ``run``: `setup.RunOptions`; ``storage``: how the matrices are written, "float16" or
    "int8" (row-wise: half the bytes; a resumed run may write its weights again in the other)."""
    if storage not in STORAGES:
        raise ValueError(f"--storage must be one of {', '.join(STORAGES)}, got {storage!r}")
    from specserve.drafters.eagle_checkpoint import target_config
    from specserve.loading import resolve_model
    from specserve.training.outputs import read_json, write_json

    out_dir = Path(out).expanduser()
    target_path = resolve_model(target).resolve()
    if not target_path.exists():
        raise ValueError(f"target {str(target_path)!r} does not exist")
    config = target_config(target_path)
    num_layers, vocab = int(config["num_hidden_layers"]), int(config["vocab_size"])
    spec = {"init_layers": None if init_layers is None else list(init_layers), "draft_vocab": draft_vocab}
    if run.resume:
        recorded = read_json(out_dir / setup.RUN_CONFIG_FILE)
        changed = sorted(k for k, v in spec.items() if v is not None and v != recorded["draft"][k])
        if changed:
            raise ValueError(f"--resume: the run in {str(out_dir)!r} was started with other {', '.join(changed)}")
        spec, base = recorded["draft"], TrainSettings(**recorded["settings"])
    else:
        spec = {"init_layers": list(init_layers or default_init_layers(num_layers)),
                "draft_vocab": DEFAULT_DRAFT_VOCAB if draft_vocab is None else draft_vocab}
        base = DEFAULT_SETTINGS
    settings = replace(base, **run.overrides()).validate()
    layers = spec["init_layers"]
    if not layers or any(not 0 <= i < num_layers for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"--init-layers must name distinct layers of the target's 0..{num_layers - 1}, got {layers}")
    check_int("draft_vocab", spec["draft_vocab"], 1, vocab)
    with setup.distributed_run(run.device, single_process="train draft") as dist:
        data_dir, train_set, heldout_set, _ = setup.start_feature_run(dist, run, target_path, out_dir, data,
                                                                      (WEIGHTS_FILE, CONFIG_FILE))
        if int(train_set.tokens.max()) >= vocab:
            raise ValueError(f"the data in {str(data_dir)!r} has token ids outside the target's vocabulary")
        if not run.resume:
            write_json(out_dir / setup.RUN_CONFIG_FILE, setup.run_record(
                "train draft", run, dist, target_path, data, draft=spec, settings=asdict(settings)))
        from specserve.training.eagle import draft_vocabulary

        draft_ids = draft_vocabulary(train_set, vocab, spec["draft_vocab"])
        torch.manual_seed(settings.seed)
        model = CutDraft.from_target(target_path, layers, draft_ids)
        evalset = heldout_set if heldout_set is not None else train_set
        batches = _Batches(draft_ids, vocab)
        print(f"draft: target layers {layers} kept, draft vocabulary {len(draft_ids)}, "
              f"{sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f}M trainable parameters; "
              f"{len(train_set)} train / {len(evalset)} held-out sequences", file=sys.stderr)
        sampler = IndexSampler(len(train_set), settings.batch_size, settings.seed)

        def batch_fn(step: int, rank: int, world: int):
            return batches(train_set, sampler.ids(step, rank, world), dist.device)

        def eval_fn(module) -> dict[str, float]:
            limit = min(len(evalset), settings.eval_batches * settings.batch_size)
            return _evaluate(module, [batches(evalset, torch.arange(s, min(s + settings.batch_size, limit)), dist.device)
                                      for s in range(0, limit, settings.batch_size)])

        trainer = Trainer(
            model, settings, out_dir, dist=dist, batch_fn=batch_fn, loss_fn=_loss, eval_fn=eval_fn,
            tokens_per_step=round(settings.batch_size * float(train_set.lengths.float().mean())),
            run_key={"draft": spec, "batch_size": settings.batch_size, "seed": settings.seed, "lr": settings.lr,
                     "data": str(data_dir.resolve()), "target": str(target_path)},
            desc=f"train draft/{len(layers)} layers",
        )
        summary, started = setup.run_trainer(trainer, run)
        if trainer.evaluated_step != trainer.step:  # the run did not end on an evaluation: evaluate now
            summary["last_eval"] = trainer.log_evaluation()
        metrics = {k: round(v, 5) for k, v in trainer.last_eval.items()}
        identity = save_cut_draft(trainer.module, out_dir, target_path, config, storage=storage, extra={
            "init_layers": layers, "metrics": metrics, "distill_data": str(data_dir.resolve()), "step": trainer.step,
            "storage": storage})
        setup.finish_run(out_dir, summary, started,
                         f"draft: target layers {layers}, draft vocabulary {len(draft_ids)}: KL to the target",
                         kind="draft", draft=spec, target=str(target_path), argv=run.argv, data=str(data_dir.resolve()),
                         num_trainable_params=sum(p.numel() for p in trainer.module.parameters() if p.requires_grad),
                         checkpoint_bytes=(out_dir / WEIGHTS_FILE).stat().st_size, fingerprint=identity.get("file_sha256") or identity.get("config_sha256"))
        return summary


class CutDraft(nn.Module):
    """The draft being trained: transformers' Llama body over the kept layers, fed the target's embedding rows
    (a frozen, non-persistent buffer: not trained, not saved), and an LM head over the draft vocabulary.

    forward(tokens int64[B, T], mask bool[B, T]) -> logits float32[B, T, Vd]."""

    def __init__(self, body, embed: torch.Tensor, head: nn.Linear, draft_ids: torch.Tensor) -> None:
        super().__init__()
        self.body, self.head = body, head
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("draft_ids", draft_ids.clone(), persistent=False)

    @classmethod
    def from_target(cls, target: Path, layers: list[int], draft_ids: torch.Tensor) -> "CutDraft":
        from transformers import LlamaConfig, LlamaModel

        from specserve.drafters.eagle_checkpoint import target_config
        from specserve.loading import open_checkpoint

        state, _ = open_checkpoint(target).load(torch.float32)
        config = LlamaConfig(**{**target_config(target), "num_hidden_layers": len(layers), "tie_word_embeddings": False})
        # The body's own embedding table is never used (it is fed `inputs_embeds`): keep it one row.
        body = LlamaModel(LlamaConfig(**{**config.to_dict(), "vocab_size": 1}))
        own = {"norm.weight": state["model.norm.weight"]}
        for i, source in enumerate(layers):
            prefix = f"model.layers.{source}."
            own.update({f"layers.{i}." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        missing, unexpected = body.load_state_dict(own, strict=False)
        if unexpected or set(missing) - {"embed_tokens.weight"}:
            raise ValueError(f"the target's layers do not fit a Llama body: missing {missing}, unexpected {unexpected}")
        body.embed_tokens.requires_grad_(False)
        embed = state["model.embed_tokens.weight"]
        head = nn.Linear(config.hidden_size, len(draft_ids), bias=False)
        with torch.no_grad():
            head.weight.copy_(state.get("lm_head.weight", embed)[draft_ids])
        model = cls(body, embed, head, draft_ids)
        model.config = config
        return model

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.body(inputs_embeds=self.embed[tokens], attention_mask=mask.long()).last_hidden_state
        return self.head(h).float()


class _Batches:
    """Padded batches of feature data (`FeatureSet.padded`, no features) with the stored top-k ids mapped to
    draft-vocabulary columns (-1 outside it, log-probability -inf, so the rest renormalise): tokens [B, T],
    mask [B, T] (t < length), label bool[B, T] (the row has a label in the draft vocabulary), topk_ids /
    topk_logprobs [B, T, k], answer bool[B, T] (the row predicts an answer token), argmax [B, T] (target ids)."""

    def __init__(self, draft_ids: torch.Tensor, vocab: int) -> None:
        self.columns = draft_columns(draft_ids, vocab)

    def __call__(self, data, ids: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        padded = data.padded(ids, [])
        top_ids, top_logp = to_columns(self.columns, padded["topk_ids"], padded["topk_logprobs"])
        t = padded["tokens"].shape[1]
        answer = torch.arange(t)[None, :] >= (data.prompt_lengths[ids] - 1)[:, None]
        out = {"tokens": padded["tokens"], "mask": padded["mask"], "label": torch.isfinite(top_logp).any(-1),
               "topk_ids": top_ids, "topk_logprobs": top_logp, "answer": answer & padded["mask"],
               "argmax": padded["topk_ids"][..., 0]}
        return {k: v.to(device) for k, v in out.items()}


def _kl(model: CutDraft, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits float32[B, T, Vd], KL(p || q) [B, T]: 0 where the row has no label)."""
    logits = model(batch["tokens"], batch["mask"])
    kl = topk_kl(torch.log_softmax(logits, dim=-1), batch["topk_ids"], batch["topk_logprobs"])
    return logits, kl * batch["label"]


def _loss(model: CutDraft, batch) -> torch.Tensor:
    _, kl = _kl(model, batch)
    return kl.sum() / batch["label"].sum().clamp(min=1)


@torch.no_grad()
def _evaluate(model: CutDraft, batches: list[dict]) -> dict[str, float]:
    kl_sum = labelled = agree_sum = 0.0
    chain_hits, chain_rows = [0.0] * CHAIN_DEPTHS, [0.0] * CHAIN_DEPTHS
    for batch in batches:
        logits, kl = _kl(model, batch)
        kl_sum += float(kl.sum())
        labelled += float(batch["label"].sum())
        agree = (model.draft_ids[logits.argmax(-1)] == batch["argmax"]) & batch["mask"]
        agree_sum += float(agree.sum())
        # Teacher-forced chains on answer rows: rows t..t+d-1 all agree (every one an answer row).
        run, rows = agree & batch["answer"], batch["answer"]
        for d in range(CHAIN_DEPTHS):
            if d:
                run, rows = run[:, :-1] & agree[:, d:] & batch["answer"][:, d:], rows[:, :-1] & batch["answer"][:, d:]
            chain_hits[d] += float(run.sum())
            chain_rows[d] += float(rows.sum())
    out = {"eval_loss": kl_sum / max(labelled, 1), "top1_agree": agree_sum / max(labelled, 1)}
    out.update({f"chain{d + 1}": chain_hits[d] / max(chain_rows[d], 1) for d in range(CHAIN_DEPTHS)})
    return out


def save_cut_draft(model: CutDraft, out_dir: Path, target: Path, target_cfg: dict, *, extra: dict,
                   storage: str = "float16") -> dict:
    """Write the serving files (see the module docstring), the matrices as ``storage`` ("float16", or "int8":
    drafters/int8_rows.py); return the target identity recorded."""
    from safetensors.torch import save_file

    from specserve.drafters.draft_vocab import save_draft_vocab
    from specserve.drafters.int8_rows import SCALE_SUFFIX, quantize_rows
    from specserve.drafters.eagle_checkpoint import target_fingerprint

    state = {"model." + k: v for k, v in model.body.state_dict().items() if k != "embed_tokens.weight"}
    state["lm_head.weight"] = model.head.weight
    state = {k: v.detach().float().cpu() for k, v in state.items()}
    if storage == "int8":
        state = quantize_rows(state)
    # Float weights as float16; int8 rows and their float32 scales as they are.
    save_file({k: v if v.dtype == torch.int8 or k.endswith(SCALE_SUFFIX) else v.to(torch.float16).contiguous()
               for k, v in state.items()}, str(out_dir / WEIGHTS_FILE))
    config = model.config.to_dict()
    config.update(vocab_size=int(target_cfg["vocab_size"]), torch_dtype="float16")
    config.pop("dtype", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_draft_vocab(out_dir, model.draft_ids)
    identity = {"path": str(target), **target_fingerprint(target)}
    (out_dir / CONFIG_FILE).write_text(json.dumps(
        {"kind": "draft_model", "embedding": "target", "target": identity, **extra}, indent=1) + "\n")
    return identity
