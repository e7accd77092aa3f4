"""How a tensor-parallel rank's share of a model is cut: its `Shard`, the shapes it holds, the checkpoint slices
it reads. Pure functions of the config, shared by the loaders (which read only a rank's slices) and
`specserve.tensor_parallel` (which runs the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specserve.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """This rank's place in a tensor-parallel group of `world` ranks."""

    rank: int
    world: int

    def part(self, n: int) -> tuple[int, int]:
        """[lo, hi) of an evenly divisible dimension of size n (heads, kv heads, MLP columns)."""
        size = n // self.world
        return self.rank * size, (self.rank + 1) * size

    def vocab_part(self, vocab: int) -> tuple[int, int]:
        """[lo, hi) of the LM head's rows: ceil(V/N) per rank, the last rank fewer."""
        size = -(-vocab // self.world)
        return min(vocab, self.rank * size), min(vocab, (self.rank + 1) * size)


def check_shardable(cfg: ModelConfig, world: int) -> None:
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    for name, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide the model's {name}={n}: "
                             f"each rank must own whole heads and an equal share of the MLP")


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The layer shapes one rank holds (the vocabulary stays whole: logits are gathered)."""
    return replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                   intermediate_size=cfg.intermediate_size // world)


def slice_of(name: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, lo, hi) of tensor `name` that `shard` reads, or None when every rank reads all of it."""
    hd = cfg.head_dim
    q = tuple(x * hd for x in shard.part(cfg.num_heads))
    kv = tuple(x * hd for x in shard.part(cfg.num_kv_heads))
    mlp = shard.part(cfg.intermediate_size)
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return (0, *q)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return (0, *kv)
    if name.endswith("o_proj.weight"):
        return (1, *q)
    if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
        return (0, *mlp)
    if name.endswith("down_proj.weight"):
        return (1, *mlp)
    if name == "lm_head.weight" and shard.rank != 0:  # rank 0 keeps it whole (see the module docstring)
        return (0, *shard.vocab_part(cfg.vocab_size))
    return None
