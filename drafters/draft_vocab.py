"""A draft model's draft vocabulary: the target tokens its LM head scores (`draft_vocab.safetensors`).

Most of a small draft model's per-level cost is its LM head over the whole vocabulary (the bundle's
draft: 1.57 M of its 2.36 M parameters). Like EAGLE-3 heads, a draft model may score only the most
frequent target tokens: its directory then holds ``draft_vocab.safetensors`` with ``draft_to_target``
int64[Vd] (ascending, distinct target ids), and the drafter keeps only those rows of the LM head
(`LlamaModel.restrict_lm_head`). The model's own files stay a plain Hugging Face checkpoint; without
the file it drafts over the full vocabulary. A token outside the draft vocabulary is never drafted;
verification is unchanged, so output stays lossless.
"""

from __future__ import annotations

from pathlib import Path

import torch

FILE_NAME = "draft_vocab.safetensors"


def save_draft_vocab(model_dir: str | Path, draft_to_target: torch.Tensor) -> Path:
    from safetensors.torch import save_file

    path = Path(model_dir) / FILE_NAME
    save_file({"draft_to_target": draft_to_target.to(torch.int64).contiguous().cpu()}, str(path))
    return path


def load_draft_vocab(model_dir: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary int64[Vd] of a draft model directory, or None when it drafts over all tokens.
    Raises ValueError (naming the file) for a map a target of `vocab_size` tokens cannot use."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return None
    try:
        ids = load_file(str(path))["draft_to_target"]
    except (SafetensorError, KeyError, OSError) as exc:
        raise ValueError(f"{path}: not a draft vocabulary ({exc})") from None
    if ids.ndim != 1 or ids.dtype != torch.int64 or not len(ids):
        raise ValueError(f"{path}: draft_to_target must be a non-empty int64 vector, got {ids.dtype} {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"{path}: draft_to_target must hold distinct token ids in [0, {vocab_size})")
    return ids
