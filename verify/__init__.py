"""Draft trees, tree masks and positions, greedy and lossless stochastic acceptance."""

from specserve.verify.accept import accept_trees, draw_uniforms, greedy_accept, stochastic_accept
from specserve.verify.packed import PackedTrees, pack_trees
from specserve.verify.result import VerifyResult
from specserve.verify.tree import DraftTree

__all__ = [
    "DraftTree",
    "PackedTrees",
    "VerifyResult",
    "accept_trees",
    "draw_uniforms",
    "greedy_accept",
    "pack_trees",
    "stochastic_accept",
]
