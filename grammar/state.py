"""One request's grammar state: an llguidance matcher advanced by the tokens the request emitted, and
the masks of a draft tree's rows computed from it in one depth-first walk.

Masks are bool[V] numpy arrays over the model's vocabulary (True: allowed). A tree's row r holds the
distribution of the token after it (verify/tree.py): row 0 the root's (the matcher as it is), row
i + 1 node i's (the matcher after the path to node i). Walking the tree consumes a node's token on the
way down and rolls it back on the way up, so each node costs one consume, one mask and one rollback.
"""

from __future__ import annotations

from collections.abc import Sequence

import time
from dataclasses import dataclass

import numpy as np

from specserve.verify import DraftTree

__all__ = ["GrammarState", "MaskClock"]


@dataclass
class MaskClock:
    """Seconds spent computing masks, shared by the states of one engine (benchmarks report it)."""

    seconds: float = 0.0


class GrammarState:
    """matcher: an llguidance `LLMatcher` that has consumed exactly the request's emitted tokens."""

    def __init__(self, matcher, vocab_size: int, clock: MaskClock | None = None) -> None:
        self.matcher = matcher
        self.clock = clock if clock is not None else MaskClock()
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._one = np.empty((1, self._words), dtype=np.int32)

    # ---- the committed state --------------------------------------------------------------------

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume tokens the request emitted (they were verified under this grammar's masks). Should the
        matcher fail anyway (llguidance's per-step work limits on a pathological grammar), it is left
        `failed` and the engine ends this request alone with finish reason "error"."""
        self.matcher.consume_tokens(list(tokens))

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        # llguidance appends its whole parser state and the grammar ("<state>...</state><grammar>...")
        # or, with verbose errors off (grammar/compiler.py), a "<non-verbose/>" marker; the reason comes
        # first, and it is what reaches clients and logs, on one line.
        reason = self.matcher.get_error().split("<state>")[0].replace("<non-verbose/>", "")
        return " ".join(reason.split())

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits no further token (only EOS): the request is done."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows no alternative to from here (llguidance's fast-forward tokens)."""
        if self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())

    # ---- masks ----------------------------------------------------------------------------------

    def allowed(self, path: Sequence[int] = ()) -> np.ndarray | None:
        """bool[V]: the tokens allowed after the committed state plus `path`; None when the grammar
        forbids `path` itself."""
        started = time.perf_counter()
        path = list(path)
        if path:
            consumed = self.matcher.try_consume_tokens(path)  # stops at the first forbidden token
            if consumed < len(path):
                self.matcher.rollback(consumed)
                return None
        try:
            self.matcher.unsafe_compute_mask_ptr(self._one.ctypes.data, self._one.nbytes)
        finally:
            if path:
                self.matcher.rollback(len(path))
        mask = self._unpack(self._one)[0]
        self.clock.seconds += time.perf_counter() - started
        return mask

    def tree_masks(self, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
        """(masks bool[N+1, V] for the tree's rows, legal bool[N]: the grammar allows the node's path).

        Rows of illegal nodes are all True: such a node's own token is masked at its parent's row, so
        it is never accepted and its row's distribution is never read."""
        started = time.perf_counter()
        bits = np.full((tree.num_nodes + 1, self._words), -1, dtype=np.int32)
        if self.failed:  # no mask to give: the row goes unmasked and the engine ends the request at emit
            return self._unpack(bits), np.ones(tree.num_nodes, dtype=np.bool_)
        self._mask_into(bits, 0)
        legal = self._walk(tree, bits)
        masks = self._unpack(bits)
        self.clock.seconds += time.perf_counter() - started
        return masks, legal

    def _walk(self, tree: DraftTree, bits: np.ndarray | None) -> np.ndarray:
        """Depth-first over the tree, consuming each node's token on the way down and rolling it back on
        the way up; bool[N] legal nodes, and each legal node's mask into bits[node + 1] when given."""
        n = tree.num_nodes
        legal = np.zeros(n, dtype=np.bool_)
        if not n:
            return legal
        tokens = tree.tokens.tolist()
        children: list[list[int]] = [[] for _ in range(n + 1)]  # children[0]: the root's
        for i, p in enumerate(tree.parents.tolist()):
            children[p + 1].append(i)
        stack = [(child, True) for child in reversed(children[0])]
        while stack:
            node, entering = stack.pop()
            if not entering:
                self.matcher.rollback(1)
                continue
            if not self.matcher.try_consume_tokens([tokens[node]]):
                continue  # forbidden: it and its subtree stay illegal
            legal[node] = True
            if bits is not None:
                self._mask_into(bits, node + 1)
            stack.append((node, False))
            stack.extend((child, True) for child in reversed(children[node + 1]))
        return legal

    def _mask_into(self, bits: np.ndarray, row: int) -> None:
        self.matcher.unsafe_compute_mask_ptr(bits[row].ctypes.data, bits[row].nbytes)

    def _unpack(self, bits: np.ndarray) -> np.ndarray:
        return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size].astype(np.bool_)

    # ---- drafts ---------------------------------------------------------------------------------

    def legal_subtree(self, tree: DraftTree) -> DraftTree:
        """The tree without the nodes the grammar forbids (and their subtrees).

        Only for trees whose siblings do not condition on each other: greedy requests, and draft nodes
        without q (one-hot: a forbidden token has target probability 0, so trying it only ever rejects
        it and leaves the residual unchanged — skipping it changes nothing). A sampled sibling's q
        assumes the earlier siblings were tried, so trees with q are masked by their drafter instead."""
        if not tree.num_nodes:
            return tree
        started = time.perf_counter()
        legal = self._walk(tree, None)
        self.clock.seconds += time.perf_counter() - started
        return tree if legal.all() else tree.subtree(np.flatnonzero(legal))
