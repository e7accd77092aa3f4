"""The Verifier: from the step's verify-row logits to what each request accepted (ARCHITECTURE.md).

In order: each request's rules edit its own rows (`RequestRule.process_logits`: grammar masks), the
batch-level logits processors edit every row, then every row's argmax, the sampled requests' processed
distributions (temperature, top-k, top-p, min-p) and their uniforms, and greedy / lossless stochastic
acceptance of the packed trees (`accept_trees`: one compiled call on the CPU). Masks come before
everything, so the argmax, the sampled distribution and the residuals all see them.

Log-probabilities (verify/logprobs.py) are read before any of it: the raw rows of requests that ask for
them are copied first, and the rows of each accepted path + bonus are turned into log-probabilities once
acceptance is known; prompt rows a prefill chunk returned (`StepForward.prompt_rows`) likewise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.sampling import logits_to_probs
from specserve.step_hooks import StepHooks, VerifyRows
from specserve.verify.accept import accept_trees, draw_uniforms, sample_plain
from specserve.verify.logprobs import path_rows, split_logprobs, token_logprobs
from specserve.verify.packed import pack_trees
from specserve.verify.result import VerifyResult

if TYPE_CHECKING:
    from specserve.runner import StepForward


class Verifier:
    def __init__(self, hooks: StepHooks) -> None:
        self.hooks = hooks

    def accept(self, out: StepForward) -> tuple[list[VerifyResult], torch.Tensor]:
        """One VerifyResult per verifying request (`out.verifying` order), and every verify row's argmax
        int64[R] after rules and processors (drafters with `wants_row_argmax` are handed it at commit).
        Edits `out.logits` in place."""
        reqs, trees, logits = out.verifying, out.trees, out.logits  # logits: float32[R, vocab]
        for req, start, rows in out.prompt_rows:
            req.prompt_logprobs.extend(token_logprobs(rows, req.token_ids[start:start + len(rows)].tolist(),
                                                      req.params.prompt_logprobs))
        ruled = [b for b, r in enumerate(reqs) if r.rules]
        wanting = [b for b, r in enumerate(reqs) if r.params.logprobs is not None]
        if not self.hooks.logits_processors and not ruled and all(not t.num_nodes for t in trees) and (
                logits.device.type == "cpu" or all(r.params.greedy for r in reqs)):
            # Plain decoding (the common case, kept lean: right after a forward has streamed the weights through
            # the caches, every Python step is slow): row b is request b's, and its token is the row's argmax, or
            # for a sampled request a draw from the row's processed distribution — what acceptance gives an
            # empty tree, without packing trees (a sampled step spent ~1.5 ms there, a tenth of a step).
            argmax = row_argmax(logits)
            tokens = argmax.tolist()
            sampled = [b for b, r in enumerate(reqs) if not r.params.greedy]
            if sampled:
                probs = processed_probs(logits, np.asarray(sampled), [reqs[b].params for b in sampled], [1] * len(sampled))
                for b, token in zip(sampled, sample_plain(probs, [reqs[b].generator for b in sampled])):
                    tokens[b] = token
            results = [VerifyResult((), (), token, 0) for token in tokens]
            if wanting:  # one row each, unedited
                _add_logprobs(results, reqs, wanting, logits, [[b] for b in wanting])
            return results, argmax
        greedy = np.fromiter((r.params.greedy for r in reqs), dtype=np.bool_, count=len(reqs))
        packed = pack_trees(trees, logits.device, with_q=not greedy.all())  # only sampled requests read q
        cu = packed.cu_rows  # int64[B+1]
        # The raw rows of requests that report log-probabilities, copied before any rule or processor edits
        # them (nothing else writes to `logits`: without rules and processors they are read in place).
        edited = set(range(len(reqs))) if self.hooks.logits_processors else set(ruled)
        raw = {b: logits[int(cu[b]):int(cu[b + 1])].clone() for b in wanting if b in edited}  # b -> float32[N+1, V]
        for b in ruled:
            for rule in reqs[b].rules:
                rule.process_logits(logits[int(cu[b]):int(cu[b + 1])], trees[b])
        if self.hooks.logits_processors:
            rows = VerifyRows(reqs, trees, cu)
            for processor in self.hooks.logits_processors:
                processor(logits, rows)
        argmax = row_argmax(logits)  # [R]
        probs, prob_index, uniforms = None, np.full(packed.num_rows, -1, dtype=np.int64), np.zeros(0)
        if not greedy.all():
            sampled = np.flatnonzero(~greedy)
            rows = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in sampled])
            prob_index[rows] = np.arange(len(rows))
            probs = processed_probs(logits, rows, [reqs[b].params for b in sampled], np.diff(cu)[sampled])
            uniforms = draw_uniforms(packed, greedy, [r.generator for r in reqs])
        results = accept_trees(trees, packed, greedy, argmax, probs, prob_index, uniforms)
        if wanting:
            if raw:  # rows some rule or processor edited: read from their copies
                base = int(cu[-1])
                source = torch.cat([logits, *raw.values()])
                offsets = dict(zip(raw, np.cumsum([base] + [len(r) for r in raw.values()])[:-1].tolist()))
            else:
                source, offsets = logits, {}
            rows = [[offsets.get(b, int(cu[b])) + r for r in path_rows(results[b].accepted_nodes)] for b in wanting]
            _add_logprobs(results, reqs, wanting, source, rows)
        return results, argmax


def _add_logprobs(results: list[VerifyResult], reqs, wanting: list[int], source: torch.Tensor,
                  rows: list[list[int]]) -> None:
    """results[b].logprobs for each b in `wanting`: its emitted tokens' log-probabilities from
    `source[rows[i]]` (the rows that predicted them), every request of the step in one call."""
    flat = [r for per in rows for r in per]
    tokens = [t for b in wanting for t in results[b].emitted_tokens]
    ks = [reqs[b].params.logprobs for b in wanting]
    entries = token_logprobs(source, tokens, max(ks), index=flat)
    for b, part in zip(wanting, split_logprobs(entries, [len(per) for per in rows], ks)):
        res = results[b]  # (not dataclasses.replace: its field walk costs as much as the rest here)
        results[b] = VerifyResult(res.accepted_nodes, res.accepted_tokens, res.bonus_token, res.num_drafted, part)


def processed_probs(logits: torch.Tensor, rows: np.ndarray, params: list, counts) -> torch.Tensor:
    """float32[len(rows), vocab]: the processed distributions (temperature, top-k, top-p, min-p) of logits' rows
    `rows`, the first counts[0] of them with params[0]'s sampling parameters, the next counts[1] with params[1]'s,
    ... Each row's values depend on its own logits and parameters only (`logits_to_probs`), so a request's
    distribution is the same in a plain step and in a step where others verify trees."""
    def per_row(values, dtype=torch.float32) -> torch.Tensor:
        return torch.from_numpy(np.repeat(np.asarray(values), counts)).to(logits.device, dtype)

    every_row = len(rows) == logits.shape[0] and bool((rows == np.arange(len(rows))).all())
    return logits_to_probs(
        logits if every_row else logits[torch.from_numpy(rows).to(logits.device)],  # (a gather copies every row)
        per_row([p.temperature for p in params]),
        per_row([min(p.top_k, logits.shape[-1]) for p in params], torch.int64),
        per_row([p.top_p for p in params]),
        per_row([p.min_p for p in params]),
    )


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64[R] argmax per row (on the CPU through numpy: 10x cheaper than torch's op on small rows)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)
