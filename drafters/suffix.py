"""The ``suffix`` drafter: SuffixDecoding-style, training-free drafting that learns across requests.

Two count indexes (`specserve.drafters.suffix_match`) are consulted together:

- a **per-request** one over the request's own tokens (prompt + output so far), kept in step with the
  context incrementally: every `propose` indexes only the tokens added since the last one;
- a **shared** one over finished requests' outputs (each stored with the last ``max_match`` prompt tokens
  before it as a lead-in, so a repeated prompt finds how its earlier answer began), bounded by
  ``shared_tokens`` tokens: when a finished output would push it over, the oldest outputs are evicted
  (their counts taken back out). An output is added when its request is released.

For each request the tree grows best first. A node's children are the distinct tokens that followed the
longest suffix (``min_match..max_match`` tokens) of the context + the node's path in either index, with
counts summed over both; a child's score is its parent's times ``count / total`` (an empirical
acceptance estimate). The best-scoring candidate is added next (ties: the earlier candidate; siblings
in count-descending, token-ascending order) until the tree holds ``min(budget, max_budget)`` nodes or
nothing is left; no node is deeper than ``depth``. As in SuffixDecoding, weak evidence does not fill the
budget: a tree has at most ``spec_factor`` × the root's match length nodes (unless the match is ``max_match``
long: the index cannot tell a longer one apart, and a passage being copied earns a chain ``depth`` deep), and
no node scoring below ``min_prob`` (on fresh text a 1-token match would otherwise fill the budget with
guesses that cost verify rows). Drafts are deterministic (no q: the verifier treats
them as one-hot, which is lossless); ``DraftTree.scores`` carries the log scores for the adaptive
policy. Under a grammar the request's rule drops forbidden nodes of a tree without q, so the drafter ignores
``DraftRequest.mask``.

Why a hashed n-gram → next-token count index and not a suffix tree/automaton: appending a token touches
``max_match`` counters (O(1) amortised, no rebuild, no per-node pointers), eviction of the oldest output is
the same update with the opposite sign (a suffix automaton cannot forget), the per-request and shared
indexes merge by adding counts, and the frequency a node needs is one lookup. What it gives up is
matches longer than ``max_match`` tokens: past that length the longest suffix is the last ``max_match``
tokens, which in practice already pins the continuation down.

Memory: the tables are sized for ``max_match`` windows per token (at most half full). At ``max_match=8``
the shared index peaks near 2 KB per token of its cap when every window is new (evicted entries wait for
the rebuild): 60 MiB for the default 32768-token cap, measured; a request's own index is ~1 KB per
token. Only requests the engine handed to `propose` at least once are indexed, so under adaptive
speculation a request that never drafted leaves no output in the shared index.

Privacy: the shared index lives in the drafter instance, i.e. one per engine / server process, in memory
only, and text from one request's output can be proposed (as draft tokens, verified by the target) to
any later request of the same process — it can then show up in that request's output only if the target
itself would have produced it, but timing reveals whether it was in the index. specserve's server has at
most one API key (`server/access.py`), so every client of a server is one tenant; a server shared by
several tenants must set ``shared_tokens=0`` (per-request matching only). Keying the index by tenant is
left out until the server has several keys.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.drafters.base import CommitInfo, DraftRequest, Drafter, TargetInfo, check_int_option, register
from specserve.drafters import suffix_match as sm
from specserve.verify import DraftTree


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    return check_int_option("suffix", name, value, low, high)


class SuffixIndex:
    """One growable count index (the arrays of `suffix_match.new_index`) over token sequences."""

    def __init__(self, max_match: int, windows: int = 64) -> None:
        self.max_match = max_match
        self.arrays = sm.new_index(windows, windows)

    def add(self, seq: np.ndarray, start: int, end: int, sign: int = 1) -> None:
        """Count (sign 1) or uncount (sign -1) the windows of ``seq`` whose next token is at ``start..end-1``."""
        if end <= start:
            return
        if sign > 0:
            self.arrays = sm.grow(*self.arrays, (end - start) * self.max_match)
        sm.add_positions(*self.arrays, seq, start, end, self.max_match, sign)

    @property
    def live_entries(self) -> int:
        return int(self.arrays[9][3])

    @property
    def entries(self) -> int:
        return int(self.arrays[9][2])

    def lookup_view(self) -> tuple:
        """The arrays `build_suffix_tree` / `lookup` take for one index: keys, head, total, tok, cnt, next."""
        a = self.arrays
        return a[0], a[1], a[3], a[6], a[7], a[8]


_EMPTY = SuffixIndex(1)


@dataclass
class _RequestState:
    index: SuffixIndex
    tokens: np.ndarray  # buffer; tokens[:length] is the context as of the last propose (+ commits since)
    length: int = 0
    indexed: int = 0  # tokens[:indexed] have been counted as next tokens (all but possibly the tail)
    prompt_len: int = 0
    tail: list[int] = field(default_factory=list)


SHARED_TOKENS = 32768  # the shared index's default cap, in tokens
# A passage being copied (a match as long as ``max_match``) drafts a chain this deep: on the default model's
# multi-turn code edits, static drafting's τ went from 3.11 at depth 8 to 3.49 at 16 (BENCHMARKS.md, "Suffix
# chains as deep as the passage copied"); shorter matches stay within ``spec_factor`` × their length.
DEFAULT_DEPTH = 16


@register("suffix")
class SuffixDrafter(Drafter):
    """Suffix-decoding drafter (one-hot drafts; per-request and shared frequency indexes).

    Options:
      min_match:     shortest context suffix matched, >= 1.
      max_match:     longest context suffix matched (tokens of each indexed window), >= min_match, <= 64.
      depth:         most levels per tree, >= 1.
      max_budget:    most nodes per tree, >= 1; each tree has at most ``min(budget, max_budget)``.
      shared_tokens: cap of the shared index over finished outputs, in tokens, >= 0 (0: no sharing).
      spec_factor:   at most ``spec_factor * k`` nodes per tree, ``k`` the root's match length, >= 0 (0: off).
      min_prob:      nodes whose score (estimated acceptance probability) is below it are not drafted, in [0, 1].
    """

    needs_hidden_states = False
    learns_across_requests = True  # with the default shared index; per instance: shared_tokens > 0
    gives_probs = False

    @classmethod
    def learns_across_requests_with(cls, options: dict) -> bool:
        return options.get("shared_tokens", SHARED_TOKENS) != 0  # 0: per-request matching only

    def __init__(
        self,
        target: TargetInfo,
        path: str | None = None,
        *,
        min_match: int = 1,
        max_match: int = 8,
        depth: int = DEFAULT_DEPTH,
        max_budget: int = 24,
        shared_tokens: int = SHARED_TOKENS,
        spec_factor: int = 1,
        min_prob: float = 0.1,
    ) -> None:
        if path is not None:
            raise ValueError(f"the suffix drafter takes no path, got {path!r}")
        self.target = target
        self.min_match = _check("min_match", min_match, 1)
        self.max_match = _check("max_match", max_match, self.min_match, 64)
        self.depth = _check("depth", depth, 1)
        self.max_budget = _check("max_budget", max_budget, 1)
        self.shared_tokens = _check("shared_tokens", shared_tokens, 0)
        self.learns_across_requests = self.shared_tokens > 0
        self.spec_factor = _check("spec_factor", spec_factor, 0)
        ok = isinstance(min_prob, (int, float, np.floating)) and not isinstance(min_prob, bool)
        if not ok or not 0.0 <= float(min_prob) <= 1.0:
            raise ValueError(f"suffix drafter option min_prob must be a number in [0, 1], got {min_prob!r}")
        self.min_prob = float(min_prob)
        self.shared = SuffixIndex(self.max_match, 1024)
        self.shared_seqs: deque[np.ndarray] = deque()
        self.shared_size = 0  # tokens in shared_seqs
        self._states: dict[str, _RequestState] = {}

    # ---- per-request state -----------------------------------------------------------------------

    def _sync(self, request: DraftRequest) -> _RequestState:
        ctx = np.asarray(request.token_ids).reshape(-1)
        L = ctx.shape[0]
        st = self._states.get(request.request_id)
        if st is not None and (st.indexed > L or (st.indexed and st.tokens[st.indexed - 1] != ctx[st.indexed - 1])):
            st = None  # the context is not an extension of what was indexed: start over
        if st is None:
            st = _RequestState(SuffixIndex(self.max_match, 64),  # `add` grows it to what L needs
                               np.empty(max(64, 2 * L), np.int64), prompt_len=max(L - 1, 0))
            self._states[request.request_id] = st
        if L > st.tokens.shape[0]:
            buf = np.empty(max(2 * st.tokens.shape[0], L), np.int64)
            buf[:st.indexed] = st.tokens[:st.indexed]
            st.tokens = buf
        st.tokens[st.indexed:L] = ctx[st.indexed:L]
        st.index.add(st.tokens, st.indexed, L)
        st.indexed = st.length = L
        st.tail = []
        return st

    def on_commit(self, commits: list[CommitInfo]) -> None:
        # Only remembered for `release` (the last step's tokens are never handed to `propose`); the index
        # catches up from the authoritative token_ids at the next `propose`.
        for c in commits:
            st = self._states.get(c.request_id)
            if st is not None:
                st.tail.extend(int(t) for t in c.result.emitted_tokens)

    def release(self, request_id: str) -> None:
        st = self._states.pop(request_id, None)
        if st is None or self.shared_tokens == 0:
            return
        out = np.concatenate([st.tokens[:st.length], np.asarray(st.tail, np.int64)])
        start = max(0, st.prompt_len - self.max_match)
        if out.shape[0] - st.prompt_len < 1:
            return
        self.add_shared(out[start:])

    # ---- the shared index ------------------------------------------------------------------------

    def add_shared(self, seq: np.ndarray) -> None:
        """Add one finished sequence to the shared index, evicting the oldest ones past ``shared_tokens``."""
        if self.shared_tokens == 0:
            return
        seq = np.ascontiguousarray(seq, dtype=np.int64).reshape(-1)[-self.shared_tokens:]
        if seq.shape[0] < 2:
            return
        while self.shared_seqs and self.shared_size + seq.shape[0] > self.shared_tokens:
            old = self.shared_seqs.popleft()
            self.shared_size -= old.shape[0]
            self.shared.add(old, 0, old.shape[0], sign=-1)
        self.shared_seqs.append(seq)
        self.shared_size += seq.shape[0]
        self.shared.add(seq, 0, seq.shape[0])
        if self.shared.entries > 2 * self.shared.live_entries + 4096:
            # evicted entries (count 0) outnumber live ones: rebuild from what is kept
            self.shared = SuffixIndex(self.max_match, max(1024, self.shared_size * self.max_match))
            for s in self.shared_seqs:
                self.shared.add(s, 0, s.shape[0])

    def forget_shared(self) -> None:
        self.shared = SuffixIndex(self.max_match, 1024)
        self.shared_seqs.clear()
        self.shared_size = 0

    # ---- proposing -------------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest], budgets: list[int], depth: int | None = None) -> list[DraftTree]:
        if len(budgets) != len(requests):
            raise ValueError(f"propose got {len(requests)} requests but {len(budgets)} budgets")
        trees = []
        for request, budget in zip(requests, budgets):
            budget = int(budget)
            if budget < 0:
                raise ValueError(f"budget for request {request.request_id!r} must be >= 0, got {budget}")
            st = self._sync(request)
            trees.append(self._tree(st.index, st.tokens[:st.length], budget, depth))
        return trees

    def _tree(self, index: SuffixIndex, ctx: np.ndarray, budget: int, depth: int | None) -> DraftTree:
        cap = min(budget, self.max_budget)
        if cap <= 0 or ctx.shape[0] < 1:
            return DraftTree.empty()
        depth = self.depth if depth is None else max(1, min(depth, self.depth))
        shared = self.shared if self.shared_size else _EMPTY
        tokens, parents, scores = sm.build_suffix_tree(*index.lookup_view(), *shared.lookup_view(), ctx,
                                                       self.min_match, self.max_match, depth, cap,
                                                       self.spec_factor, self.min_prob)
        if tokens.shape[0] == 0:
            return DraftTree.empty()
        return DraftTree(torch.from_numpy(tokens), torch.from_numpy(parents), scores=torch.from_numpy(scores))

    def __repr__(self) -> str:
        return (f"SuffixDrafter(min_match={self.min_match}, max_match={self.max_match}, depth={self.depth}, "
                f"max_budget={self.max_budget}, shared_tokens={self.shared_tokens}, "
                f"spec_factor={self.spec_factor}, min_prob={self.min_prob})")
