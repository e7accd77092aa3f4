"""An independent reference for the processed target distribution, written from the definitions.

The sampling-losslessness (chi-square) suites compare emitted tokens with the distribution a request
*should* follow. That reference must not come from `specserve.sampling.logits_to_probs`, the code under
test: a bug in its filters would then be in both sides and every suite would pass. So this module
reimplements the transform in float64 with plain numpy and per-token loops, and imports nothing from
specserve. tests/verify/test_sampling_oracle.py checks it against transformers' logits warpers and
checks `logits_to_probs` against it.

The semantics are the ones specserve documents (SamplingParams and `logits_to_probs` in
specserve/sampling.py), applied in this order, each filter on the distribution the previous one left
(renormalised), then a final renormalisation:

0. mask (grammar): a forbidden token gets probability 0 before anything else (its logit is -inf, as the
   engine masks logits before sampling), so it never counts towards top-k's k, top-p's mass or min-p's peak.
1. temperature T: T > 0 gives softmax(logits / T); T = 0 (greedy) puts all the mass on the argmax (the
   lowest token id among exact ties, as torch.argmax picks).
2. top-k (k > 0; 0 or -1 = off): keep the k tokens with the largest logits — exactly k, "the k most
   likely tokens" as SamplingParams documents and as `logits_to_probs` implements it (rank < k in a sort).
   Exact ties at the k-th value: specserve's docstring does not say and its sort breaks them arbitrarily;
   this oracle breaks them by the lower token id so the reference is well defined. transformers'
   TopKLogitsWarper and vLLM instead keep *every* token tied with the k-th largest (possibly more than
   k). The two conventions differ only on exact ties, which continuous model logits do not produce;
   tests/verify/test_sampling_oracle.py pins the difference down.
3. top-p (p < 1): over the distribution left by top-k, the smallest set of most likely tokens whose
   cumulative probability reaches p (>= p): walking tokens from the most likely, a token is kept while
   the mass strictly before it is < p. The most likely token is always kept.
4. min-p (m > 0): drop tokens whose probability is < m × the most likely remaining token's probability
   (a ratio, so it does not matter whether the survivors of top-p were renormalised first).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def target_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 allowed=None) -> np.ndarray:
    """The processed target distribution of ONE row of logits [V] (any float dtype, numpy or torch);
    `allowed` is an optional bool [V] mask (False = forbidden by a grammar). float64 numpy [V], sums to 1."""
    logits = _as_float64(logits)
    vocab = logits.shape[0]
    if allowed is not None:
        allowed = np.asarray(allowed.cpu() if isinstance(allowed, torch.Tensor) else allowed, dtype=bool)
        assert allowed.shape == (vocab,) and allowed.any(), "the mask must allow at least one token"
        logits = np.where(allowed, logits, -math.inf)
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")

    # Token ids from the most to the least likely (descending logit; exact ties: the lower id first).
    # Dividing by T > 0 does not change this order, so one order serves top-k, top-p and greedy.
    order = sorted(range(vocab), key=lambda i: (-logits[i], i))

    # 1. temperature
    probs = np.zeros(vocab, dtype=np.float64)
    if temperature == 0:
        probs[order[0]] = 1.0
    else:
        top = logits[order[0]]
        for i in range(vocab):
            if logits[i] != -math.inf:
                # exp((l - max) / T) is softmax(l / T) up to the normalisation, without overflow.
                probs[i] = math.exp((logits[i] - top) / temperature)
        probs /= probs.sum()

    # 2. top-k: exactly the k first tokens of `order` survive.
    if 0 < top_k < vocab:
        for i in order[top_k:]:
            probs[i] = 0.0
        probs /= probs.sum()

    # 3. top-p: keep a token while the mass of the tokens kept before it is below p.
    if top_p < 1:
        mass_before = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and mass_before >= top_p:
                probs[i] = 0.0
            else:
                mass_before += probs[i]
        probs /= probs.sum()

    # 4. min-p: relative to the most likely surviving token.
    if min_p > 0:
        threshold = min_p * probs.max()
        for i in range(vocab):
            if probs[i] < threshold:
                probs[i] = 0.0
        probs /= probs.sum()
    return probs


def target_probs_rows(logits, params, allowed=None) -> torch.Tensor:
    """`target_probs` for every row of logits [M, V] under one request's `params` (anything with
    temperature, top_k, top_p and min_p: a SamplingParams). `allowed`: None, bool [V] or bool [M, V].
    float64 torch [M, V]."""
    logits = torch.as_tensor(logits).detach().cpu()
    rows = []
    for m in range(logits.shape[0]):
        mask = None if allowed is None else (allowed if np.ndim(allowed) == 1 else allowed[m])
        rows.append(target_probs(logits[m], params.temperature, params.top_k, params.top_p, params.min_p, mask))
    return torch.from_numpy(np.stack(rows))


def _as_float64(logits) -> np.ndarray:
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().cpu().double().numpy()
    out = np.array(logits, dtype=np.float64)
    assert out.ndim == 1, f"one row of logits expected, got shape {out.shape}"
    assert not np.isnan(out).any() and (out < math.inf).all(), "logits must be finite or -inf"
    return out
