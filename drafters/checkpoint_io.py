"""Reading drafter checkpoint files with errors that name the file (Medusa heads, EAGLE heads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_json(path: str | Path, what: str = "") -> dict:
    """The JSON object in ``path``; ValueError (``what`` names the file's role) when it is missing,
    unreadable or not an object."""
    label = f"{what} {str(path)!r}" if what else repr(str(path))
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ValueError(f"{label} is missing") from exc
    except (OSError, ValueError) as exc:  # ValueError covers JSON and UTF-8 decoding errors
        raise ValueError(f"{label} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{label} must hold a JSON object")
    return data


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; ValueError when it is corrupt or truncated."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"{str(path)!r} is not a readable safetensors file (corrupt or truncated?): {exc}") from exc
