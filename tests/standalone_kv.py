"""For tests that call a drafter without an engine: give it a KV cache and reserve each request's blocks,
as the engine does at admission (the drafter's cache lives on the engine's block allocator)."""

from __future__ import annotations

from specserve.kv_cache import BlockAllocator


def ensure_kv(drafter, request_ids, slots_per_request: int = 1024, block_size: int = 16) -> None:
    """Attach a fresh allocator to `drafter` (first call) and reserve blocks for unseen request ids."""
    allocator = getattr(drafter, "_test_allocator", None)
    if allocator is None:
        allocator = BlockAllocator(64 * slots_per_request // block_size, block_size)
        drafter.attach_kv(allocator)
        drafter._test_allocator = allocator
    for rid in request_ids:
        if rid not in allocator.tables:
            allocator.allocate(rid, slots_per_request)
