"""What verification of one tree hands back to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one request's draft tree.

    accepted_nodes:  node indices of the accepted root→node path (tree index space, root excluded),
                     in depth order; empty when no draft token was accepted.
    accepted_tokens: the tokens of those nodes.
    bonus_token:     the token sampled from the target at the last accepted row (the root's row when
                     nothing was accepted). Always emitted: a step yields len(accepted_tokens) + 1 tokens.
    num_drafted:     nodes in the tree (N).
    logprobs:        one `verify.logprobs.TokenLogprob` per emitted token when the request asked for
                     them (`SamplingParams.logprobs`), else empty.
    """

    accepted_nodes: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    bonus_token: int
    num_drafted: int
    logprobs: tuple = field(default=(), compare=False)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def emitted_tokens(self) -> list[int]:
        """Accepted draft tokens followed by the bonus token: what this step adds to the output."""
        return [*self.accepted_tokens, self.bonus_token]
