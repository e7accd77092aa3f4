"""Where the tiny model (the 9M-parameter code model the tests use) and its drafters live. Cheap to import (no torch, no transformers).

The bundle is ``specserve/bundle/`` inside the installed package (``SPECSERVE_BUNDLE_DIR`` overrides
it)::

    MANIFEST.json   command, seed, corpus manifest hash, metrics, "default_drafters": {name: subdir}
                    and "default_drafter" (what ``drafter="auto"`` picks)
    target/         the default model (HF layout, fp16 safetensors, tokenizer)
    draft/          its draft model (``draft`` drafter)

Until ``specserve train bundle`` has been run and its output committed, `default_model_dir()` is None
and `default_drafters()` is empty.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

ENV_VAR = "SPECSERVE_BUNDLE_DIR"
MANIFEST = "MANIFEST.json"
_MODEL_FILES = ("config.json", "model.safetensors")


def bundle_dir() -> Path:
    """The bundle directory (it may not exist): ``$SPECSERVE_BUNDLE_DIR`` or ``<specserve package>/bundle``."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    spec = importlib.util.find_spec("specserve")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the specserve package cannot be located")
    return Path(list(spec.submodule_search_locations)[0]) / "bundle"


def bundle_manifest() -> dict | None:
    """The bundle's MANIFEST.json, or None when there is no (readable) bundle."""
    path = bundle_dir() / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_model_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in _MODEL_FILES)


def default_model_dir() -> Path | None:
    """The embedded default model's directory, or None when the bundle is absent."""
    manifest = bundle_manifest()
    if manifest is None:
        return None
    path = bundle_dir() / manifest.get("default_model", "target")
    return path if _is_model_dir(path) else None


def default_drafters() -> dict[str, str]:
    """Drafter name → directory of the bundle's drafters for the default model (``{"draft": ...}``)."""
    manifest = bundle_manifest()
    if manifest is None or default_model_dir() is None:
        return {}
    root = bundle_dir()
    out = {}
    for name, sub in sorted(manifest.get("default_drafters", {}).items()):
        path = root / sub
        if path.is_dir() and any(path.iterdir()):
            out[name] = str(path)
    return out


def is_default_model(model_dir: str | Path | None) -> bool:
    """True when ``model_dir`` is the bundled default model (compared after resolving links)."""
    default = default_model_dir()
    if default is None or model_dir is None:
        return False
    try:
        return Path(model_dir).expanduser().resolve() == default.resolve()
    except OSError:
        return False


# Drafters that need no files: any of them (or a hybrid of them and the bundle's own) can be the default.
FILELESS_DRAFTERS = ("ngram", "suffix", "lookahead")


def default_drafter(model_dir: str | Path | None) -> str | None:
    """The drafter `LLM(drafter="auto")` uses: for the default model (SmolLM2's GGUF file) the ``default_drafter``
    its shipped drafters' manifest names (`default_model_drafters`); for the bundled tiny model the bundle's
    ``default_drafter`` (chosen by measurement: `specserve train default-drafter`) when it can run — a bundled
    drafter, a file-less one, or a hybrid of those; otherwise None (plain decoding)."""
    from specserve.loading.default_model import is_default_model_file

    if is_default_model_file(model_dir):
        from specserve.default_model_drafters import default_drafter_spec

        return default_drafter_spec()
    manifest = bundle_manifest()
    if manifest is None or not is_default_model(model_dir):
        return None
    spec = manifest.get("default_drafter")
    return spec if isinstance(spec, str) and runs_on_bundle(spec) else None


def default_drafter_options(model_dir: str | Path | None) -> dict:
    """The options `default_drafter`'s drafter is built with for ``model_dir`` (recorded beside the choice)."""
    from specserve.loading.default_model import is_default_model_file

    if is_default_model_file(model_dir):
        from specserve.default_model_drafters import default_drafter_options as shipped_options

        return shipped_options()
    manifest = bundle_manifest()
    options = (manifest or {}).get("default_drafter_options")
    if default_drafter(model_dir) is None or not isinstance(options, dict):
        return {}
    return dict(options)


def runs_on_bundle(spec: str) -> bool:
    """Whether drafter ``spec`` runs on the embedded model with no path: a bundled drafter, a file-less
    one, or ``hybrid:A+B`` of those."""
    name, _, path = spec.partition(":")
    if name == "hybrid":
        return bool(path) and all(runs_on_bundle(part.strip()) for part in path.split("+"))
    return not path and (name in FILELESS_DRAFTERS or name in default_drafters())


def resolve_drafter_path(name: str, model_dir: str | Path | None) -> str | None:
    """The shipped path for a drafter named without one (``"eagle"``, ``"draft"``) when the target is the default
    model (its drafters ship in `specserve/default_model_drafters/`) or the bundled tiny model."""
    from specserve.loading.default_model import is_default_model_file

    if is_default_model_file(model_dir):
        from specserve.default_model_drafters import shipped_drafters

        return shipped_drafters().get(name)
    if not is_default_model(model_dir):
        return None
    return default_drafters().get(name)
