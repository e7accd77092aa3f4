"""Each request's draft sampler: a random stream of its own, so a seeded request reproduces.

Drafters that sample their trees (draft model, Medusa, EAGLE) draw the uniforms of a request's draws
from this generator — seeded by (drafter kind, option seed, request seed) when the engine hands the
request's sampling seed over (``DraftRequest.seed``), else by the request id — independent of the
verifier's stream and of whatever else shares the batch.
"""

from __future__ import annotations

import hashlib

import torch

from specserve.drafters.base import DraftRequest


def request_generator(kind: str, option_seed: int, req: DraftRequest, device: torch.device) -> torch.Generator:
    """A request's draft sampler (see the module docstring)."""
    source = f"id:{req.request_id}" if req.seed is None else f"seed:{req.seed}"
    digest = hashlib.blake2b(f"{kind}:{option_seed}:{source}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return generator
