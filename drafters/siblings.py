"""Drawing a node's children for stochastic verification: k tokens without replacement, exact q.

The stochastic verifier (verify/accept.py) tries a node's children in order and needs, for child j,
the exact distribution it was drawn from given children 0..j-1: q with those removed and
renormalised. Every drafter that samples its trees (draft model, Medusa, EAGLE) draws through here.
"""

from __future__ import annotations

import hashlib
import math

import torch

from specserve.drafters.base import DraftRequest

# Expansion/rerank score of the j-th drawn sibling (log): with a good draft (q close to p) the first
# draw is accepted with probability near 1 whatever its q, and later siblings are only tried after
# rejections; so sibling j is scored as accepted with probability 0.8 * 0.2**j, never by its drawn
# value — which keeps a sampled tree's shape independent of its draws (draft model, EAGLE).
SAMPLED_SIBLING_LOGP = [math.log(0.8) + j * math.log(0.2) for j in range(64)]


def sample_siblings(q: torch.Tensor, generators: list[torch.Generator], k: int):
    """Draw k tokens per row without replacement, in order, by inverse CDF.

    q: float32[R, V] draft distributions; generators: one per row (rows of one request share that
    request's generator; consecutive rows with the same generator draw in one call). Returns tokens
    int64[R, k], valid bool[R, k] (False once a row runs out of tokens with positive probability)
    and probs float32[R, k, V]: sibling j's distribution, q without siblings 0..j-1, renormalised.
    """
    if len(generators) != q.shape[0]:
        raise ValueError(f"sample_siblings got {q.shape[0]} rows but {len(generators)} generators")
    uniforms, start = [], 0
    while start < len(generators):
        end = start
        while end < len(generators) and generators[end] is generators[start]:
            end += 1
        uniforms.append(torch.rand(end - start, k, generator=generators[start], device=q.device))
        start = end
    u = torch.cat(uniforms)  # [R, k]
    rest = q.clone()
    probs = torch.empty(q.shape[0], k, q.shape[1], device=q.device)
    tokens = torch.empty(q.shape[0], k, dtype=torch.int64, device=q.device)
    valid = torch.empty(q.shape[0], k, dtype=torch.bool, device=q.device)
    for j in range(k):
        total = rest.sum(-1, keepdim=True)  # [R, 1]
        probs[:, j] = rest / total.clamp_min(1e-30)
        cdf = probs[:, j].cumsum(-1)
        tok = torch.searchsorted(cdf, u[:, j : j + 1] * cdf[:, -1:], right=True).clamp_(max=q.shape[1] - 1)  # [R, 1]
        tokens[:, j] = tok[:, 0]
        valid[:, j] = (total[:, 0] > 0) & (probs[:, j].gather(-1, tok)[:, 0] > 0)
        rest.scatter_(-1, tok, 0.0)
    return tokens, valid, probs


def request_generator(kind: str, option_seed: int, req: DraftRequest, device: torch.device) -> torch.Generator:
    """A request's draft sampler: seeded by (drafter kind, option seed, request seed) when the engine
    hands the request's sampling seed over (``DraftRequest.seed``), else by the request id. Either way
    it is a stream of its own, independent of the verifier's, so a seeded request reproduces."""
    source = f"id:{req.request_id}" if req.seed is None else f"seed:{req.seed}"
    digest = hashlib.blake2b(f"{kind}:{option_seed}:{source}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return generator
