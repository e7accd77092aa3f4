"""``specserve train ship``: put drafters trained for the default model into the package.

Copies each trained drafter's serving files into ``specserve/default_model_drafters/<name>/`` and writes
``MANIFEST.json`` there (see `specserve.default_model_drafters`): the GGUF file they were trained for (name,
sha256 — every head must record the same), the drafters, ``default_drafter`` (what ``drafter="auto"`` runs on
the default model; pick it by measurement: BENCHMARKS.md) and, per drafter, how it was made (its command line,
its data's size and throughput, its training time and held-out metrics). Refused with one line: a drafter made
for another file, a missing run, or a total above ``--size-limit-mb`` (the repository carries these files).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Each drafter's serving files; the first records the target ("target": {"file_sha256": ...}).
SERVING_FILES = {"eagle": ("eagle_config.json", "eagle_head.safetensors"),
                 "medusa": ("medusa_config.json", "medusa_heads.safetensors"),
                 "draft": ("draft_config.json", "config.json", "model.safetensors", "draft_vocab.safetensors")}
SIZE_LIMIT_MB = 25.0


def ship(runs: dict[str, str | Path], default_drafter: str, *, out: str | Path | None = None,
         size_limit_mb: float = SIZE_LIMIT_MB) -> dict:
    """Ship ``runs`` ({drafter name: run directory}); return the manifest written."""
    from specserve.default_model_drafters import MANIFEST, drafters_dir, empty_manifest
    from specserve.loading.default_model import FILE_NAME, SHA256

    out_dir = Path(out) if out is not None else drafters_dir()
    if not runs:
        raise ValueError("nothing to ship: name at least one trained drafter (--eagle DIR, --medusa DIR, --draft DIR)")
    records, total = {}, 0
    for name, run in runs.items():
        run = Path(run).expanduser()
        files = SERVING_FILES.get(name)
        if files is None:
            raise ValueError(f"cannot ship a {name!r} drafter yet (known: {', '.join(SERVING_FILES)})")
        missing = [f for f in files if not (run / f).is_file()]
        if missing:
            raise ValueError(f"{str(run)!r} is not a finished {name} run: {', '.join(missing)} missing")
        config = json.loads((run / files[0]).read_text())
        trained_for = config.get("target", {}).get("file_sha256")
        if trained_for != SHA256:
            raise ValueError(f"{str(run)!r} was trained for another target (file sha256 {trained_for}), not the "
                             f"default model's {FILE_NAME} ({SHA256})")
        total += sum((run / f).stat().st_size for f in files)
        records[name] = _provenance(run)
    if total > size_limit_mb * 1e6:
        raise ValueError(f"the drafters take {total / 1e6:.1f} MB, over the {size_limit_mb:g} MB limit: save heads "
                         "as float16 or with a smaller draft vocabulary")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, run in runs.items():
        dest = out_dir / name
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir()
        for f in SERVING_FILES[name]:
            shutil.copy2(Path(run).expanduser() / f, dest / f)
    manifest = empty_manifest() | {
        "drafters": {name: name for name in runs},
        "default_drafter": default_drafter,
        "bytes": total,
        "training": records,
    }
    try:  # the measurement behind an unchanged default drafter stays with it (`train default-drafter` made it)
        previous = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        previous = {}
    if isinstance(previous, dict) and previous.get("default_drafter") == default_drafter \
            and previous.get("target", {}).get("sha256") == SHA256:
        manifest |= {k: previous[k] for k in ("default_drafter_options", "default_drafter_eval") if k in previous}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _provenance(run: Path) -> dict:
    """How a run was made: its command line, its data (counts, throughput) and its training (time, metrics)."""
    def read(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    config, summary = read(run / "run_config.json"), read(run / "train_summary.json")
    out = {"argv": config.get("argv"), "steps": summary.get("step"), "tokens": summary.get("tokens"),
           "wall_seconds": summary.get("wall_seconds_this_session"), "last_eval": summary.get("last_eval"),
           "draft_vocab_size": summary.get("draft_vocab_size"), "feature_layers": summary.get("feature_layers")}
    data = config.get("data")
    if data:
        from specserve.training.feature_data import MANIFEST as DATA_MANIFEST

        manifest = read(Path(data) / DATA_MANIFEST)
        if manifest:
            out["data"] = {"counts": manifest.get("counts"), "stats": manifest.get("stats"),
                           "settings": manifest.get("settings"), "prompt_source": manifest.get("prompt_source")}
    return out


def add_ship_args(p) -> None:
    p.add_argument("--eagle", default=None, metavar="DIR", help="a finished `train eagle` run for the default model")
    p.add_argument("--medusa", default=None, metavar="DIR",
                   help="a finished `train medusa --data FEATURES` run for the default model")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="a finished `train draft --data FEATURES` run for the default model")
    p.add_argument("--default-drafter", required=True,
                   help="what drafter='auto' runs on the default model (a shipped name, a file-less drafter, or a "
                        "hybrid of those), chosen by measurement")
    p.add_argument("--out", default=None, help="where to write (default: the package's specserve/default_model_drafters)")
    p.add_argument("--size-limit-mb", type=float, default=SIZE_LIMIT_MB)


def cmd_ship(args) -> int:
    runs = {name: path for name, path in (("eagle", args.eagle), ("medusa", args.medusa), ("draft", args.draft)) if path}
    manifest = ship(runs, args.default_drafter, out=args.out, size_limit_mb=args.size_limit_mb)
    print(json.dumps({k: manifest[k] for k in ("drafters", "default_drafter", "bytes")}))
    return 0
