"""``specserve train ...``: corpus, lm, distill-data, draft, draft-vocab, medusa, eagle, bundle.

Registered by `specserve.cli` with `add_train_parser`; heavy imports happen inside the handlers.
(``train default-drafter`` runs evaluations: `specserve.evals.default_drafter` registers it.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_train_parser(sub, parser_class):
    """Register ``train`` and its subcommands on the top-level subparsers ``sub``; return the ``train``
    subparsers, where `specserve.cli` adds ``default-drafter`` (it runs evaluations:
    `specserve.evals.default_drafter`, which training code does not import)."""
    from specserve.training.eagle import add_eagle_args  # light: heavy imports live in its functions
    from specserve.training.feature_data import add_feature_data_args, cmd_feature_data
    from specserve.training.ship import add_ship_args, cmd_ship

    train = sub.add_parser("train", help="train the models specserve serves: corpus, lm, distill-data, feature-data, draft, medusa, eagle, bundle")
    tsub = train.add_subparsers(dest="train_command", required=True, parser_class=parser_class)

    corpus = tsub.add_parser("corpus", help="collect a corpus, split it by module and write its manifest")
    _corpus_args(corpus)
    corpus.add_argument("--out", default=None, help="write the manifest JSON here (default: print the summary only)")
    corpus.set_defaults(handler=cmd_corpus)

    lm = tsub.add_parser("lm", help="train a Llama LM (tokenizer included) in Hugging Face layout")
    lm.add_argument("--preset", default=None, choices=["tiny", "small"], help="required unless --resume")
    _corpus_args(lm)
    lm.add_argument("--out", required=True, help="output model directory")
    lm.add_argument("--tokenizer", default=None, help="reuse the tokenizer of this model directory instead of training one")
    _run_args(lm, seq_len=True)
    lm.set_defaults(handler=cmd_lm)

    distill = tsub.add_parser("distill-data", help="target continuations of corpus prompts with top-k soft labels")
    distill.add_argument("--target", required=True, help="target model directory (with its tokenizer)")
    distill.add_argument("--out", required=True, help="output data directory")
    _corpus_args(distill, default_help="default: the target's own corpus split when it was trained here, else the stdlib")
    _distill_args(distill)
    _budget_args(distill)
    distill.set_defaults(handler=cmd_distill)

    features = tsub.add_parser("feature-data", help="chat answers of any target (a GGUF file included) with the features "
                                                    "and soft labels an EAGLE-3 head trains on, captured once")
    add_feature_data_args(features)
    _corpus_args(features)
    features.add_argument("--device", default="auto", help="auto | cpu | cuda: where the target answers (auto: a GPU "
                                                          "when there is one)")
    features.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16: the target's torch layers off the "
                                                        "CPU kernels (default: the engine's, bfloat16 on a GPU)")
    features.add_argument("--threads", type=int, default=None, help="CPU threads for the kernels (default: all cores)")
    features.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget; stops after a whole shard")
    features.add_argument("--resume", action="store_true", help="continue the data in --out (written shards are kept)")
    features.add_argument("--force", action="store_true", help="overwrite the data in a non-empty --out")
    features.set_defaults(handler=cmd_feature_data)

    draft = tsub.add_parser("draft", help="distil a small draft model from a target (serve it as draft:OUT)")
    draft.add_argument("--target", default=None,
                       help="target model: a directory (with its tokenizer), or with --data from `train feature-data` any "
                            "model the engine loads (default there: the default model)")
    draft.add_argument("--out", required=True, help="output model directory")
    draft.add_argument("--data", default=None,
                       help="distill-data directory (default: generate one in OUT/distill), or `train feature-data` output "
                            "(the draft is then cut from the target's own layers)")
    draft.add_argument("--preset", default=None, choices=["draft", "tiny"],
                       help="a new draft model's shape (default: draft; resume: the run's)")
    draft.add_argument("--init-layers", default=None,
                       help="with feature data: the target layers the draft keeps, comma-separated (default: the first "
                            "two and the last)")
    draft.add_argument("--draft-vocab", type=int, default=None,
                       help="with feature data: LM head over the N most frequent tokens of the data (default 4096)")
    draft.add_argument("--storage", default=None, choices=["float16", "int8"],
                       help="with feature data: how the weights are written (default float16; int8: half the bytes)")
    _run_args(draft, seq_len=False)
    _distill_args(draft, prefix="distill options (only when --data is not given)")
    draft.set_defaults(handler=cmd_draft)

    vocab = tsub.add_parser("draft-vocab", help="give a draft model a draft vocabulary: its LM head keeps the N most "
                                                "frequent target tokens (cheaper levels; not retrained)")
    vocab.add_argument("--draft", required=True, help="draft model directory (written beside its weights)")
    vocab.add_argument("--size", type=int, default=2048, help="tokens in the draft vocabulary (default 2048)")
    vocab.add_argument("--corpus-manifest", default=None, metavar="FILE",
                       help="count tokens on this corpus manifest's train split (default: the target's own corpus "
                            "when it was trained here, else --corpus)")
    _corpus_args(vocab)
    vocab.set_defaults(handler=cmd_draft_vocab)

    medusa = tsub.add_parser("medusa", help="train Medusa heads on a frozen target (serve them as medusa:OUT)")
    medusa.add_argument("--target", default=None,
                        help="target model: a directory (with its tokenizer), or with --data from `train feature-data` any "
                             "model the engine loads (default there: the default model)")
    medusa.add_argument("--out", required=True, help="output heads directory")
    medusa.add_argument("--data", default=None,
                        help="distill-data directory (default: generate one in OUT/distill), or `train feature-data` "
                             "output holding the final normed layer")
    medusa.add_argument("--heads", type=int, default=None, help="number of heads = tree depth (default 3; resume: the run's)")
    medusa.add_argument("--layers", type=int, default=None, help="residual blocks per head (default 1)")
    medusa.add_argument("--lm-head", default=None, choices=["shared", "own"],
                        help="shared: every head reads through the target's LM head (small); own: one trained LM head "
                             "per head (default shared)")
    medusa.add_argument("--decay", type=float, default=None, help="head k's loss weight is decay**k (default 0.8)")
    medusa.add_argument("--draft-vocab", type=int, default=None,
                        help="own LM heads over the N most frequent tokens of feature data (default: the whole vocabulary)")
    medusa.add_argument("--root-token", action="store_true", default=None,
                        help="heads also read the target's embedding of the root token (the one the target just chose), "
                             "so head 0 predicts the token after a known one instead of guessing both")
    medusa.add_argument("--parent-token", action="store_true", default=None,
                        help="heads 1 and on also read the embedding of the tree node they guess a child of (Hydra's "
                             "heads; needs --root-token): each node gets its own children, one heads call per level")
    medusa.add_argument("--init-from", default=None, metavar="DIR",
                        help="start from the trained heads in DIR (same options; e.g. root-token heads fine-tuned into "
                             "parent-token heads, whose new products start at zero)")
    _run_args(medusa, seq_len=False)
    _distill_args(medusa, prefix="distill options (only when --data is not given)")
    medusa.set_defaults(handler=cmd_medusa)

    eagle = tsub.add_parser("eagle", help="train an EAGLE head on a frozen target (serve it as eagle:OUT)")
    add_eagle_args(eagle)
    _run_args(eagle, seq_len=False)
    _distill_args(eagle, prefix="distill options (only when --data is not given)")
    eagle.set_defaults(handler=cmd_eagle)

    ship = tsub.add_parser("ship", help="put drafters trained for the default model into the package "
                                         "(specserve/default_model_drafters, with its MANIFEST)")
    add_ship_args(ship)
    ship.set_defaults(handler=cmd_ship)

    bundle = tsub.add_parser("bundle", help="train the embedded default model and its drafters (long: see README)")
    bundle.add_argument("--work", default="bundle-work", help="working directory for the runs (default: ./bundle-work)")
    bundle.add_argument("--bundle-dir", default=None, help="where the bundle goes (default: the package's specserve/bundle)")
    bundle.add_argument("--lm-preset", default="small", choices=["tiny", "small"])
    bundle.add_argument("--draft-preset", default="draft", choices=["draft", "tiny"])
    _corpus_args(bundle)
    bundle.add_argument("--lm-max-steps", type=int, default=None)
    bundle.add_argument("--draft-max-steps", type=int, default=None)
    bundle.add_argument("--heads", default="medusa,eagle",
                        help="drafter heads to train and ship, comma-separated (default medusa,eagle; '' for none)")
    bundle.add_argument("--head-max-steps", type=int, default=None, help="cap the head runs' steps (tests)")
    bundle.add_argument("--seed", type=int, default=0)
    bundle.add_argument("--size-limit-mb", type=float, default=48.0)
    _distill_args(bundle)
    bundle.add_argument("--device", default="auto", help="auto | cpu | cuda")
    bundle.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    bundle.add_argument("--resume", action="store_true", help="continue the runs in --work (finished stages are skipped)")
    bundle.add_argument("--force", action="store_true", help="overwrite --work's runs and an existing bundle")
    bundle.set_defaults(handler=cmd_bundle)
    return tsub


def _corpus_args(p, default_help: str = "default: the Python standard library of this interpreter") -> None:
    p.add_argument("--corpus", action="append", default=None, metavar="PATH",
                   help=f"text/code file or directory (repeatable; {default_help})")
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="share of modules held out (default 0.05)")


def _budget_args(p) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget; stops cleanly and saves")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--force", action="store_true", help="overwrite the run files in a non-empty --out")


def _run_args(p, seq_len: bool) -> None:
    _budget_args(p)
    p.add_argument("--max-steps", type=int, default=None, help="optimiser steps (default: the preset's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step over all processes")
    if seq_len:
        p.add_argument("--seq-len", type=int, default=None, help="tokens per training sequence (= the context window)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="stop cleanly after this step (the schedule still spans --max-steps); continue with --resume")


def _distill_args(p, prefix: str = "distillation data") -> None:
    g = p.add_argument_group(prefix)
    g.add_argument("--num-prompts", type=int, default=None, help="train prompts (default 2048)")
    g.add_argument("--heldout-prompts", type=int, default=None, help="held-out prompts (default 64)")
    g.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 48)")
    g.add_argument("--new-tokens", type=int, default=None, help="generated tokens per prompt (default 160)")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature of the target (default 1.0)")
    g.add_argument("--topk", type=int, default=None, help="soft-label top-k (default 16)")
    g.add_argument("--gen-batch-size", type=int, default=None, help="prompts generated per engine batch (default 32)")
    g.add_argument("--drafter", default=None, help="drafter speeding up generation (default 'ngram'; 'none' for plain)")
    g.add_argument("--distill-seed", type=int, default=None, help="seed of prompts and sampling (default 0)")


def _distill_settings(args):
    from specserve.training.distill import DistillSettings

    given = {
        "num_prompts": args.num_prompts, "heldout_prompts": args.heldout_prompts, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "temperature": args.temperature, "topk": args.topk,
        "batch_size": args.gen_batch_size, "seed": args.distill_seed,
    }
    settings = DistillSettings(**{k: v for k, v in given.items() if v is not None})
    if args.drafter is not None:
        from dataclasses import replace

        settings = replace(settings, drafter=None if args.drafter.lower() == "none" else args.drafter)
    return settings


def cmd_corpus(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specserve.training.corpus import build_corpus

    corpus = build_corpus(args.corpus, heldout_fraction=args.heldout_fraction)
    print(corpus.summary())
    if args.out:
        digest = corpus.write_manifest(Path(args.out))
        print(f"manifest: {args.out} (sha256 {digest[:16]}…)")
    return 0


def cmd_lm(args: argparse.Namespace) -> int:
    _set_threads(args.threads)
    from specserve.training.lm import train_lm

    summary = train_lm(args.out, preset=args.preset, corpus=args.corpus, seq_len=args.seq_len, tokenizer=args.tokenizer,
                       heldout_fraction=args.heldout_fraction, **run_options(args))
    _report(summary, args.out)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    _set_threads(args.threads)
    _single_process("distill-data")
    from specserve.training.distill import make_distill_data

    manifest = make_distill_data(args.target, args.out, _distill_settings(args), corpus=args.corpus, device=args.device,
                                 max_minutes=args.max_minutes, resume=args.resume, force=args.force)
    print(json.dumps({"out": args.out, "complete": manifest["complete"], "counts": manifest["counts"],
                      "stats": manifest["stats"]}))
    return 0


def cmd_draft(args: argparse.Namespace) -> int:
    _set_threads(args.threads)
    from specserve.training.draft import train_draft
    from specserve.training.feature_data import parse_feature_layers

    summary = train_draft(args.target, args.out, data=args.data, preset=args.preset,
                          distill_settings=_distill_settings(args), init_layers=parse_feature_layers(args.init_layers, "--init-layers"),
                          draft_vocab=args.draft_vocab, storage=args.storage, **run_options(args))
    _report(summary, args.out)
    return 0


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from specserve.training.draft_vocab import write_draft_vocab

    print(json.dumps(write_draft_vocab(args.draft, args.size, corpus_manifest=args.corpus_manifest, corpus=args.corpus,
                                       heldout_fraction=args.heldout_fraction)))
    return 0


def cmd_medusa(args: argparse.Namespace) -> int:
    from specserve.training.medusa import cmd_medusa as run

    return run(args)


def cmd_eagle(args: argparse.Namespace) -> int:
    from specserve.training.eagle import cmd_eagle as run

    return run(args)


def cmd_bundle(args: argparse.Namespace) -> int:
    _set_threads(args.threads)
    _single_process("bundle")  # multi-GPU: torchrun `train lm --out WORK/target` first, then `train bundle --resume`
    from specserve.training.bundle import build_bundle

    manifest = build_bundle(
        work=args.work, bundle_dir=args.bundle_dir, lm_preset=args.lm_preset, draft_preset=args.draft_preset,
        corpus=args.corpus, heldout_fraction=args.heldout_fraction, lm_max_steps=args.lm_max_steps,
        draft_max_steps=args.draft_max_steps, seed=args.seed, distill=_distill_settings(args), device=args.device,
        resume=args.resume, force=args.force, size_limit_mb=args.size_limit_mb, argv=sys.argv[1:],
        heads=tuple(h.strip() for h in args.heads.split(",") if h.strip()), head_max_steps=args.head_max_steps,
    )
    print(json.dumps({"bundle": manifest["bundle_dir"], "size_mb": manifest["size_mb"], "metrics": manifest["metrics"]}))
    return 0


def run_options(args: argparse.Namespace) -> dict:
    """The run options (`specserve.training.setup.RunOptions`) of a ``train lm | draft | medusa | eagle``
    command line, as the keyword arguments of its ``train_*`` function."""
    return {"device": args.device, "max_minutes": args.max_minutes, "resume": args.resume, "force": args.force,
            "max_steps": args.max_steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
            "stop_at_step": args.stop_at_step, "argv": sys.argv[1:]}


def _single_process(what: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"train {what} runs as a single process, not under torchrun")


def _set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if isinstance(threads, bool) or not 1 <= threads <= 1024:
        raise ValueError(f"--threads must be in [1, 1024], got {threads}")
    import torch

    torch.set_num_threads(threads)


def _report(summary: dict, out: str) -> None:
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: the main process reports
        return
    evals = ", ".join(f"{k} {v:.4f}" for k, v in summary.get("last_eval", {}).items())
    print(f"{out}: step {summary['step']}/{summary['max_steps']} ({summary['stopped']}), {summary['tokens']:,} tokens, "
          f"{summary['train_seconds']:.0f}s of training; {evals}")
