"""Draft trees, tree masks and positions, greedy and lossless stochastic acceptance."""

from pathlib import Path

from specserve.numba_cache import register_package

register_package(Path(__file__).parent)  # before its numba functions are defined: see numba_cache

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
