"""``specserve train bundle``: the embedded default model and its drafters, from one command.

Stages (each resumable; a finished stage is skipped with ``--resume``), under ``--work``:

1. ``target/``  — ``train lm --preset small`` on the default corpus (the stdlib);
2. ``distill/`` — ``train distill-data`` from the target;
3. ``draft/``   — ``train draft --preset draft`` on that data, then ``train draft-vocab`` (its LM head keeps
   the most frequent quarter of the target's tokens, at least 2,048);
4. ``medusa/``, ``eagle/`` — ``train medusa`` and ``train eagle`` on the same data, each within its
   wall-clock budget (a head run that used its budget counts as finished);
5. measure: speculative acceptance (tau) of every drafter on held-out prompts, greedy and sampled;
6. export to the bundle directory (default ``specserve/bundle/``): the models with fp16 weights,
   tokenizers, the heads, and ``MANIFEST.json`` — the command, seed, corpus manifest hash, library
   versions, metrics, sizes, the ``default_drafters`` map that `bundle_paths` reads and the
   ``default_drafter`` that ``drafter="auto"`` picks (eagle when it was built).
"""

from __future__ import annotations

import platform
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from specserve import bundle_paths
from specserve.drafters.draft_vocab import FILE_NAME as DRAFT_VOCAB_FILE
from specserve.training.distill import GEN_THREADS_CPU, DistillSettings, cpu_threads, make_distill_data
from specserve.training.outputs import MODEL_FILES, read_json, write_json


@dataclass(frozen=True)
class HeadStage:
    """A drafter head trained on the target's distillation data and shipped in the bundle.

    name: drafter name and bundle subdirectory; files: what the bundle keeps of the run;
    train: ``(target_dir, out_dir, data=, device=, max_minutes=, max_steps=, resume=, force=, seed=, argv=)``.
    """

    name: str
    files: tuple[str, ...]
    train: Callable[..., dict]
    minutes: float


def _train_medusa(target_dir, out_dir, **kw) -> dict:
    from specserve.training.medusa import train_medusa

    return train_medusa(target_dir, out_dir, **kw)


def _train_eagle(target_dir, out_dir, **kw) -> dict:
    from specserve.training.eagle import train_eagle

    return train_eagle(target_dir, out_dir, **kw)


# The issues' CPU budgets: Medusa heads in 20 minutes, the EAGLE head in 30 (2 cores).
HEAD_STAGES = {
    "medusa": HeadStage("medusa", ("medusa_config.json", "medusa_heads.safetensors"), _train_medusa, 20.0),
    "eagle": HeadStage("eagle", ("eagle_config.json", "eagle_head.safetensors"), _train_eagle, 29.0),  # + final eval
}
DEFAULT_DRAFTER_ORDER = ("eagle", "medusa", "draft")  # drafter="auto": the first one the bundle has


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
    heads: tuple[str, ...] = ("medusa", "eagle"),
    head_max_steps: int | None = None,
    argv: list[str] | None = None,
) -> dict:
    """Run every stage and write the bundle; return its manifest.

    With ``resume``, an existing bundle is replaced (it is rebuilt from the same work directory).
    """
    from specserve.config import load_config
    from specserve.training.draft import train_draft
    from specserve.training.draft_vocab import write_draft_vocab
    from specserve.training.eagle import default_draft_vocab
    from specserve.training.lm import train_lm

    if resume and force:
        raise ValueError("--resume and --force contradict each other: pick one")
    unknown = sorted(set(heads) - set(HEAD_STAGES))
    if unknown:
        raise ValueError(f"unknown head(s) {unknown}; available: {sorted(HEAD_STAGES)}")
    if not size_limit_mb > 0:
        raise ValueError(f"size_limit_mb must be > 0, got {size_limit_mb}")
    work = Path(work).expanduser()
    target_bundle = Path(bundle_dir).expanduser() if bundle_dir else bundle_paths.bundle_dir()
    if target_bundle.is_dir() and any(target_bundle.iterdir()):
        if not (target_bundle / bundle_paths.MANIFEST).is_file():
            raise ValueError(f"{str(target_bundle)!r} is not empty and holds no bundle ({bundle_paths.MANIFEST}): "
                             "refusing to replace it")
        if not (force or resume):
            raise ValueError(f"a bundle already exists in {str(target_bundle)!r}: pass --force to replace it "
                             "(or --resume to rebuild it from its work directory)")
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
    # Its draft vocabulary: the most frequent quarter of the target's tokens, at least 2,048 (what EAGLE-3
    # heads get), counted on the target's own training split.
    vocab = load_config(draft_dir).vocab_size
    if default_draft_vocab(vocab) < vocab:
        write_draft_vocab(draft_dir, default_draft_vocab(vocab), corpus_manifest=str(target_dir / "corpus_manifest.json"))

    head_dirs: dict[str, Path] = {}
    for name in heads:
        stage, run_dir = HEAD_STAGES[name], work / name
        t0 = time.perf_counter()
        if not _head_finished(run_dir, stage):
            resumable = _resumable(run_dir, resume)
            stage.train(target_dir, run_dir, data=distill_dir, device=device, max_minutes=stage.minutes,
                        max_steps=head_max_steps, resume=resumable, force=force or (resume and not resumable),
                        seed=seed, argv=argv)
        timings[f"{name}_s"] = time.perf_counter() - t0
        if not _head_finished(run_dir, stage):
            raise ValueError(f"the {name} run in {str(run_dir)!r} did not finish: rerun with --resume")
        head_dirs[name] = run_dir

    t0 = time.perf_counter()
    specs = {"draft": f"draft:{draft_dir}", **{name: f"{name}:{path}" for name, path in head_dirs.items()}}
    acceptance = {name: measure_acceptance(target_dir, spec, device=device) for name, spec in specs.items()}
    timings["measure_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - started
    return export_bundle(target_dir, draft_dir, distill_dir, target_bundle, acceptance=acceptance, seed=seed,
                         argv=argv, size_limit_mb=size_limit_mb, timings={k: round(v, 1) for k, v in timings.items()},
                         head_dirs=head_dirs)


def _finished(run_dir: Path) -> bool:
    path = run_dir / "train_summary.json"
    return path.is_file() and read_json(path).get("stopped") == "complete" and (run_dir / "model.safetensors").is_file()


def _head_finished(run_dir: Path, stage: HeadStage) -> bool:
    """A head run is done when it completed its steps or used its wall-clock budget, and saved its files."""
    path = run_dir / "train_summary.json"
    return (path.is_file() and read_json(path).get("stopped") in ("complete", "budget")
            and all((run_dir / f).is_file() for f in stage.files))


def _resumable(run_dir: Path, resume: bool) -> bool:
    return resume and (run_dir / "checkpoint" / "state.pt").is_file()


def measure_acceptance(target_dir: Path, drafter: str, *, device: str = "auto", num_prompts: int = 16,
                       prompt_tokens: int = 48, max_tokens: int = 64) -> dict:
    """Mean accepted length (tau, bonus included) of a drafter spec (its default options) on held-out
    prompts, greedy and T=1.

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
    llm = LLM(target_dir, drafter=drafter, device=device, max_num_seqs=num_prompts)
    out = {"num_prompts": num_prompts, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens}
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
    for name in (*MODEL_FILES, DRAFT_VOCAB_FILE):
        if name not in ("config.json", "model.safetensors") and (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def export_bundle(target_dir: Path, draft_dir: Path, distill_dir: Path, bundle_dir: Path, *, acceptance: dict,
                  seed: int, argv: list[str] | None, size_limit_mb: float, timings: dict,
                  head_dirs: dict[str, Path] | None = None) -> dict:
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
    head_dirs = head_dirs or {}
    for name, run in head_dirs.items():
        (tmp / name).mkdir()
        for file in HEAD_STAGES[name].files:
            shutil.copy2(run / file, tmp / name / file)  # heads are saved in fp16 already
    for run, name in ((target_dir, "target"), (draft_dir, "draft"), *((d, n) for n, d in head_dirs.items())):
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
        "default_drafters": {"draft": "draft", **{name: name for name in head_dirs}},
        "default_drafter": next(n for n in DEFAULT_DRAFTER_ORDER if n == "draft" or n in head_dirs),
        "corpus": {"sha256": corpus["sha256"], "totals": corpus["totals"], "roots": corpus["roots"]},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "metrics": {
            "target": _run_metrics(target_summary),
            "draft": _run_metrics(draft_summary),
            **{name: _run_metrics(read_json(run / "train_summary.json")) for name, run in head_dirs.items()},
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
    taus = "; ".join(f"{name} tau {a['tau_greedy']} greedy, {a['tau_t1']} at T=1" for name, a in acceptance.items())
    print(f"bundle: {bundle_dir} ({size_mb:.1f} MiB); {taus}", file=sys.stderr)
    return manifest


def _run_metrics(summary: dict) -> dict:
    keys = ("preset", "num_params", "step", "tokens", "train_seconds", "tokens_per_s", "first_loss", "final_loss", "world_size")
    return {k: summary.get(k) for k in keys if k in summary} | {"eval": summary.get("last_eval", {})}

