"""``specserve train bundle``: the embedded default model and its draft model, from one command.

Stages (each resumable; a finished stage is skipped with ``--resume``), under ``--work``:

1. ``target/``  — ``train lm --preset small`` on the default corpus (the stdlib);
2. ``distill/`` — ``train distill-data`` from the target;
3. ``draft/``   — ``train draft --preset draft`` on that data;
4. measure: speculative acceptance (tau) of the draft drafter on held-out prompts, greedy and sampled;
5. export to the bundle directory (default ``specserve/bundle/``): both models with fp16 weights,
   tokenizers, and ``MANIFEST.json`` — the command, seed, corpus manifest hash, library versions,
   metrics, sizes and the ``default_drafters`` map that `bundle_paths` reads.
"""

from __future__ import annotations

import platform
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from specserve.training import bundle_paths
from specserve.training.distill import GEN_THREADS_CPU, DistillSettings, cpu_threads, make_distill_data
from specserve.training.outputs import MODEL_FILES, read_json, write_json


def build_bundle(
    *,
    work: str | Path = "bundle-work",
    bundle_dir: str | Path | None = None,
    lm_preset: str = "small",
    draft_preset: str = "draft",
    corpus: list[str] | None = None,
    heldout_fraction: float = 0.05,
    lm_max_steps: int | None = None,
    draft_max_steps: int | None = None,
    seed: int = 0,
    distill: DistillSettings = DistillSettings(),
    device: str = "auto",
    resume: bool = False,
    force: bool = False,
    size_limit_mb: float = 48.0,
    argv: list[str] | None = None,
) -> dict:
    """Run every stage and write the bundle; return its manifest."""
    from specserve.training.draft import train_draft
    from specserve.training.lm import train_lm

    if resume and force:
        raise ValueError("--resume and --force contradict each other: pick one")
    if not size_limit_mb > 0:
        raise ValueError(f"size_limit_mb must be > 0, got {size_limit_mb}")
    work = Path(work).expanduser()
    target_bundle = Path(bundle_dir).expanduser() if bundle_dir else bundle_paths.bundle_dir()
    if target_bundle.is_dir() and any(target_bundle.iterdir()):
        if not (target_bundle / bundle_paths.MANIFEST).is_file():
            raise ValueError(f"{str(target_bundle)!r} is not empty and holds no bundle ({bundle_paths.MANIFEST}): "
                             "refusing to replace it")
        if not force:
            raise ValueError(f"a bundle already exists in {str(target_bundle)!r}: pass --force to replace it")
    if work.is_dir() and any(work.iterdir()) and not (resume or force):
        raise ValueError(f"work directory {str(work)!r} is not empty: pass --resume to continue it or --force to start over")
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}

    target_dir, distill_dir, draft_dir = work / "target", work / "distill", work / "draft"
    t0 = time.perf_counter()
    if not _finished(target_dir):
        train_lm(target_dir, preset=lm_preset, corpus=corpus, device=device, resume=_resumable(target_dir, resume),
                 force=force or (resume and not _resumable(target_dir, resume)), max_steps=lm_max_steps, seed=seed,
                 heldout_fraction=heldout_fraction, argv=argv)
    timings["target_s"] = time.perf_counter() - t0
    if not _finished(target_dir):
        raise ValueError(f"the target run in {str(target_dir)!r} stopped early (time budget): rerun with --resume")

    t0 = time.perf_counter()
    manifest = make_distill_data(target_dir, distill_dir, distill, device=device,
                                 resume=resume and distill_dir.is_dir(), force=force)
    timings["distill_s"] = time.perf_counter() - t0
    if not manifest["complete"]:
        raise ValueError(f"the distillation data in {str(distill_dir)!r} is incomplete: rerun with --resume")

    t0 = time.perf_counter()
    if not _finished(draft_dir):
        train_draft(target_dir, draft_dir, data=distill_dir, preset=draft_preset, device=device,
                    resume=_resumable(draft_dir, resume), force=force or (resume and not _resumable(draft_dir, resume)),
                    max_steps=draft_max_steps, seed=seed, argv=argv)
    timings["draft_s"] = time.perf_counter() - t0
    if not _finished(draft_dir):
        raise ValueError(f"the draft run in {str(draft_dir)!r} stopped early (time budget): rerun with --resume")

    t0 = time.perf_counter()
    acceptance = measure_acceptance(target_dir, draft_dir, device=device)
    timings["measure_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - started
    return export_bundle(target_dir, draft_dir, distill_dir, target_bundle, acceptance=acceptance, seed=seed,
                         argv=argv, size_limit_mb=size_limit_mb, timings={k: round(v, 1) for k, v in timings.items()})


def _finished(run_dir: Path) -> bool:
    path = run_dir / "train_summary.json"
    return path.is_file() and read_json(path).get("stopped") == "complete" and (run_dir / "model.safetensors").is_file()


def _resumable(run_dir: Path, resume: bool) -> bool:
    return resume and (run_dir / "checkpoint" / "state.pt").is_file()


def measure_acceptance(target_dir: Path, draft_dir: Path, *, device: str = "auto", num_prompts: int = 16,
                       prompt_tokens: int = 48, max_tokens: int = 64, depth: int = 4) -> dict:
    """Mean accepted length (tau, bonus included) of ``draft:DIR`` on held-out prompts, greedy and T=1.

    Prompt and output lengths shrink to fit the target's context window when it is short.
    """
    import numpy as np
    from specserve.training.data import load_stream

    from specserve import LLM, SamplingParams

    context = read_json(target_dir / "config.json")["max_position_embeddings"]
    prompt_tokens = min(prompt_tokens, context // 4)
    max_tokens = min(max_tokens, context - prompt_tokens)
    stream = load_stream(target_dir / "data" / "heldout.npy")
    if len(stream) <= prompt_tokens:
        raise ValueError("the held-out split is too short to measure acceptance")
    starts = np.random.default_rng(1234).integers(0, len(stream) - prompt_tokens, size=num_prompts)
    prompts = [stream[a : a + prompt_tokens].tolist() for a in starts]
    llm = LLM(target_dir, drafter=f"draft:{draft_dir}", drafter_options={"depth": depth}, device=device,
              max_num_seqs=num_prompts)
    out = {"depth": depth, "num_prompts": num_prompts, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens}
    for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, ignore_eos=True)
                  for i in range(num_prompts)]
        with cpu_threads(GEN_THREADS_CPU if llm.device.type == "cpu" else None):
            res = llm.generate(prompts, params)
        steps = sum(r.spec.num_steps for r in res)
        out[f"tau_{name}"] = round(sum(r.spec.num_emitted for r in res) / max(steps, 1), 3)
    return out


def export_model(src: Path, dst: Path) -> None:
    """Copy a model directory with its floating-point weights cast to fp16 (HF layout kept)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = read_json(src / "config.json")
    config["torch_dtype"] = "float16"
    if "dtype" in config:
        config["dtype"] = "float16"
    write_json(dst / "config.json", config)
    for name in MODEL_FILES:
        if name not in ("config.json", "model.safetensors") and (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def export_bundle(target_dir: Path, draft_dir: Path, distill_dir: Path, bundle_dir: Path, *, acceptance: dict,
                  seed: int, argv: list[str] | None, size_limit_mb: float, timings: dict) -> dict:
    """Write the bundle next to ``bundle_dir`` and swap it in once complete and within the size limit."""
    import tokenizers
    import torch
    import transformers

    tmp = bundle_dir.with_name(bundle_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    export_model(target_dir, tmp / "target")
    export_model(draft_dir, tmp / "draft")
    draft_config = read_json(draft_dir / "draft_config.json")
    draft_config.update({"target": "../target", "distill_data": None})
    write_json(tmp / "draft" / "draft_config.json", draft_config)
    for run, name in ((target_dir, "target"), (draft_dir, "draft")):
        if (run / "loss_curve.png").is_file():
            shutil.copy2(run / "loss_curve.png", tmp / f"{name}_loss_curve.png")
    shutil.copy2(target_dir / "corpus_manifest.json", tmp / "corpus_manifest.json")

    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    size_mb = sum(files.values()) / 2**20
    if size_mb > size_limit_mb:
        shutil.rmtree(tmp)
        raise ValueError(f"the bundle would be {size_mb:.1f} MiB, over the {size_limit_mb} MiB limit: use smaller presets")
    target_summary, draft_summary = read_json(target_dir / "train_summary.json"), read_json(draft_dir / "train_summary.json")
    corpus = read_json(target_dir / "corpus_manifest.json")
    manifest = {
        "format": 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "specserve " + " ".join(argv) if argv else "specserve train bundle",
        "seed": seed,
        "default_model": "target",
        "default_drafters": {"draft": "draft"},
        "corpus": {"sha256": corpus["sha256"], "totals": corpus["totals"], "roots": corpus["roots"]},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "metrics": {
            "target": _run_metrics(target_summary),
            "draft": _run_metrics(draft_summary),
            "acceptance": acceptance,
            "distill": read_json(distill_dir / "distill_manifest.json").get("stats"),
        },
        "timings": timings,
        "files": files,
        "size_mb": round(size_mb, 2),
    }
    write_json(tmp / bundle_paths.MANIFEST, manifest)
    if bundle_dir.exists():
        shutil.rmtree(bundle_dir)
    tmp.rename(bundle_dir)
    manifest["bundle_dir"] = str(bundle_dir)
    print(f"bundle: {bundle_dir} ({size_mb:.1f} MiB); tau greedy {acceptance['tau_greedy']}, T=1 {acceptance['tau_t1']}",
          file=sys.stderr)
    return manifest


def _run_metrics(summary: dict) -> dict:
    keys = ("preset", "num_params", "step", "tokens", "train_seconds", "tokens_per_s", "first_loss", "final_loss", "world_size")
    return {k: summary.get(k) for k in keys if k in summary} | {"eval": summary.get("last_eval", {})}

