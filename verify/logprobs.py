"""Log-probabilities of emitted (and prompt) tokens, taken from the verify rows the step already computed.

Values are the target model's own: log_softmax of a row's logits *before* any rule or processor edits
them (penalties, grammar masks) and before temperature and top-k/top-p/min-p — vLLM's default "raw"
mode. Under speculation a step emits the tokens of an accepted root→node path plus a bonus token; the
k-th emitted token was predicted at verify row 0 (k = 0) or at the row of the (k-1)-th accepted node,
so copying a request's raw rows before the rules run and reading the accepted path's rows after
acceptance gives exactly what plain decoding would report, however many tokens a step accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the `k` most likely tokens' (id,
    log-probability), most likely first (empty when k = 0)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """rows float32[M, V] raw logits, tokens int[M] (token m follows row m); one entry per token."""
    logp = torch.log_softmax(rows.float(), dim=-1)  # [M, V]
    index = torch.tensor(tokens, dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, index[:, None])[:, 0].tolist()
    if k <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids, values)]


def path_rows(accepted_nodes: tuple[int, ...]) -> list[int]:
    """The verify rows that predicted a step's emitted tokens: the root's, then each accepted node's."""
    return [0, *(node + 1 for node in accepted_nodes)]
