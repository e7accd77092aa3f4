"""Where specserve keeps what it fetches or derives once per user: the default model's file, and per GGUF file
its tensor index and converted tokenizer. Cheap to import.

``$SPECSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/specserve``, else ``~/.cache/specserve``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "SPECSERVE_CACHE_DIR"


def cache_dir() -> Path:
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "specserve"
