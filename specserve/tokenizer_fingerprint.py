"""A tokenizer's identity: which target a trained drafter's vocabulary belongs to. Cheap to import.

Drafter checkpoints (draft models, Medusa and EAGLE heads) record the fingerprint of their target's
tokenizer when trained (`specserve.training`), and the drafters compare it when loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """sha256 of the tokenizer's vocabulary, merges and added tokens (formatting-independent)."""
    data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    key = {"model": data.get("model"), "added_tokens": data.get("added_tokens")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
