"""What /metrics reads from the engine, through one accessor so that engine changes touch one place.

Called on the engine thread after every step (see EngineWorker), never from the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    waiting: int  # requests queued for a batch slot
    running: int  # sequences in the running batch
    kv_blocks_total: int
    kv_blocks_free: int  # evictable cached blocks count as free (a new request may take them)
    kv_blocks_cached: int = 0  # blocks the prefix cache indexes (in use or evictable)
    kv_blocks_evictable: int = 0  # cached blocks no request holds: kept until their space is needed

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free


def read_engine_load(engine) -> EngineLoad:
    allocator = engine.cache.allocator
    return EngineLoad(
        waiting=len(engine.waiting),
        running=len(engine.running),
        kv_blocks_total=allocator.num_blocks,
        kv_blocks_free=allocator.num_free_blocks,
        kv_blocks_cached=allocator.num_cached_blocks,
        kv_blocks_evictable=allocator.num_evictable_blocks,
    )
