"""``specserve train medusa``: Medusa heads for a frozen target, from its self-distillation data.

Head k reads the target's final normed hidden state at position t (what its LM head reads) and learns
the target's distribution of the token at t + k + 2. The labels are the data's soft labels one row
further: row t + k + 1 holds the target's top-k next-token distribution after the prefix through
t + k + 1. Where the tokens in between are the target's own samples (the continuations, T = 1) this is
an unbiased, lower-variance estimate of exactly the distribution head k should match — the target's
marginal over the token k + 2 ahead — so every head uses soft labels (no hard next-token labels).

Loss: sum_k decay**k * KL(p || q_k) / sum_k decay**k, with p the target's top-k renormalised (as in
``train draft``). Held-out metrics per head, at every eval: ``h{k}_kl``, ``h{k}_top1`` (head argmax =
target argmax), ``h{k}_top5`` (target argmax among the head's top 5) and ``h{k}_top1_chain`` (heads
0..k all right: the greedy chain reaches depth k+1); ``eval_loss`` the weighted KL. The final held-out
rank accuracies (conditional on the prefix being right, see `_evaluate`) choose the checkpoint's
static tree (`choices_from_accuracies`).

Target features are computed by transformers' model body, one sequence at a time (so a resumed run
sees bit-identical features), under no_grad, and cached in fp16 the first time a sequence is used:
the first epoch pays for them once, later epochs read them. With captured feature data
(`train feature-data` capturing the final normed layer, ``num_layers``) the target never runs: features
and soft labels (the stored top-k) are read from the data, so any target the engine loads trains heads —
a GGUF file included. ``--draft-vocab N`` (own LM heads) keeps each head's LM head to the N most frequent
tokens of the data (EAGLE-3's choice, see training/eagle.py): labels outside it are dropped and the rest
renormalised, as eagle3 heads are trained. ``--root-token`` heads also read the target's embedding of the
token at t + 1 (the root, known when they draft); ``--parent-token`` heads, from head 1 on, that of the token at
t + 1 + k (the tree node whose child head k guesses; teacher-forced here, as the tree holds it when drafting): see
drafters/medusa_heads.py. ``--init-from DIR`` starts from trained heads of the same shape (fine-tuning them, e.g.
root-token heads into parent-token heads, whose parent products start at zero: step 0 is the heads as trained).

Output: ``medusa_config.json`` + ``medusa_heads.safetensors`` (fp16; see drafters/medusa_heads.py),
``train_log.jsonl``, ``loss_curve.png``, ``train_summary.json``, ``run_config.json``, ``checkpoint/``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from specserve.drafters.medusa_heads import CONFIG_FILE, LM_HEAD_MODES, WEIGHTS_FILE, MedusaHeads, save_heads
from specserve.drafters.medusa_tree import choices_from_accuracies, expected_accepted
from specserve.training import setup
from specserve.training.data import IndexSampler
from specserve.training.distill import DistillSet, DistillSettings
from specserve.training.outputs import read_run_config
from specserve.training.presets import TrainSettings, check_float, check_int
from specserve.training.soft_labels import draft_columns, to_columns, topk_kl
from specserve.training.trainer import Trainer
from torch import nn

# Sized for the small default target on 2 CPU cores: ~1.45 s/step in the first epoch (features
# included), ~1.15 s after, so 800 steps of 8 sequences (~3 epochs of the default distill data) take
# ~17 minutes; the 20-minute budget is the safety stop. Three heads: a fourth one's depth-4 nodes were
# reached by the greedy chain 0.3 % of the time in a trial, while it costs a third more per step.
DEFAULT_SETTINGS = TrainSettings(seq_len=256, batch_size=8, lr=2e-3, max_steps=800, warmup_steps=30, min_lr_ratio=0.1,
                                 weight_decay=0.0, log_every=10, eval_every=100, eval_batches=4, checkpoint_every=50,
                                 max_minutes=20.0)
DEFAULT_HEADS = {"num_heads": 3, "num_layers": 1, "lm_head": "shared", "decay": 0.8, "draft_vocab": None,
                 "root_token": False, "parent_token": False, "init_from": None}
RANKS = 10  # rank accuracies measured per head (for the static tree)
TREE_SIZE = 20  # nodes of the static tree written into the checkpoint
CACHE_LIMIT_BYTES = 4 << 30  # cache target features up to this size (fp16), else recompute each batch


def train_medusa(
    target: str | Path,
    out: str | Path,
    *,
    data: str | Path | None = None,
    num_heads: int | None = None,
    num_layers: int | None = None,
    lm_head: str | None = None,
    decay: float | None = None,
    draft_vocab: int | None = None,
    root_token: bool | None = None,
    parent_token: bool | None = None,
    init_from: str | Path | None = None,
    distill_settings: DistillSettings | None = None,
    **options,
) -> dict:
    """Train (or resume) Medusa heads for ``target``; return the run summary. ``options``: `setup.RunOptions`.

    ``data``: self-distillation data (`train distill-data`; ``target`` a model directory transformers loads)
    or captured feature data (`train feature-data`; ``target`` anything the engine loads, None the default
    model)."""
    from specserve.training.feature_data import is_feature_data

    run = setup.RunOptions.of("train_medusa", options)
    out_dir = Path(out).expanduser()
    given_heads = {"num_heads": num_heads, "num_layers": num_layers, "lm_head": lm_head, "decay": decay,
                   "draft_vocab": draft_vocab, "root_token": root_token, "parent_token": parent_token,
                   "init_from": None if init_from is None else str(Path(init_from).expanduser().resolve())}
    if run.resume:
        recorded = _recorded(out_dir)
        spec = {"draft_vocab": None, "root_token": False, "parent_token": False, "init_from": None,
                **recorded["heads"]}  # settings added since read as defaults
        changed = sorted(k for k, v in given_heads.items() if v is not None and v != spec[k])
        if changed:
            raise ValueError(f"--resume: the run in {str(out_dir)!r} was started with other {', '.join(changed)}")
        base = TrainSettings(**recorded["settings"])
        if data is None:
            data = recorded.get("data")
    else:
        spec = {k: (DEFAULT_HEADS[k] if v is None else v) for k, v in given_heads.items()}
        base = DEFAULT_SETTINGS
    settings = replace(base, **run.overrides()).validate()
    _check_spec(spec)
    if is_feature_data(data):
        return _train_on_features(target, out_dir, data, spec, settings, run)
    if spec["draft_vocab"] is not None or spec["init_from"] is not None:
        raise ValueError("--draft-vocab and --init-from train on captured feature data (`train feature-data`): pass it "
                         "as --data")
    from transformers import AutoConfig, AutoModelForCausalLM

    if target is None:
        raise ValueError("--target is required (it may be left out only with --data from `train feature-data`)")
    target_dir = Path(target).expanduser().resolve()
    if not (target_dir / "config.json").is_file():
        raise ValueError(f"target directory {str(target_dir)!r} has no config.json")
    target_config = AutoConfig.from_pretrained(str(target_dir))
    distill_settings = setup.distill_settings_for(data, distill_settings, target_config.max_position_embeddings,
                                                  target_config.vocab_size)
    with setup.distributed_run(run.device, single_process="train medusa") as dist:
        data_dir, train_set, heldout_set, manifest = setup.start_drafter_run(
            dist, run, target_dir, out_dir, data, distill_settings, own_files=(CONFIG_FILE, WEIGHTS_FILE),
            run_config=setup.run_record("train medusa", run, dist, target_dir, data, heads=spec, settings=asdict(settings)))
        if manifest.get("vocab_size") not in (None, target_config.vocab_size):
            raise ValueError(f"the distillation data in {str(data_dir)!r} has vocab_size {manifest.get('vocab_size')}, "
                             f"the target {target_config.vocab_size}")

        teacher = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(dist.device).eval()
        teacher.requires_grad_(False)
        lm_weight = teacher.get_output_embeddings().weight.detach()
        embed = teacher.get_input_embeddings().weight.detach()
        evalset = heldout_set if heldout_set is not None else train_set.take(settings.eval_batches * settings.batch_size)
        features = {"train": _Features(teacher.model, train_set, dist.device),
                    "eval": _Features(teacher.model, evalset, dist.device)}
        return _fit(dist, run, out_dir, target_dir, data_dir, spec, settings, lm_weight, embed, None,
                    train=(len(train_set), float(train_set.lengths.float().mean()),
                           lambda ids: _batch(train_set, features["train"], ids, dist.device)),
                    heldout=(len(evalset), lambda ids: _batch(evalset, features["eval"], ids, dist.device)))


def _train_on_features(target, out_dir: Path, data, spec: dict, settings: TrainSettings, run) -> dict:
    """`train_medusa` on captured feature data: features and labels come from the data, the target never runs."""
    from specserve.drafters.eagle_checkpoint import target_config
    from specserve.loading import resolve_model
    from specserve.training.eagle import TargetWeights, draft_vocabulary
    from specserve.training.outputs import write_json

    target_path = resolve_model(target).resolve()
    if not target_path.exists():
        raise ValueError(f"target {str(target_path)!r} does not exist")
    if spec["draft_vocab"] is not None and spec["lm_head"] != "own":
        raise ValueError("--draft-vocab needs --lm-head own (a shared LM head scores the target's whole vocabulary)")
    config = target_config(target_path)
    num_layers, vocab = int(config["num_hidden_layers"]), int(config["vocab_size"])
    with setup.distributed_run(run.device, single_process="train medusa") as dist:
        data_dir, train_set, heldout_set, manifest = setup.start_feature_run(dist, run, target_path, out_dir, data,
                                                                             (CONFIG_FILE, WEIGHTS_FILE))
        layers = list(manifest["feature_layers"])
        if num_layers not in layers:
            raise ValueError(f"the feature data in {str(data_dir)!r} holds layers {layers}, not the final normed state "
                             f"Medusa heads read (layer {num_layers}): capture it with `specserve train feature-data "
                             f"--feature-layers {','.join(map(str, sorted(set(layers) | {num_layers})))}`")
        if int(train_set.tokens.max()) >= vocab:
            raise ValueError(f"the data in {str(data_dir)!r} has token ids outside the target's vocabulary")
        if not run.resume:
            write_json(out_dir / setup.RUN_CONFIG_FILE, setup.run_record(
                "train medusa", run, dist, target_path, data, heads=spec, settings=asdict(settings)))
        weights = TargetWeights.of(target_path, True, dist.device)
        initial = _initial_heads(spec, weights.lm_head) if spec["init_from"] is not None else None
        if initial is not None:  # the heads trained before keep their draft vocabulary
            draft_ids = initial.draft_to_target
        else:
            draft_ids = draft_vocabulary(train_set, vocab, spec["draft_vocab"]) if spec["draft_vocab"] else None
        evalset = heldout_set if heldout_set is not None else train_set
        batches = _CapturedBatches(layers.index(num_layers), draft_ids, vocab)
        return _fit(dist, run, out_dir, target_path, data_dir, spec, settings, weights.lm_head, weights.embed, draft_ids,
                    train=(len(train_set), float(train_set.lengths.float().mean()),
                           lambda ids: batches(train_set, ids, dist.device)),
                    heldout=(len(evalset), lambda ids: batches(evalset, ids, dist.device)), initial=initial)


def _fit(dist, run, out_dir: Path, target: Path, data_dir: Path, spec: dict, settings: TrainSettings,
         lm_weight: torch.Tensor, embed: torch.Tensor, draft_ids: torch.Tensor | None, *, train, heldout,
         initial: MedusaHeads | None = None) -> dict:
    """Train the heads and write them with their tree and records; return the run summary.

    lm_weight, embed: the target's LM head and token embeddings [V, H] (float32); draft_ids: the draft vocabulary
    int64[V'] or None; train: (sequences, mean length, ids -> batch); heldout: (sequences, ids -> batch); initial:
    trained heads to start from (`--init-from`), or None. A batch holds tokens int64[B, T], features float32[B, T, H],
    mask bool[B, T] (row t has a label), topk_ids int64[B, T, k] (columns of the heads' logits, -1 outside a draft
    vocabulary) and topk_logprobs float32[B, T, k] (-inf there)."""
    hidden, vocab = lm_weight.shape[1], lm_weight.shape[0]
    torch.manual_seed(settings.seed)
    heads = MedusaHeads(hidden, vocab, spec["num_heads"], spec["num_layers"], spec["lm_head"],
                        None if draft_ids is None else len(draft_ids), spec["root_token"], spec["parent_token"])
    if draft_ids is not None:
        heads.set_draft_vocab(draft_ids)
    heads.init_lm_heads(lm_weight)
    if initial is not None:  # every tensor they have; parent products they lack stay at zero
        heads.load_state_dict(initial.state_dict(), strict=False)
    model = _Trainable(heads, lm_weight if spec["lm_head"] == "shared" else lm_weight[:0],
                       embed if spec["root_token"] else embed[:0])
    num_train, mean_len, train_batch = train
    num_eval, eval_batch = heldout
    weights = [spec["decay"] ** k for k in range(spec["num_heads"])]
    sampler = IndexSampler(num_train, settings.batch_size, settings.seed)
    vocab_note = (f", draft vocabulary {len(draft_ids)}" if draft_ids is not None else "") \
        + (", reading the root token" if spec["root_token"] else "") \
        + (" and the parent's" if spec["parent_token"] else "") \
        + (f", from {spec['init_from']}" if spec["init_from"] else "")
    print(f"medusa: {spec['num_heads']} heads x {spec['num_layers']} block(s), {spec['lm_head']} LM head{vocab_note}, "
          f"{sum(p.numel() for p in heads.parameters()) / 1e6:.2f}M trainable parameters; {num_train} train / "
          f"{num_eval} held-out sequences", file=sys.stderr)
    latest: dict = {}

    def batch_fn(step: int, rank: int, world: int):
        return train_batch(sampler.ids(step, rank, world))

    def loss_fn(module, batch):
        return _loss(module, batch, weights)

    def eval_fn(module) -> dict[str, float]:
        metrics, ranks = _evaluate(module, eval_batch, num_eval, weights, settings)
        latest["rank_accuracy"] = ranks
        return metrics

    trainer = Trainer(
        model, settings, out_dir, dist=dist, batch_fn=batch_fn, loss_fn=loss_fn, eval_fn=eval_fn,
        tokens_per_step=round(settings.batch_size * mean_len),
        run_key={"heads": spec, "batch_size": settings.batch_size, "seed": settings.seed, "lr": settings.lr,
                 "data": str(data_dir.resolve()), "target": str(target)},
        desc=f"train medusa/{spec['num_heads']}x{spec['lm_head']}",
    )
    summary, started = setup.run_trainer(trainer, run)
    if "rank_accuracy" not in latest:  # the run ended right after a log record: evaluate now
        summary["last_eval"] = trainer.log_evaluation()
    rank_accuracy = latest["rank_accuracy"]
    choices = choices_from_accuracies(rank_accuracy, TREE_SIZE)
    metrics = {k: round(v, 5) for k, v in trainer.last_eval.items()}
    config = save_heads(trainer.module.heads, out_dir, target, extra={
        "choices": choices, "metrics": metrics, "rank_accuracy": [[round(a, 5) for a in row] for row in rank_accuracy],
        "distill_data": str(data_dir.resolve()), "decay": spec["decay"], "step": trainer.step,
    })
    setup.finish_run(
        out_dir, summary, started,
        f"medusa {spec['num_heads']} heads ({spec['lm_head']} LM head{vocab_note}): weighted KL to the target",
        kind="medusa", heads=spec, target=str(target), argv=run.argv, data=str(data_dir.resolve()),
        num_trainable_params=sum(p.numel() for p in trainer.module.heads.parameters()),
        checkpoint_bytes=(out_dir / WEIGHTS_FILE).stat().st_size, choices=choices,
        expected_accepted_static=round(expected_accepted(choices, rank_accuracy), 3),
        fingerprint=config["target"].get("fingerprint") or config["target"].get("file_sha256"))
    return summary


class _Trainable(nn.Module):
    """The heads plus the target's frozen LM head and token embeddings (non-persistent buffers: not trained, not
    saved; each empty where the heads do not read it)."""

    def __init__(self, heads: MedusaHeads, lm_weight: torch.Tensor, embed: torch.Tensor) -> None:
        super().__init__()
        self.heads = heads
        self.register_buffer("lm_weight", lm_weight.clone(), persistent=False)
        self.register_buffer("embed", embed.clone(), persistent=False)


class _Features:
    """Target features of a DistillSet's sequences, computed one sequence at a time and cached (fp16)."""

    def __init__(self, body: nn.Module, data: DistillSet, device: torch.device) -> None:
        self.body, self.data, self.device = body, data, device
        n, t = data.tokens.shape
        hidden = body.config.hidden_size
        self.cache = None
        if n * t * hidden * 2 <= CACHE_LIMIT_BYTES:
            self.cache = torch.empty(n, t, hidden, dtype=torch.float16)
            self.done = torch.zeros(n, dtype=torch.bool)

    def get(self, ids: torch.Tensor, length: int) -> torch.Tensor:
        """float32[B, length, H]: final normed hidden states of sequences ``ids`` (positions < length)."""
        out = []
        for i in ids.tolist():
            if self.cache is not None and self.done[i]:
                out.append(self.cache[i, :length])
                continue
            with torch.no_grad():
                h = self.body(input_ids=self.data.tokens[i : i + 1].to(self.device)).last_hidden_state[0].float().cpu()
            if self.cache is not None:
                self.cache[i] = h.half()
                self.done[i] = True
                h = self.cache[i]
            out.append(h[:length])
        return torch.stack(out).float().to(self.device)


class _CapturedBatches:
    """Batches (`_fit`'s layout) read from captured feature data (training/feature_data.py): sequences padded
    to the batch's longest; the features are the data's final normed layer (index ``layer`` of its layers);
    with a draft vocabulary the stored top-k ids become its columns, and ids outside it are dropped (-1,
    log-probability -inf) so the rest renormalise — a row with none left has no label (mask false)."""

    def __init__(self, layer: int, draft_ids: torch.Tensor | None, vocab: int) -> None:
        self.layer = layer
        self.columns = None if draft_ids is None else draft_columns(draft_ids, vocab)

    def __call__(self, data, ids: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        padded = data.padded(ids, [self.layer])
        feats, top_ids, top_logp = padded["features"][:, :, 0], padded["topk_ids"], padded["topk_logprobs"]
        if self.columns is not None:
            top_ids, top_logp = to_columns(self.columns, top_ids, top_logp)
        mask = torch.isfinite(top_logp).any(-1)  # padding rows and rows with no label in the draft vocabulary
        return {"tokens": padded["tokens"].to(device), "features": feats.to(device), "mask": mask.to(device),
                "topk_ids": top_ids.to(device), "topk_logprobs": top_logp.to(device)}


def _batch(data: DistillSet, features: _Features, ids: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    lengths = data.lengths[ids]
    t = int(lengths.max())
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return {
        "tokens": data.tokens[ids, :t].long().to(device),
        "features": features.get(ids, t),
        "mask": mask.to(device),
        "topk_ids": data.topk_ids[ids, :t].to(device),
        "topk_logprobs": data.topk_logprobs[ids, :t].float().to(device),
    }


def _head_terms(module: _Trainable, batch, k: int):
    """Head k on every position t with a label row t + k + 1: (logq [B, T', V'], kl [B, T'], mask [B, T']);
    kl is 0 where mask is false. Label ids of -1 (outside a draft vocabulary) carry log-probability -inf."""
    shift = k + 1
    h = batch["features"]
    if h.shape[1] <= shift:
        return None
    lm = None if module.heads.lm_heads is not None else module.lm_weight
    count = h.shape[1] - shift
    # The root of the feature at t is the token at t + 1 (what the target chose there: known when drafting).
    roots = module.embed[batch["tokens"][:, 1 : count + 1]] if module.heads.root_token else None  # [B, T', H]
    # The parent of head k's guess is the token at t + 1 + k (head 0's is the root), teacher-forced: a tree
    # expands a node with its token known, and a guess below a wrong one is never accepted anyway.
    parents = module.embed[batch["tokens"][:, shift : count + shift]] if module.heads.parent_token and k else None
    logits = module.heads(h[:, :count], lm, heads=1, first=k, root_embed=roots, parent_embed=parents)[0].float()
    logq = torch.log_softmax(logits, dim=-1)
    mask = batch["mask"][:, shift:]
    # Labels that are no label (-1 ids, -inf: outside a draft vocabulary; padding) get p = 0 exactly.
    kl = topk_kl(logq, batch["topk_ids"][:, shift:], batch["topk_logprobs"][:, shift:])
    return logq, torch.where(mask, kl, 0.0), mask


def _loss(module: _Trainable, batch, weights: list[float]) -> torch.Tensor:
    total = 0.0
    norm = 0.0
    for k, w in enumerate(weights):
        terms = _head_terms(module, batch, k)
        if terms is None or not bool(terms[2].any()):
            continue
        _, kl, mask = terms
        total = total + w * kl.sum() / mask.sum()
        norm += w
    if norm == 0.0:
        raise ValueError("the training sequences are too short for the Medusa heads (need > num_heads + 1 tokens)")
    return total / norm


def _evaluate(module, batch_of, num_eval: int, weights, settings: TrainSettings):
    """Held-out weighted KL and per-head KL/top-1/top-5, plus rank accuracies for the static tree.

    Returns (metrics, ranks): ``ranks[k][j]`` is how often the target's argmax is head k's rank-j
    token *given that heads 0..k-1 all had it at rank 0* (head 0: unconditionally). A depth-(k+1)
    node is only reached when its prefix was accepted, and heads err together (a predictable stretch
    of text is predictable for all of them), so conditional rates size deep trees better than a
    product of marginals would. ``h{k}_top1_chain`` is how often heads 0..k are all right.
    """
    num_heads = len(weights)
    sums = [{"kl": 0.0, "n": 0, "top": torch.zeros(RANKS + 1, dtype=torch.float64),
             "cond": torch.zeros(RANKS + 1, dtype=torch.float64), "chain": 0} for _ in range(num_heads)]
    limit = min(num_eval, settings.eval_batches * settings.batch_size)
    for start in range(0, limit, settings.batch_size):
        batch = batch_of(torch.arange(start, min(start + settings.batch_size, limit)))
        prefix_ok = None  # [B, T_k]: heads 0..k-1 all had the target's argmax at rank 0
        for k in range(num_heads):
            terms = _head_terms(module, batch, k)
            if terms is None:
                break
            logq, kl, mask = terms
            best = batch["topk_ids"][:, k + 1 :, 0]  # the target's argmax at the label row (-1: not draftable)
            rank = (logq > logq.gather(-1, best.clamp_min(0)[..., None])).sum(-1).clamp(max=RANKS)  # [B, T']
            rank = torch.where(best >= 0, rank, RANKS)
            ok = mask if prefix_ok is None else mask & prefix_ok[:, : mask.shape[1]]
            s = sums[k]
            s["kl"] += float(kl.sum())
            s["n"] += int(mask.sum())
            s["top"] += torch.bincount(rank[mask].cpu(), minlength=RANKS + 1).double()
            s["cond"] += torch.bincount(rank[ok].cpu(), minlength=RANKS + 1).double()
            prefix_ok = ok & (rank == 0)
            s["chain"] += int(prefix_ok.sum())
    metrics: dict[str, float] = {}
    ranks = []
    weighted, norm = 0.0, 0.0
    for k, s in enumerate(sums):
        n = max(s["n"], 1)
        top = (s["top"][:RANKS] / n).tolist()
        cond = (s["cond"][:RANKS] / max(float(s["cond"].sum()), 1.0)).tolist()
        ranks.append(cond)
        metrics[f"h{k}_kl"] = s["kl"] / n
        metrics[f"h{k}_top1"] = top[0]
        metrics[f"h{k}_top5"] = sum(top[:5])
        metrics[f"h{k}_top1_chain"] = s["chain"] / n
        if s["n"]:
            weighted += weights[k] * s["kl"] / n
            norm += weights[k]
    return {"eval_loss": weighted / max(norm, 1e-12), **metrics}, ranks


def _check_spec(spec: dict) -> None:
    check_int("num_heads", spec["num_heads"], 1, 16)
    check_int("num_layers", spec["num_layers"], 0, 8)
    if spec["lm_head"] not in LM_HEAD_MODES:
        raise ValueError(f"lm_head must be one of {list(LM_HEAD_MODES)}, got {spec['lm_head']!r}")
    check_float("decay", spec["decay"], 0, 1, low_open=True)
    if spec["draft_vocab"] is not None:
        check_int("draft_vocab", spec["draft_vocab"], 1, 1 << 24)
    if spec["root_token"] not in (False, True):
        raise ValueError(f"root_token must be true or false, got {spec['root_token']!r}")
    if spec["parent_token"] not in (False, True):
        raise ValueError(f"parent_token must be true or false, got {spec['parent_token']!r}")
    if spec["parent_token"] and not spec["root_token"]:
        raise ValueError("--parent-token heads read the root token too: add --root-token")


def _initial_heads(spec: dict, lm_weight: torch.Tensor) -> MedusaHeads:
    """The heads ``--init-from`` names, checked against this run's shape (they may lack the parent products,
    which then start at zero). lm_weight: the target's [V, H], for its sizes."""
    from specserve.drafters.medusa_heads import load_heads

    vocab, hidden = lm_weight.shape
    heads = load_heads(spec["init_from"], hidden_size=hidden, vocab_size=vocab).heads
    have = {"num_heads": heads.num_heads, "num_layers": heads.num_layers, "lm_head": heads.lm_head_mode,
            "draft_vocab": heads.draft_vocab_size, "root_token": heads.root_token}
    wrong = [f"{k} {v!r} (this run: {spec[k]!r})" for k, v in have.items() if spec[k] != v]
    if heads.parent_token and not spec["parent_token"]:
        wrong.append("parent_token True (this run: False)")
    if wrong:
        raise ValueError(f"--init-from: the heads in {spec['init_from']!r} have {', '.join(wrong)}: pass the same options")
    return heads


def _recorded(out_dir: Path) -> dict:
    recorded = read_run_config(out_dir)
    if recorded.get("command") != "train medusa" or "heads" not in recorded or "settings" not in recorded:
        raise ValueError(f"--resume: the run in {str(out_dir)!r} is not a `train medusa` run")
    return recorded


def cmd_medusa(args) -> int:
    """Handler of ``specserve train medusa`` (registered in training/cli.py)."""
    from specserve.training.cli import _distill_settings, _report, _set_threads, run_options

    _set_threads(args.threads)
    summary = train_medusa(
        args.target, args.out, data=args.data, num_heads=args.heads, num_layers=args.layers, lm_head=args.lm_head,
        decay=args.decay, draft_vocab=args.draft_vocab, root_token=args.root_token, parent_token=args.parent_token,
        init_from=args.init_from, distill_settings=_distill_settings(args), **run_options(args),
    )
    _report(summary, args.out)
    return 0
