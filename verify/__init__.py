"""Draft trees, tree masks and positions, greedy and lossless stochastic acceptance."""

from specserve.verify.accept import accept_batch, greedy_accept, split_verify_rows, stochastic_accept
from specserve.verify.result import VerifyResult
from specserve.verify.tree import DraftTree

__all__ = [
    "DraftTree",
    "VerifyResult",
    "accept_batch",
    "greedy_accept",
    "split_verify_rows",
    "stochastic_accept",
]
