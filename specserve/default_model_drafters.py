"""The drafters trained for the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF file), shipped in the package.
Cheap to import (no torch).

``specserve/default_model_drafters/``::

    MANIFEST.json   "target": the GGUF file they were trained for (name, sha256); "drafters": {name: subdir};
                    "default_drafter": what ``drafter="auto"`` runs on the default model, with its
                    "default_drafter_options" (chosen by measurement: `specserve train default-drafter`, its table
                    in "default_drafter_eval"); "training": how each was made (command, data, time)
    eagle/          an EAGLE-3 head (`specserve train feature-data` + `specserve train eagle`), when one ships
    medusa/         Medusa heads (`specserve train feature-data` + `specserve train medusa --data`)

A bare drafter name (``--drafter eagle``) resolves here when the target is the default model's file. The heads
record the file's sha256 themselves, so one named by path beside another target is refused on load; a
manifest made for another file than the one `specserve pull` fetches is ignored whole.
"""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "MANIFEST.json"
#: What ``drafter="auto"`` gives the default model when no shipped drafter can run: n-gram prompt lookup under
#: adaptive speculation, which drafts where the answer copies the prompt and otherwise decodes plainly.
FALLBACK_DRAFTER = "ngram"


def drafters_dir() -> Path:
    return Path(__file__).resolve().parent / "default_model_drafters"


def manifest() -> dict | None:
    """The shipped drafters' manifest when it was made for the default model's file, else None."""
    from specserve.loading.default_model import SHA256

    try:
        record = json.loads((drafters_dir() / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("target", {}).get("sha256") != SHA256:
        return None
    return record


def empty_manifest() -> dict:
    """The manifest of no shipped drafter, for the default model's file (what `train default-drafter` starts from)."""
    from specserve.loading.default_model import FILE_NAME, PACKAGE, SHA256, VERSION

    return {"format": 1, "target": {"file": FILE_NAME, "sha256": SHA256, "package": f"{PACKAGE}=={VERSION}"},
            "drafters": {}}


def shipped_drafters() -> dict[str, str]:
    """Drafter name → directory of each shipped drafter for the default model (``{"eagle": ...}``)."""
    record = manifest() or {}
    out = {}
    for name, sub in sorted(record.get("drafters", {}).items()):
        path = drafters_dir() / sub
        if path.is_dir() and any(path.iterdir()):
            out[name] = str(path)
    return out


def runs_without_path(spec: str) -> bool:
    """Whether drafter ``spec`` runs on the default model with no path: a shipped drafter, a file-less one, or
    ``hybrid:A+B`` of those (the default model's counterpart of `bundle_paths.runs_on_bundle`)."""
    from specserve.bundle_paths import FILELESS_DRAFTERS

    name, _, path = spec.partition(":")
    if name == "hybrid":
        return bool(path) and all(runs_without_path(part.strip()) for part in path.split("+"))
    return not path and (name in FILELESS_DRAFTERS or name in shipped_drafters())


def default_drafter_spec() -> str:
    """What ``drafter="auto"`` runs on the default model: the manifest's choice when every drafter it names ships
    (or needs no files), else `FALLBACK_DRAFTER`."""
    spec = (manifest() or {}).get("default_drafter")
    return spec if isinstance(spec, str) and runs_without_path(spec) else FALLBACK_DRAFTER


def default_drafter_options() -> dict:
    """The options ``drafter="auto"`` builds `default_drafter_spec`'s drafter with (``{"shared_tokens": 0}`` for a
    per-request suffix drafter); none when the manifest's choice cannot run."""
    record = manifest() or {}
    options = record.get("default_drafter_options")
    if default_drafter_spec() != record.get("default_drafter") or not isinstance(options, dict):
        return {}
    return dict(options)
