"""``specserve train eagle``: an EAGLE head for a frozen target, trained on self-distillation data.

Each step takes a batch of distillation sequences, runs the frozen target over them once (no grad;
transformers' model, which our `LlamaModel` matches feature for feature) for its features and
logits, and trains the head (drafters/eagle_head.py) on every position at once:

- ``eagle3`` (default): the head's draft-vocabulary distribution against the target's next-token
  distribution renormalised over the draft vocabulary (soft labels from the target's full logits),
  as a KL, with **training-time test**: the head is unrolled ``--ttt-steps`` times on its own output
  features (`EagleHead.unroll`, the attention drafting sees), step i weighted ``0.8 ** i``. The draft
  vocabulary is the ``--draft-vocab`` most frequent tokens of the training data (default: a quarter
  of the target's vocabulary, at least 2,048; the small target's 2,048 of 8,192 cover 88.6 % of its
  tokens and 99.5 % of its held-out argmaxes); the head's norm and LM head start from the target's.
- ``eagle1``: feature regression (smooth L1 between the predicted and the target's next final
  normed feature) + 0.1 x the KL of the target's LM head over the predicted feature to the target's
  distribution, as EAGLE does; ``--ttt-steps`` (default 1) unrolls it too.

Held-out metrics each eval: ``eval_loss`` (the training loss), ``agree_d{j}`` — how often the head's
top token equals the target's at unroll step j-1, teacher-forced tokens (≈ the acceptance rate at
tree depth j of a greedy chain, given the earlier depths were accepted) — and ``tau_chain``
= 1 + sum_j prod_{i<=j} agree_d{i}, the mean accepted length of a greedy chain those rates imply.

The output directory is a head (``eagle_config.json`` + ``eagle_head.safetensors``, served as
``eagle:OUT``) plus the run's records: ``train_log.jsonl``, ``loss_curve.png``, ``agreement.png``,
``train_summary.json``, ``run_config.json`` and a resumable ``checkpoint/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

# Defaults for the small default target on 2 CPU cores (see training/README.md for measured figures).
EAGLE_SETTINGS = dict(seq_len=256, batch_size=8, lr=3e-3, max_steps=1100, warmup_steps=40, log_every=10, eval_every=100,
                      eval_batches=4, checkpoint_every=100, max_minutes=30.0, weight_decay=0.0)
DEFAULT_TTT = {"eagle3": 3, "eagle1": 1}
EVAL_DEPTHS = 4
STEP_DECAY = 0.8
EAGLE1_TOKEN_WEIGHT = 0.1


def train_eagle(
    target: str | Path,
    out: str | Path,
    *,
    data: str | Path | None = None,
    mode: str | None = None,
    ttt_steps: int | None = None,
    draft_vocab: int | None = None,
    feature_layers: tuple[int, ...] | None = None,
    save_dtype: str = "float16",
    distill_settings=None,
    **options,
) -> dict:
    """Train (or resume) an EAGLE head for ``target``; return the run summary. ``options``: `setup.RunOptions`."""
    import torch

    from specserve.drafters.eagle_checkpoint import new_head_config, save_head
    from specserve.drafters.eagle_head import EagleHead
    from specserve.training import setup
    from specserve.training.data import IndexSampler
    from specserve.training.outputs import write_json
    from specserve.training.presets import TrainSettings, check_int
    from specserve.training.trainer import Trainer

    from specserve.drafters.eagle_checkpoint import target_config
    from specserve.loading import resolve_model
    from specserve.training.feature_data import is_feature_data

    run = setup.RunOptions.of("train_eagle", options)
    if save_dtype not in ("float16", "float32"):
        raise ValueError(f"save_dtype must be float16 or float32, got {save_dtype!r}")
    out_dir = Path(out).expanduser()
    if run.resume and data is None:
        data = _recorded(out_dir).get("data")
    # Captured feature data (`train feature-data`) trains without running the target: any model the engine
    # loads (a GGUF file included; None is the default model). Distillation data runs transformers' target.
    captured = is_feature_data(data)
    target_dir = resolve_model(target).resolve() if captured else Path(target).expanduser().resolve()
    if not captured and not (target_dir / "config.json").is_file():
        raise ValueError(f"target directory {str(target_dir)!r} has no config.json (a GGUF target trains on "
                         "`specserve train feature-data` output: pass it as --data)")
    if captured and not target_dir.exists():
        raise ValueError(f"target {str(target_dir)!r} does not exist")
    if run.resume:
        recorded = _recorded(out_dir)
        for name, given in (("mode", mode), ("ttt_steps", ttt_steps), ("draft_vocab", draft_vocab),
                            ("feature_layers", list(feature_layers) if feature_layers else None)):
            if given is not None and given != recorded[name]:
                raise ValueError(f"--resume: the run in {str(out_dir)!r} uses {name} {recorded[name]!r}, not {given!r}")
        mode, ttt_steps, draft_vocab = recorded["mode"], recorded["ttt_steps"], recorded["draft_vocab"]
        feature_layers = tuple(recorded["feature_layers"]) if recorded["feature_layers"] else None
        base = recorded["train"]
    else:
        base = dict(EAGLE_SETTINGS)
    mode = mode or "eagle3"
    if mode not in ("eagle3", "eagle1"):
        raise ValueError(f"mode must be eagle3 or eagle1, got {mode!r}")
    ttt_steps = DEFAULT_TTT[mode] if ttt_steps is None else ttt_steps
    check_int("ttt_steps", ttt_steps, 1, 16)
    settings = TrainSettings(**{**base, **run.overrides()}).validate()
    config = target_config(target_dir)
    vocab = int(config["vocab_size"])
    if draft_vocab is not None and (isinstance(draft_vocab, bool) or not 1 <= draft_vocab <= vocab):
        raise ValueError(f"draft_vocab must be in [1, {vocab}], got {draft_vocab!r}")
    if mode == "eagle1" and draft_vocab not in (None, vocab):
        raise ValueError("--draft-vocab is for eagle3 heads: an eagle1 head uses the target's LM head (full vocabulary)")
    if not captured:
        distill_settings = setup.distill_settings_for(data, distill_settings, int(config["max_position_embeddings"]), vocab)

    with setup.distributed_run(run.device, single_process="train eagle") as dist:
        # run_config.json is written below, once the head's vocabulary is known
        own_files = ("eagle_config.json", "eagle_head.safetensors", "agreement.png")
        if captured:
            if mode == "eagle1":
                raise ValueError("captured feature data trains eagle3 heads (eagle1 regresses the final feature)")
            data_dir, train_set, heldout_set, manifest = setup.start_feature_run(dist, run, target_dir, out_dir, data,
                                                                                 own_files)
            feature_layers = _captured_layers(manifest, feature_layers)
        else:
            data_dir, train_set, heldout_set, _ = setup.start_drafter_run(
                dist, run, target_dir, out_dir, data, distill_settings, own_files=own_files)
        if int(train_set.tokens.max()) >= vocab:
            raise ValueError(f"the data in {str(data_dir)!r} has token ids outside the target's vocabulary")

        torch.manual_seed(settings.seed)
        weights = TargetWeights.of(target_dir, captured, dist.device)
        if mode == "eagle3" and draft_vocab is None:
            draft_vocab = default_draft_vocab(vocab)
        draft_ids = draft_vocabulary(train_set, vocab, draft_vocab if mode == "eagle3" else vocab)
        cfg = new_head_config(target_dir, mode, len(draft_ids), feature_layers)
        if any(not 0 <= layer <= cfg.target["num_layers"] for layer in cfg.feature_layers):
            raise ValueError(f"feature layers {cfg.feature_layers} must lie in 0..{cfg.target['num_layers']}")
        head = EagleHead(cfg, weights.embed, weights.lm_head, dist.device)
        with torch.no_grad():
            head.draft_to_target.copy_(draft_ids.to(dist.device))
            if mode == "eagle3":  # start from the target's own output layer, restricted to the draft vocabulary
                head.norm.copy_(weights.norm)
                head.lm_head.copy_(weights.lm_head[draft_ids.to(dist.device)])
        if not run.resume:
            write_json(out_dir / "run_config.json", setup.run_record(
                "train eagle", run, dist, target_dir, data,
                eagle={"mode": mode, "ttt_steps": ttt_steps, "draft_vocab": draft_vocab,
                       "feature_layers": list(feature_layers) if feature_layers else None, "train": asdict(settings)}))
        print(f"eagle head ({mode}, layers {list(cfg.feature_layers)}, draft vocabulary {len(draft_ids)}): "
              f"{sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters; {len(train_set)} train / "
              f"{len(heldout_set) if heldout_set else 0} held-out sequences; {ttt_steps} unroll step(s)", file=sys.stderr)

        sampler = IndexSampler(len(train_set), settings.batch_size, settings.seed)
        evalset = heldout_set if heldout_set is not None else train_set
        features = (_StoredFeatures(head.draft_to_target) if captured else
                    _Features(weights.teacher, cfg.feature_layers, mode, head.draft_to_target))

        def batch_fn(step: int, rank: int, world: int):
            return features(train_set, sampler.ids(step, rank, world), dist.device)

        def loss_fn(model, batch):
            return eagle_loss(model, batch, ttt_steps)[0]

        def eval_fn(model) -> dict[str, float]:
            limit = min(len(evalset), settings.eval_batches * settings.batch_size)
            sums: dict[str, float] = {}
            for start in range(0, limit, settings.batch_size):
                batch = features(evalset, torch.arange(start, min(start + settings.batch_size, limit)), dist.device)
                n = float(batch["mask"].sum())
                for k, v in eagle_metrics(model, batch, ttt_steps).items():
                    sums[k] = sums.get(k, 0.0) + v * n
                sums["_n"] = sums.get("_n", 0.0) + n
            n = max(sums.pop("_n", 0.0), 1.0)
            metrics = {k: v / n for k, v in sums.items()}
            chain, tau = 1.0, 1.0
            for d in range(1, EVAL_DEPTHS + 1):
                chain *= metrics[f"agree_d{d}"]
                tau += chain
            metrics["tau_chain"] = tau
            return metrics

        mean_len = float(train_set.lengths.float().mean())
        trainer = Trainer(
            head, settings, out_dir, dist=dist, batch_fn=batch_fn, loss_fn=loss_fn, eval_fn=eval_fn,
            tokens_per_step=round(settings.batch_size * mean_len),
            run_key={"mode": mode, "ttt_steps": ttt_steps, "head": cfg.to_dict(), "batch_size": settings.batch_size,
                     "seed": settings.seed, "lr": settings.lr, "max_steps": settings.max_steps,
                     "data": str(data_dir.resolve()), "target": str(target_dir)},
            desc=f"train eagle/{mode}",
        )
        summary, started = setup.run_trainer(trainer, run)
        save_head(trainer.module, out_dir, getattr(torch, save_dtype))
        size = sum(f.stat().st_size for f in (out_dir / "eagle_head.safetensors", out_dir / "eagle_config.json"))
        records = setup.finish_run(
            out_dir, summary, started, f"EAGLE head ({mode}, {ttt_steps} unroll steps)",
            kind="eagle", mode=mode, ttt_steps=ttt_steps, feature_layers=list(cfg.feature_layers),
            draft_vocab_size=cfg.draft_vocab_size, num_params=sum(p.numel() for p in trainer.module.parameters()),
            head_bytes=size, save_dtype=save_dtype, target=str(target_dir), data=str(data_dir.resolve()),
            argv=run.argv, settings=asdict(settings))
        _plot_agreement(records, out_dir / "agreement.png", mode)
        return summary


def default_draft_vocab(vocab: int) -> int:
    """An eagle3 head's vocabulary by default: a quarter of the target's, at least 2,048 tokens
    (the small target: 2,048 of 8,192; Llama 3's 128,256: 32,064, about what EAGLE-3 uses)."""
    return min(vocab, max(2048, vocab // 4))


def _recorded(out_dir: Path) -> dict:
    from specserve.training.outputs import read_run_config

    run = read_run_config(out_dir, "a train eagle run")
    if run.get("command") != "train eagle" or "eagle" not in run:
        raise ValueError(f"--resume: {str(out_dir)!r} is not a train eagle run")
    return {**run["eagle"], "data": run.get("data")}


def draft_vocabulary(train_set, vocab: int, size: int | None):
    """The ``size`` most frequent tokens of the training sequences (ties: lower id), ascending: int64[size].
    Captured feature data counts the target's argmax at every position too: what a head must be able to draft."""
    import torch

    from specserve.training.draft_vocab import most_frequent

    size = vocab if size is None else size
    if train_set.tokens.dim() == 1:  # packed feature data: every token is real, and the target's argmaxes are known
        counts = torch.bincount(train_set.tokens, minlength=vocab) + torch.bincount(train_set.topk_ids[:, 0], minlength=vocab)
        return most_frequent(counts, size)
    mask = torch.arange(train_set.tokens.shape[1])[None, :] < train_set.lengths[:, None]
    return most_frequent(torch.bincount(train_set.tokens[mask], minlength=vocab), size)


def _captured_layers(manifest: dict, asked: tuple[int, ...] | None) -> tuple[int, ...]:
    """The feature layers of captured data (a run cannot ask for others: they were not captured)."""
    layers = tuple(manifest["feature_layers"])
    if asked is not None and tuple(asked) != layers:
        raise ValueError(f"the feature data holds layers {list(layers)}, not {list(asked)}")
    return layers


class TargetWeights:
    """What a head takes from its target: embeddings [V, H], final norm [H], LM head [V, H] (float32, frozen);
    ``teacher`` is transformers' model when the features are computed each step (distillation data)."""

    def __init__(self, embed, norm, lm_head, teacher=None) -> None:
        self.embed, self.norm, self.lm_head, self.teacher = embed, norm, lm_head, teacher

    @classmethod
    def of(cls, target_dir: Path, captured: bool, device) -> "TargetWeights":
        import torch

        if captured:  # the engine's own reader (a GGUF file's embedding and LM head, dequantized)
            from specserve.loading import open_checkpoint

            state, _ = open_checkpoint(target_dir).load(torch.float32, blocks_only=True)
            embed = state["model.embed_tokens.weight"]
            lm_head = state.get("lm_head.weight", embed)
            return cls(embed.to(device), state["model.norm.weight"].to(device), lm_head.to(device))
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
        teacher.requires_grad_(False)
        return cls(teacher.get_input_embeddings().weight, teacher.model.norm.weight,
                   teacher.get_output_embeddings().weight, teacher)


class _Features:
    """A batch of sequences with the frozen target's features and soft labels (no grad).

    Returns tokens int64[B, T], mask bool[B, T] (t < length), layers: [B, T, H] per feature layer,
    top: [B, T, H] the final normed feature (eagle1's regression target), p [B, T, V'] the target's
    next-token probabilities (eagle3: renormalised over the draft vocabulary), argmax int64[B, T]
    the target's top token (full vocabulary).
    """

    def __init__(self, teacher, feature_layers, mode: str, draft_to_target) -> None:
        self.teacher, self.layers, self.mode = teacher, tuple(feature_layers), mode
        self.draft_ids = draft_to_target.detach().clone()
        self.num_layers = teacher.config.num_hidden_layers

    def __call__(self, data, ids, device) -> dict:
        import torch

        lengths = data.lengths[ids]
        t = int(lengths.max())
        tokens = data.tokens[ids, :t].to(device)
        mask = (torch.arange(t)[None, :] < lengths[:, None]).to(device)
        with torch.no_grad():
            out = self.teacher(input_ids=tokens, output_hidden_states=True)
            logits = out.logits.float()
            batch = {"tokens": tokens, "mask": mask, "argmax": logits.argmax(-1),
                     "layers": [out.hidden_states[layer].float() for layer in self.layers]}
            if self.mode == "eagle3":
                batch["p"] = torch.softmax(logits[..., self.draft_ids.to(device)], dim=-1)
            else:
                batch["p"] = torch.softmax(logits, dim=-1)
                batch["top"] = out.hidden_states[self.num_layers].float()
        return batch


class _StoredFeatures:
    """The batch `_Features` makes, read from captured feature data (training/feature_data.py) instead:
    the target never runs. Sequences are padded to the batch's longest (mask false past each length);
    ``p`` is the target's stored top-k restricted to the draft vocabulary and renormalised (its mass
    outside the top-k, a few per cent, is unknown and left out)."""

    def __init__(self, draft_to_target) -> None:
        import torch

        ids = draft_to_target.detach().cpu()
        self.draft_size = len(ids)
        self.to_draft = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
        self.to_draft[ids] = torch.arange(len(ids))

    def __call__(self, data, ids, device) -> dict:
        import torch

        padded = data.padded(ids)
        tokens, mask, feats = padded["tokens"], padded["mask"], padded["features"]
        top_ids, top_logp = padded["topk_ids"], padded["topk_logprobs"]
        b, t = tokens.shape
        draft = self.to_draft[top_ids.clamp(max=len(self.to_draft) - 1)]
        draft = torch.where(top_ids < len(self.to_draft), draft, torch.full_like(draft, -1))
        weights = torch.where(draft >= 0, top_logp.float().exp(), torch.zeros(()))
        # p [b, t, draft vocabulary] is built where it is used: it is ~draft-vocabulary / k times the stored
        # labels' size (half a GB for 64 sequences of 500 rows), too much to fill on the CPU and copy each step.
        p = torch.zeros(b, t, self.draft_size + 1, device=device)
        p.scatter_add_(-1, torch.where(draft >= 0, draft, self.draft_size).to(device), weights.to(device))
        p = p[..., :-1]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        return {"tokens": tokens.to(device), "mask": mask.to(device), "argmax": top_ids[..., 0].to(device),
                "layers": [feats[:, :, i].to(device) for i in range(feats.shape[2])], "p": p}


def _unrolled(head, batch: dict, steps: int):
    """Pairs (f_i, t_{i+1}) for i = 0..T-2 through `EagleHead.unroll`; per-step outputs and valid masks."""
    tokens_in = batch["tokens"][:, 1:]  # t_{i+1}
    feats = head.fuse([x[:, :-1] for x in batch["layers"]])  # f_i
    outs = head.unroll(tokens_in, feats, steps)
    valid = batch["mask"][:, 1:]  # pair i exists when t_{i+1} does; its label (row i+1) then exists too
    positions = torch_arange_like(valid)
    return outs, [valid & (positions >= s) for s in range(steps)]


def torch_arange_like(mask):
    import torch

    return torch.arange(mask.shape[1], device=mask.device)[None, :].expand_as(mask)


def _step_terms(head, batch: dict, out, valid):
    """(loss, head log q [B, P, V']) of one unroll step, averaged over valid pairs."""
    import torch
    import torch.nn.functional as F

    logq = torch.log_softmax(head.logits(out), dim=-1)
    p = batch["p"][:, 1:]
    kl = (torch.xlogy(p, p) - p * logq).sum(-1)  # [B, P]; p may be 0 (a captured top-k)
    n = valid.sum().clamp_min(1)
    loss = (kl * valid).sum() / n
    if head.mode == "eagle1":
        reg = F.smooth_l1_loss(out, batch["top"][:, 1:], reduction="none").mean(-1)
        loss = (reg * valid).sum() / n + EAGLE1_TOKEN_WEIGHT * loss
    return loss, logq


def eagle_loss(head, batch: dict, steps: int):
    """Weighted mean over unroll steps (weights 0.8 ** step) of each step's loss; also the per-step losses."""
    outs, valids = _unrolled(head, batch, steps)
    total, weights, per_step = 0.0, 0.0, []
    for s, (out, valid) in enumerate(zip(outs, valids)):
        loss, _ = _step_terms(head, batch, out, valid)
        total = total + STEP_DECAY**s * loss
        weights += STEP_DECAY**s
        per_step.append(loss)
    return total / weights, per_step


def eagle_metrics(head, batch: dict, ttt_steps: int) -> dict[str, float]:
    """Held-out loss (as trained) and the top-1 agreement with the target at each of EVAL_DEPTHS unroll steps."""
    steps = max(ttt_steps, EVAL_DEPTHS)
    outs, valids = _unrolled(head, batch, steps)
    metrics, total, weights = {}, 0.0, 0.0
    target_top = batch["argmax"][:, 1:]
    for s, (out, valid) in enumerate(zip(outs, valids)):
        loss, logq = _step_terms(head, batch, out, valid)
        if s < ttt_steps:
            total += STEP_DECAY**s * float(loss)
            weights += STEP_DECAY**s
        if s < EVAL_DEPTHS:
            agree = head.draft_to_target[logq.argmax(-1)] == target_top
            metrics[f"agree_d{s + 1}"] = float((agree & valid).sum()) / max(float(valid.sum()), 1.0)
    metrics["eval_loss"] = total / weights
    return metrics


def _plot_agreement(records: list[dict], path: Path, mode: str) -> None:
    rows = [r for r in records if "agree_d1" in r]
    if not rows:
        return
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for d in range(1, EVAL_DEPTHS + 1):
        ax.plot([r["tokens"] / 1e6 for r in rows], [r[f"agree_d{d}"] for r in rows], "o-", ms=3, label=f"depth {d}")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("top-1 agreement with the target (held-out)")
    ax.set_title(f"EAGLE head ({mode}): acceptance estimate per depth")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------------


def add_eagle_args(p: argparse.ArgumentParser) -> None:
    """The ``train eagle`` arguments of its own (run and distill arguments come from training/cli.py)."""
    p.add_argument("--target", default=None,
                   help="target model: a directory (with its tokenizer), or with --data from `train feature-data` any "
                        "model the engine loads, a GGUF file included (default there: the default model)")
    p.add_argument("--out", required=True, help="output head directory (serve it as eagle:OUT)")
    p.add_argument("--data", default=None, help="distill-data directory (default: generate one in OUT/distill)")
    p.add_argument("--mode", default=None, choices=["eagle3", "eagle1"], help="head kind (default eagle3; resume: the run's)")
    p.add_argument("--ttt-steps", type=int, default=None,
                   help="training-time-test unroll steps on the head's own features (default: eagle3 3, eagle1 1)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle3: size of the head's own vocabulary, the most frequent tokens of the data "
                        "(default: a quarter of the target's, at least 2048)")
    p.add_argument("--feature-layers", default=None,
                   help="target layers the head reads, comma-separated, transformers numbering (default: EAGLE's choice)")
    p.add_argument("--save-dtype", default="float16", choices=["float16", "float32"], help="dtype of the saved head")


def cmd_eagle(args: argparse.Namespace) -> int:
    from specserve.training.cli import _distill_settings, _report, _set_threads, run_options

    _set_threads(args.threads)
    from specserve.training.feature_data import is_feature_data, parse_feature_layers

    if args.target is None and not is_feature_data(args.data) and not args.resume:
        raise ValueError("--target is required (it may be left out only with --data from `train feature-data`)")
    layers = parse_feature_layers(args.feature_layers)
    summary = train_eagle(
        args.target, args.out, data=args.data, mode=args.mode, ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab,
        feature_layers=layers, save_dtype=args.save_dtype, distill_settings=_distill_settings(args), **run_options(args),
    )
    _report(summary, args.out)
    print(json.dumps({"out": args.out, "mode": summary["mode"], "head_bytes": summary["head_bytes"],
                      "last_eval": summary["last_eval"]}))
    return 0
