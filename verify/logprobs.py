"""Log-probabilities of emitted (and prompt) tokens, taken from the verify rows the step already computed.

Values are the target model's own: log_softmax of a row's logits *before* any rule or processor edits
them (penalties, grammar masks) and before temperature and top-k/top-p/min-p — vLLM's default "raw"
mode. Under speculation a step emits the tokens of an accepted root→node path plus a bonus token; the
k-th emitted token was predicted at verify row 0 (k = 0) or at the row of the (k-1)-th accepted node,
so copying a request's raw rows before the rules run and reading the accepted path's rows after
acceptance gives exactly what plain decoding would report, however many tokens a step accepts.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import torch

from specserve.verify.softmax_kernels import sum_exp


class TokenLogprob(NamedTuple):
    """One position: the token there, its log-probability, and the `k` most likely tokens' (id,
    log-probability), most likely first (empty when k = 0). A NamedTuple: one is made per emitted token
    on the engine thread, at a third of a frozen dataclass's cost."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int, index: list[int] | None = None) -> list[TokenLogprob]:
    """rows float32[R, V] raw logits, tokens int[M] (token m follows row index[m]; index None: row m);
    one entry per token."""
    k = min(max(k, 0), rows.shape[-1])
    if index is None:
        index = list(range(len(tokens)))
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.is_contiguous():
        # One compiled call reading the rows in place, instead of a gather, log_softmax, a second gather and
        # a top-k: right after a ~1 ms CPU decode step each torch op took 6-30 us (measured in the engine),
        # together more than 5 % of the step.
        chosen, top_ids, top_values = _logprobs_cpu(rows.detach().numpy(), np.asarray(index, dtype=np.int64),
                                                    np.asarray(tokens, dtype=np.int64), k)
        chosen = chosen.tolist()
        top_ids = top_ids[:, :k]
    else:
        logp = torch.log_softmax(rows.index_select(0, torch.tensor(index, device=rows.device)).float(), dim=-1)
        chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.int64, device=logp.device)[:, None])[:, 0].tolist()
        if k:
            top_values, top_ids = logp.topk(k, dim=-1)
    if k <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids, values)]


@numba.njit(cache=True, nogil=True)
def _logprobs_cpu(x, rows, tokens, k):  # pragma: no cover - compiled
    """x float32[R, V], rows int64[M] (the rows to read), tokens int64[M]: per row, log p(tokens[m]) and
    the k largest log-probabilities (ids, values), most likely first (ties: the lower id first)."""
    m_rows, v = len(rows), x.shape[1]
    chosen = np.empty(m_rows, np.float64)
    top_ids = np.empty((m_rows, max(k, 1)), np.int64)
    top_values = np.empty((m_rows, k), np.float64)
    best = np.empty(max(k, 1), np.float32)  # the values of top_ids[m], in order
    p = np.empty(v, np.float32)
    bits = np.empty(v, np.int32)
    for m in range(m_rows):
        row = x[rows[m]]
        hi = row.max()
        lse = np.float64(hi) + np.log(np.float64(sum_exp(row, hi, np.float32(1.0), p, bits)))
        chosen[m] = np.float64(row[tokens[m]]) - lse
        if k == 0:
            continue
        n = 0  # an insertion list (k <= 20): most values fail the threshold test
        thresh = -np.inf  # the k-th best so far once there are k
        for j in range(v):
            val = row[j]
            if n == k and val <= thresh:
                continue
            if n < k:
                pos = n
                n += 1
            else:
                pos = k - 1
            while pos > 0 and best[pos - 1] < val:
                best[pos] = best[pos - 1]
                top_ids[m, pos] = top_ids[m, pos - 1]
                pos -= 1
            best[pos] = val
            top_ids[m, pos] = j
            if n == k:
                thresh = best[k - 1]
        for i in range(k):
            top_values[m, i] = np.float64(best[i]) - lse
    return chosen, top_ids, top_values


def split_logprobs(entries: list[TokenLogprob], counts: list[int], ks: list[int]) -> list[tuple[TokenLogprob, ...]]:
    """Entries of several requests computed in one call (with the largest k), cut back per request:
    `counts[b]` consecutive entries each, their top lists to `ks[b]`."""
    out, start, k_max = [], 0, max(ks, default=0)
    for count, k in zip(counts, ks):
        part = entries[start:start + count]
        start += count
        out.append(tuple(part) if k == k_max else tuple(TokenLogprob(e.token, e.logprob, e.top[:k]) for e in part))
    return out


def path_rows(accepted_nodes: tuple[int, ...]) -> list[int]:
    """The verify rows that predicted a step's emitted tokens: the root's, then each accepted node's."""
    return [0, *(node + 1 for node in accepted_nodes)]
