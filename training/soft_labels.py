"""The target's stored top-k as soft labels over a draft vocabulary: what Medusa heads and cut draft models trained
on captured feature data share (training/medusa.py, training/draft_features.py).

A drafter whose LM head covers a draft vocabulary scores columns, not target ids: `draft_columns` maps target id ->
column (-1 outside), `to_columns` turns stored top-k ids into columns and drops the labels outside the vocabulary
(log-probability -inf) so the rest renormalise, and `topk_kl` is KL(p || q) with p that renormalised top-k.
"""

from __future__ import annotations

import torch


def draft_columns(draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64[vocab]: column j for target id draft_ids[j], -1 for a token outside the draft vocabulary."""
    columns = torch.full((vocab,), -1, dtype=torch.int64)
    columns[draft_ids] = torch.arange(len(draft_ids))
    return columns


def to_columns(columns: torch.Tensor, topk_ids: torch.Tensor,
               topk_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probabilities) [..., k] of stored top-k labels as draft columns: ids outside the vocabulary become
    -1 with log-probability -inf."""
    ids = columns[topk_ids]
    return ids, torch.where(ids >= 0, topk_logprobs, float("-inf"))


def topk_kl(logq: torch.Tensor, label_ids: torch.Tensor, raw_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p || q) [...] with p the labels' top-k renormalised over those that are labels (id >= 0 and a finite
    log-probability): logq [..., V'] the drafter's log-probabilities over its columns, label_ids / raw_logprobs
    [..., k]. A row with no label gets 0, and every term stays finite, so no NaN reaches the gradient through it."""
    valid = (label_ids >= 0) & torch.isfinite(raw_logprobs)
    raw = torch.where(valid, raw_logprobs, torch.where(valid.any(-1, keepdim=True), float("-inf"), 0.0))
    logp = torch.log_softmax(raw, dim=-1)  # the target's top-k, renormalised
    p = torch.where(valid, logp.exp(), 0.0)
    return (p * (torch.where(valid, logp, 0.0) - logq.gather(-1, label_ids.clamp_min(0)))).sum(-1)
