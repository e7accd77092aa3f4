"""The ``lookahead`` drafter: Jacobi iteration in the verify forward plus an n-gram pool (after Fu et al.,
"Break the Sequential Dependency of LLM Inference Using Lookahead Decoding", 2024). No model of its own.

Each request keeps a **window**: W guesses for the W tokens after its root. Its tree is the window as a
chain after the root, merged (one trie) with up to G **pool candidates**: (N-1)-token continuations of
the root token harvested earlier. Everything rides in the ordinary verify forward as draft nodes — no
extra rows, no second forward — and is verified like any draft: lossless for free (greedy acceptance;
at T > 0 the nodes are one-hot proposals, as the n-gram drafter's).

That same forward computes the target's argmax at every window row (`wants_row_argmax`): the row of
window node d (position root + d) predicts position root + d + 1 given the guessed prefix — one Jacobi
step for every position at once. After a step that accepted a tokens (the bonus b becomes the root), the
new window is the argmax of window rows a+1 .. W (guesses for the positions after b), padded to W from the
pool. The sequence [b, new window] and the committed tokens are harvested into the pool as N-grams keyed
by their first token (the lookahead branch of the paper, here folded into the window's own rows).

On a CPU extra verify rows are not free (each costs a share of the step), so the window is short by
default and the tree carries scores (pool candidates by the request's pool hit rate, window nodes lower)
for the adaptive policy to cut.

Options: ``window`` W (guess positions, 1-16, default 4), ``ngram`` N (pool n-gram length incl. its key,
2-8, default 4), ``pool`` G (pool candidates per step and per key, 1-16, default 3), ``max_budget``.
State is per request (window, pool of at most 64 keys x G n-grams, LRU), freed at ``release``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.drafters.base import CommitInfo, DraftRequest, Drafter, TargetInfo, check_int_option, register
from specserve.verify import DraftTree

POOL_KEYS = 64  # most keys a request's pool holds (least recently used out)
WINDOW_GUESS = 0.15  # a window node's conditional acceptance guess (a Jacobi guess rarely holds)


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    return check_int_option("lookahead", name, value, low, high)


@dataclass
class _State:
    window: list[int] = field(default_factory=list)  # guesses for the positions after the root
    pool: OrderedDict = field(default_factory=OrderedDict)  # key token -> OrderedDict[n-gram tuple, None]
    harvested: int = 0  # tokens of the context already harvested into the pool
    hits: float = 1.0  # pool candidates accepted / proposed, with a prior
    tried: float = 2.0


@register("lookahead")
class LookaheadDrafter(Drafter):
    """Jacobi window + n-gram pool, in the verify forward (see the module docstring)."""

    wants_row_argmax = True

    def __init__(self, target: TargetInfo, path: str | None = None, *, window: int = 4, ngram: int = 4, pool: int = 3,
                 max_budget: int | None = None) -> None:
        if path is not None:
            raise ValueError("the lookahead drafter needs no files: use 'lookahead', not 'lookahead:PATH'")
        self.window = _check("window", window, 1, 16)
        self.ngram = _check("ngram", ngram, 2, 8)
        self.pool = _check("pool", pool, 1, 16)
        full = self.window + self.pool * (self.ngram - 1)
        self.max_budget = full if max_budget is None else min(_check("max_budget", max_budget, 1), full)
        self.depth = max(self.window, self.ngram - 1)
        self._states: dict[str, _State] = {}

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    # ---- drafting -------------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest], budgets: list[int], depth: int | None = None) -> list[DraftTree]:
        return [self._tree(r, int(b)) for r, b in zip(requests, budgets)]

    def _tree(self, req: DraftRequest, budget: int) -> DraftTree:
        st = self._states.get(req.request_id)
        ctx = req.token_ids
        if st is None:
            st = self._states[req.request_id] = _State()
        self._harvest_context(st, ctx)
        if not st.window:
            st.window = self._initial_window(ctx)
        if budget <= 0 or len(ctx) == 0:
            return DraftTree.empty()
        root = int(ctx[-1])
        candidates = list(st.pool.get(root, {}))[-self.pool:][::-1]  # most recent first
        pool_logp = math.log(max(min(st.hits / st.tried, 0.95), 1e-3))
        paths = [(list(c), pool_logp) for c in candidates] + [(list(st.window), math.log(WINDOW_GUESS))]
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        index: dict[tuple[int, int], int] = {}
        for path, step_logp in paths:
            parent, score = -1, 0.0
            for tok in path:
                score += step_logp
                key = (parent, int(tok))
                node = index.get(key)
                if node is None:
                    if len(tokens) >= budget:
                        break
                    node = index[key] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(parent)
                    scores.append(score)
                else:
                    scores[node] = max(scores[node], score)
                parent = node
        if not tokens:
            return DraftTree.empty()
        scores_arr = np.asarray(scores, dtype=np.float32)
        parents_arr = np.asarray(parents, dtype=np.int64)
        for n, par in enumerate(parents):  # a node never scores above its parent
            if par >= 0:
                scores_arr[n] = min(scores_arr[n], scores_arr[par])
        return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.from_numpy(parents_arr),
                         scores=torch.from_numpy(scores_arr))

    def _initial_window(self, ctx: np.ndarray) -> list[int]:
        """A fresh request's guesses: the tokens that followed the root's last earlier occurrence in the
        context (prompt lookup's guess), else the context's last W tokens."""
        if len(ctx) == 0:
            return []
        root = ctx[-1]
        earlier = np.flatnonzero(ctx[:-1] == root)
        if earlier.size:
            start = int(earlier[-1]) + 1
            guess = ctx[start:start + self.window].tolist()
            if len(guess) == self.window:
                return guess
        return ctx[-self.window:].tolist()

    # ---- the pool ---------------------------------------------------------------------------------

    def _add_ngrams(self, st: _State, seq: list[int]) -> None:
        n = self.ngram
        for i in range(len(seq) - n + 1):
            key, rest = seq[i], tuple(seq[i + 1:i + n])
            grams = st.pool.get(key)
            if grams is None:
                grams = st.pool[key] = OrderedDict()
                if len(st.pool) > POOL_KEYS:
                    st.pool.popitem(last=False)
            else:
                st.pool.move_to_end(key)
            grams[rest] = None
            grams.move_to_end(rest)
            while len(grams) > self.pool:
                grams.popitem(last=False)

    def _harvest_context(self, st: _State, ctx: np.ndarray) -> None:
        """N-grams of the committed text not harvested yet (prompt lookup's pool, kept incrementally)."""
        start = max(st.harvested - self.ngram + 1, 0)
        if len(ctx) - start >= self.ngram:
            self._add_ngrams(st, ctx[start:].tolist())
            st.harvested = len(ctx)

    # ---- the Jacobi step, from the verify forward's argmax -----------------------------------------

    def on_commit(self, commits: list[CommitInfo]) -> None:
        for c in commits:
            st = self._states.get(c.request_id)
            if st is None or c.tree is None or c.row_argmax is None:
                continue
            result = c.result
            nodes = self._window_nodes(c.tree, st.window)  # the window node of depth d + 1 is nodes[d]
            if c.tree.num_nodes > len(nodes):  # pool candidates were verified: their hit rate
                st.tried += 1
                st.hits += 1 if result.num_accepted > 0 and result.accepted_nodes[0] not in nodes else 0
            a = result.num_accepted
            # Row of node at depth d predicts the token after it: depths a+1.. guess the positions after
            # the new root (the bonus, at depth a + 1). Whether the accepted path was the window's or a
            # pool candidate's, these are the Jacobi update of the positions still ahead.
            guesses = [int(c.row_argmax[node + 1]) for node in nodes[a:]]
            bonus = result.bonus_token
            self._add_ngrams(st, [bonus] + guesses)
            while len(guesses) < self.window:  # pad from the pool, else repeat the last guess
                last = guesses[-1] if guesses else bonus
                more = list(st.pool.get(last, {}))
                guesses.extend(more[-1] if more else (last,))
            st.window = guesses[:self.window]

    @staticmethod
    def _window_nodes(tree: DraftTree, window: list[int]) -> list[int]:
        """The verified tree's nodes along the window's path from the root (it may be cut short)."""
        if tree.num_nodes == 0:
            return []
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        out, parent = [], -1
        for tok in window:
            node = next((n for n in range(tree.num_nodes) if parents[n] == parent and tokens[n] == tok), None)
            if node is None:
                break
            out.append(node)
            parent = node
        return out

    def __repr__(self) -> str:
        return f"LookaheadDrafter(window={self.window}, ngram={self.ngram}, pool={self.pool}, max_budget={self.max_budget})"
