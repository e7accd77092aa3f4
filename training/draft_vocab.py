"""``specserve train draft-vocab``: give a draft model a draft vocabulary (drafters/draft_vocab.py).

The draft vocabulary is the ``size`` most frequent target tokens of the training text (as EAGLE-3
picks its heads' vocabularies): the corpus's train split, tokenized with the target's tokenizer. The
model is not retrained: its LM head keeps the rows of those tokens, so its distribution over them is
its full distribution renormalised. Held-out coverage (the share of held-out tokens inside the draft
vocabulary) is reported: it bounds how often the target's next token can be drafted at all.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def most_frequent(counts: np.ndarray | torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids of `counts` [V] (ties: the lower id), ascending: int64[size]."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    vocab = counts.numel()
    if size >= vocab:
        return torch.arange(vocab)
    ranked = counts - torch.arange(vocab, dtype=torch.float64) * 1e-9  # ties toward the lower id
    return ranked.topk(size).indices.sort().values


def token_counts(texts: list[str], tokenizer_dir: Path, vocab: int) -> np.ndarray:
    """How often each token id occurs in `texts` under the tokenizer of `tokenizer_dir`: int64[vocab]."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    counts = np.zeros(vocab, dtype=np.int64)
    for enc in tokenizer.encode_batch(texts):
        counts += np.bincount(np.asarray(enc.ids, dtype=np.int64), minlength=vocab)[:vocab]
    return counts


def _corpus(target_dir: Path, corpus_manifest: str | None, corpus_paths: list[str] | None, heldout_fraction: float):
    """The corpus the draft vocabulary is counted on: an explicit manifest, else the target's own (when it
    was trained here), else `corpus_paths` (default: the standard library)."""
    from specserve.training.corpus import build_corpus, corpus_from_manifest
    from specserve.training.outputs import read_json

    if corpus_manifest is not None:
        return corpus_from_manifest(read_json(Path(corpus_manifest)))
    if corpus_paths is None and (target_dir / "corpus_manifest.json").is_file():
        return corpus_from_manifest(read_json(target_dir / "corpus_manifest.json"))
    return build_corpus(corpus_paths, heldout_fraction=heldout_fraction)


def write_draft_vocab(draft_dir: str | Path, size: int, *, corpus_manifest: str | None = None,
                      corpus: list[str] | None = None, heldout_fraction: float = 0.05) -> dict:
    """Pick `draft_dir`'s draft vocabulary and write it beside the model; returns what was done."""
    from specserve.config import load_config
    from specserve.drafters.draft_vocab import FILE_NAME, load_draft_vocab, save_draft_vocab
    from specserve.training.outputs import read_json

    draft_dir = Path(draft_dir).expanduser()
    vocab = load_config(draft_dir).vocab_size
    if isinstance(size, bool) or not 1 <= size <= vocab:
        raise ValueError(f"--size must be in [1, {vocab}] (the draft model's vocabulary), got {size!r}")
    target = read_json(draft_dir / "draft_config.json").get("target") if (draft_dir / "draft_config.json").is_file() else None
    target_dir = (draft_dir / target).resolve() if target else draft_dir
    chosen = _corpus(target_dir, corpus_manifest, corpus, heldout_fraction)
    counts = token_counts(chosen.texts("train"), draft_dir, vocab)
    ids = most_frequent(counts, size)
    save_draft_vocab(draft_dir, ids)
    load_draft_vocab(draft_dir, vocab)  # what the drafter will read back
    heldout = chosen.texts("heldout")
    summary = {"out": str(draft_dir / FILE_NAME), "size": size, "vocab": vocab,
               "train_coverage": float(counts[ids.numpy()].sum() / max(counts.sum(), 1))}
    if heldout:
        held = token_counts(heldout, draft_dir, vocab)
        summary["heldout_coverage"] = float(held[ids.numpy()].sum() / max(held.sum(), 1))
    return summary
