"""What a draft node is worth: the probability that verification accepts it, learned from what was.

A tree's expected accepted length is the sum over its nodes of P(node is on the accepted path), so a
node's value is that probability: the product, down its path, of each node's *conditional* acceptance
(accepted, given its parent was). Drafters give a score per node (`DraftTree.scores`: their own guess
at log P(accepted)); a node's own term is its score minus its parent's. This model maps own terms to
observed conditional acceptance — per bin, counted over recent steps, separately for greedy and sampled
requests (acceptance differs a lot), made monotone (pool-adjacent-violators). Conditional rates are
learned at every depth alike (a depth-5 node is a trial whenever depth 4 was accepted), so deep nodes
are valued from evidence, not from a prior the cut never lets them disprove. Trees without scores are
ranked by depth and sibling order (`fallback_scores`).
"""

from __future__ import annotations

import numba
import numpy as np

# Score bins over log-probabilities: [-12, 0] in 0.25 steps (EAGLE's cumulative log-probs at depth 5
# rarely go below -12; everything lower shares the first bin).
EDGES = np.arange(-12.0, 0.0001, 0.25)
NUM_BINS = len(EDGES) + 1
# Weight of the drafter's own score as a prior, in observations per bin: enough to be sane before
# anything is seen, little enough that ~10 verified nodes in a bin override it.
PRIOR_WEIGHT = 2.0
# Per-step forgetting of old observations (a half-life of ~700 steps): acceptance drifts with the text.
DECAY = 0.999
# The calibrated table is refitted after every REFIT_EVERY observed steps (every step while a kind has
# fewer than EARLY_TRIALS trials): a refit every step was a sixth of the policy's per-step cost, and
# ~8 steps move a table with a 700-step half-life by about 1 %.
REFIT_EVERY = 8
EARLY_TRIALS = 64


def own_terms(scores: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Each node's score minus its parent's (the root's score is 0)."""
    return scores - np.where(parents >= 0, scores[np.maximum(parents, 0)], 0.0)


def path_products(conditional: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """P(node on the accepted path): products of conditional acceptance down each path (float64[N]; nodes
    come parents first, as in every `DraftTree`)."""
    return _path_products(np.ascontiguousarray(conditional, dtype=np.float64), np.ascontiguousarray(parents, dtype=np.int64))


@numba.njit(cache=True, nogil=True)
def _path_products(conditional: np.ndarray, parents: np.ndarray) -> np.ndarray:
    # One pass in topological order (a parent's product is final before its children read it): compiled,
    # because the numpy version (a pass per depth) was a third of the policy's per-step cost.
    out = conditional.copy()
    for i in range(out.shape[0]):
        if parents[i] >= 0:
            out[i] *= out[parents[i]]
    return out


def fallback_scores(parents: np.ndarray) -> np.ndarray:
    """The stand-in score of nodes whose drafter gives none (n-gram, Medusa's static trees): each level
    down costs 1, each earlier sibling 1 more — drafters list a node's likelier children first. Only the
    tree's shape is read, so for sampled requests the cut never depends on drawn values."""
    scores = np.zeros(len(parents), dtype=np.float32)
    seen: dict[int, int] = {}
    for i, p in enumerate(parents.tolist()):
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        scores[i] = (scores[p] if p >= 0 else 0.0) - 1.0 - rank
    return scores


class NodeValueModel:
    """Calibrated conditional acceptance by a node's own score term; `kind` 0 = greedy requests, 1 = sampled."""

    def __init__(self) -> None:
        centers = np.concatenate([[EDGES[0] - 0.125], (EDGES[:-1] + EDGES[1:]) / 2, [0.0]])
        self.prior = np.clip(np.exp(centers), 0.02, 0.98)
        self.hits = np.zeros((2, NUM_BINS))
        self.trials = np.zeros((2, NUM_BINS))
        self._table = [None, None]
        self._unfitted = [0, 0]  # observed steps since each kind's table was fitted

    def conditional(self, terms: np.ndarray, sampled: bool) -> np.ndarray:
        """float64[N] P(accepted | parent accepted) of nodes with these own score terms."""
        kind = int(sampled)
        if self._table[kind] is None:
            self._table[kind] = self._fit(kind)
        return self._table[kind][np.searchsorted(EDGES, terms, side="right")]

    def observe(self, terms: np.ndarray, parents: np.ndarray, accepted: np.ndarray, sampled: bool) -> None:
        """Nodes verified this step (own terms, parents) and whether each was on the accepted path: each
        node whose parent was accepted (or is the root) is one trial of its bin."""
        kind = int(sampled)
        reached = (parents < 0) | accepted[np.maximum(parents, 0)]
        bins = np.searchsorted(EDGES, terms[reached], side="right")
        self.trials[kind] *= DECAY
        self.hits[kind] *= DECAY
        self.trials[kind] += np.bincount(bins, minlength=NUM_BINS)
        self.hits[kind] += np.bincount(bins, weights=accepted[reached], minlength=NUM_BINS)
        self._unfitted[kind] += 1
        if self._unfitted[kind] >= REFIT_EVERY or self.trials[kind].sum() < EARLY_TRIALS:
            self._table[kind] = None
            self._unfitted[kind] = 0

    def _fit(self, kind: int) -> np.ndarray:
        weight = self.trials[kind] + PRIOR_WEIGHT
        rate = (self.hits[kind] + PRIOR_WEIGHT * self.prior) / weight
        return _isotonic(rate, weight)


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to y in weighted least squares (pool adjacent violators)."""
    values, weights, counts = [], [], []
    for v, wt in zip(y.tolist(), w.tolist()):
        values.append(v)
        weights.append(wt)
        counts.append(1)
        while len(values) > 1 and values[-2] > values[-1]:
            wsum = weights[-2] + weights[-1]
            merged = (values[-2] * weights[-2] + values[-1] * weights[-1]) / wsum
            merged_count = counts.pop()
            counts[-1] += merged_count
            weights[-2] = wsum
            weights.pop()
            values.pop()
            values[-1] = merged
    return np.repeat(values, counts)
