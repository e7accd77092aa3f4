"""Output constraints as step hooks: a request with `SamplingParams.constraint` gets a `ConstraintRule`
(its own llguidance matcher) that masks its verify rows, forces the tokens the grammar leaves no choice
about, masks and filters its drafts, and advances with every emitted token (stopping the request when
the grammar is complete). The engine knows it only as a `specserve.step_hooks.RequestRule`.

drafting — how constrained requests draft (`LLM(grammar_drafting=...)`); the output is the same in every
mode, only speed differs:
  "verify": the grammar masks verification only (drafters propose freely: what other stacks do);
  "aware":  drafters also mask their own distributions and trees without q are filtered, so no verify
            row is spent on a forbidden token;
  "forced": aware, and forced tokens are drafted for free (the default).
"""

from __future__ import annotations

import threading

import torch

from specserve.defaults import GRAMMAR_DRAFTING
from specserve.grammar.compiler import GrammarCompiler
from specserve.grammar.constraint import Constraint
from specserve.grammar.state import GrammarState
from specserve.step_hooks import DraftMask, RequestRule, TokenVerdict
from specserve.verify import DraftTree

__all__ = ["GRAMMAR_DRAFTING", "ConstraintRule", "ConstraintRules"]


class ConstraintRule(RequestRule):
    """One constrained request: state — its matcher, advanced by exactly the tokens it emitted."""

    constrains_output = True

    def __init__(self, state: GrammarState, drafting: str, greedy: bool) -> None:
        self.state = state
        self.drafting = drafting
        self.greedy = greedy

    def process_logits(self, logits, tree: DraftTree) -> None:
        """-inf at every token the grammar forbids at each verify row (the matcher state of the row's node)."""
        masks, _ = self.state.tree_masks(tree)  # bool[N+1, V]
        logits.masked_fill_(~torch.from_numpy(masks).to(logits.device), float("-inf"))

    def forced_tokens(self) -> list[int]:
        return self.state.forced_tokens() if self.drafting == "forced" and not self.state.failed else []

    def draft_mask(self) -> DraftMask | None:
        return self.state if self.drafting != "verify" else None

    def filter_tree(self, tree: DraftTree) -> DraftTree:
        """Drop what the grammar forbids from trees whose drafter does not mask its own proposals (n-gram,
        Medusa's static trees). Exact for greedy requests and one-hot drafts only (GrammarState.legal_subtree):
        a sampled tree with q is masked by its drafter instead."""
        if self.drafting == "verify" or not (self.greedy or not tree.has_q):
            return tree
        return self.state.legal_subtree(tree)

    def accept_token(self, token: int) -> TokenVerdict | None:
        if not self.state.failed:
            self.state.advance([token])
        if self.state.failed:
            # The matcher gave up (llguidance's work limits on a pathological grammar): this request
            # alone ends, without the tokens its grammar could not vouch for.
            return TokenVerdict("error", keep=False, error=f"the output constraint failed: {self.state.error}")
        if self.state.stopped:
            return TokenVerdict("stop")  # the grammar is complete and admits nothing more
        return None


class ConstraintRules:
    """The rule factory an `LLM` installs on its engine: compiles each distinct constraint once (the
    compiler is built with the first constraint, from any thread) and gives each constrained request its
    own matcher."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, drafting: str = "forced") -> None:
        if drafting not in GRAMMAR_DRAFTING:
            raise ValueError(f"grammar_drafting must be one of {', '.join(GRAMMAR_DRAFTING)}, got {drafting!r}")
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self.drafting = drafting
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def __call__(self, request) -> ConstraintRule | None:
        constraint = request.params.constraint
        if constraint is None:
            return None
        return ConstraintRule(self.compiler.state(constraint), self.drafting, request.params.greedy)

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._compiler

    def compiled(self, constraint: Constraint) -> bool:
        """Whether ``constraint`` is in the compiled cache (its request can go straight to the engine)."""
        return self._compiler is not None and self._compiler.cached(constraint)

    def compile(self, constraint: Constraint) -> None:
        """Compile a constraint into the cache now, on the calling thread (ValueError when it does not
        compile), so admission on the engine thread finds it compiled and no step waits for it."""
        self.compiler.template(constraint)

    @property
    def mask_s(self) -> float:
        """Seconds spent computing grammar masks so far (verification rows and drafters' nodes)."""
        return self._compiler.clock.seconds if self._compiler is not None else 0.0

