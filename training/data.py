"""Token streams and deterministic batches.

A split's documents are encoded and joined into one stream with an end-of-text token after each
document. The stream is cut into windows of ``seq_len + 1`` tokens (input and shifted target; windows
overlap by one token). Batch ``step`` is a fixed slice of a seeded permutation of the windows (a new
permutation each epoch), so the data order is a pure function of (seed, step): resuming needs only the
step count, and data-parallel ranks take disjoint strided shares of the same global batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def encode_stream(texts: list[str], tokenizer, eos_id: int) -> np.ndarray:
    """Encode documents (batched, in the tokenizer's native threads) into one int32 stream [N]."""
    if not texts:
        return np.zeros(0, dtype=np.int32)
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer")
    pieces: list[np.ndarray] = []
    for start in range(0, len(texts), 256):
        for enc in backend.encode_batch(texts[start : start + 256], add_special_tokens=False):
            pieces.append(np.asarray(enc.ids, dtype=np.int32))
            pieces.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(pieces)


def save_stream(path: Path, tokens: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, tokens)
    tmp.replace(path)


def load_stream(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode=None).astype(np.int64, copy=False)


class IndexSampler:
    """Global batch ``step`` = items ``[step * B, (step + 1) * B)`` of an endless sequence of seeded
    per-epoch permutations of ``range(num_items)``: a pure function of (seed, step)."""

    def __init__(self, num_items: int, batch_size: int, seed: int) -> None:
        if num_items < 1:
            raise ValueError("nothing to sample from: the data set is empty")
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
        return self._perms[epoch]

    def ids(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Item indices int64[B / world]: this rank's strided share of global batch ``step``."""
        pos = np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.num_items)
        ids = np.array([self._perm(int(e))[int(o)] for e, o in zip(epochs, offsets)], dtype=np.int64)
        return torch.from_numpy(ids[rank::world])


class WindowSampler:
    """Deterministic batches of windows from a token stream.

    tokens: int[N] stream; window i is the ``seq_len + 1`` tokens starting at ``i * seq_len``.
    ``batch(step, rank, world)`` returns int64[batch_size / world, seq_len + 1].
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        self.seq_len = seq_len
        num_windows = (len(tokens) - 1) // seq_len
        if num_windows < 1:
            raise ValueError(
                f"the training split has {len(tokens)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}: "
                "give a bigger corpus or a smaller --seq-len"
            )
        self.index = IndexSampler(num_windows, batch_size, seed)

    @property
    def num_windows(self) -> int:
        return self.index.num_items

    def batch(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        starts = self.index.ids(step, rank, world) * self.seq_len
        return self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)[None, :]]  # [B/world, seq_len+1]


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """The first ``max_windows`` consecutive windows of a held-out stream: int64[W, L+1].

    When the stream is shorter than one window the window shrinks to the whole stream (tiny corpora).
    """
    t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    if t.numel() < 2:
        raise ValueError("the held-out split encodes to fewer than 2 tokens")
    length = min(seq_len, t.numel() - 1)
    count = max(1, min(max_windows, (t.numel() - 1) // length))
    starts = torch.arange(count) * length
    return t[starts[:, None] + torch.arange(length + 1)[None, :]]
