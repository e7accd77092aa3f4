"""Grammars compiled once per distinct constraint and tokenizer; each request gets its own matcher.

llguidance needs the tokenizer's tokens as bytes (`LLTokenizer`, built once per engine from the HF
fast tokenizer) and compiles a grammar when an `LLMatcher` is made (up to ~1 s for huge schemas). We
compile each distinct constraint once into a *template* matcher that never consumes a token and give
every request a `deep_copy` of it (microseconds).

Compiling is thread-safe (`template`, under a lock; llguidance releases the GIL while it builds), so a
server compiles a request's constraint on a worker thread before handing the request to the engine:
the engine thread then finds it compiled and no stream stalls for a big schema. Every compile runs
under `LIMITS`: a grammar past them is refused with a clear error instead of costing seconds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from specserve.grammar.constraint import Constraint, one_line
from specserve.grammar.state import GrammarState, MaskClock

__all__ = ["GrammarCompiler"]


def parser_limits():
    """llguidance's resource limits for every matcher: its defaults, except a smaller grammar (in
    symbols: a 20,000-way alternation compiled in 0.65 s on the 2-core CI machine, far past any real
    schema) and lexer state budget, and no parser state or grammar text in error messages (they reach
    clients)."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, max_lexer_states=MAX_LEXER_STATES, verbose_errors=False)


MAX_GRAMMAR_SYMBOLS = 100_000
MAX_LEXER_STATES = 50_000


class GrammarCompiler:
    """tokenizer: a transformers fast tokenizer; vocab_size: the model's (masks cover every logit, and
    ids past the tokenizer's own vocabulary are never allowed); eos_token_ids: what ends a request."""

    CACHE_SIZE = 256
    # A compiled matcher costs ~80 bytes per definition character (a 27 kB alternation: 2.2 MiB), so the
    # cache is bounded by the characters it holds too: the soak's clients sending a new big grammar each
    # time grew the server by 260 MiB per 10k requests with a count bound alone.
    CACHE_CHARS = 262_144

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        import llguidance.hf

        if tokenizer is None:
            raise ValueError("constrained output (json_schema / regex / grammar / choice) needs the model's tokenizer, "
                             "and this model directory ships none")
        eos = sorted(eos_token_ids) or None
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:
            raise ValueError(f"constrained output needs a fast (tokenizer.json) tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self._templates: OrderedDict[Constraint, object] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # the template cache: the engine thread and servers' workers
        self._limits = parser_limits()
        self.clock = MaskClock()  # shared by every state made here: the engine's mask time

    def state(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for one request; ValueError when the grammar does not compile for this tokenizer."""
        return GrammarState(self.template(constraint).deep_copy(), self.vocab_size, self.clock)

    def template(self, constraint: Constraint):
        """The compiled template matcher of ``constraint`` (cached; compiled on first use, from any
        thread); ValueError when it does not compile or fails at its first token."""
        from llguidance import LLMatcher

        with self._lock:
            template = self._templates.get(constraint)
            if template is not None:
                self._templates.move_to_end(constraint)
                return template
        # Compiled outside the lock: two threads may compile the same new constraint once each (harmless),
        # but one big compile never holds up another request's cached lookup.
        template = LLMatcher(self.tokenizer, constraint.llguidance_grammar(), log_level=0, limits=self._limits)
        if template.is_error():
            raise ValueError(f"invalid {constraint.kind}: {one_line(template.get_error())}")
        # A grammar can compile and still fail at its first step: "start: start" allows nothing at
        # all, 'start: "a"{99999}' passes llguidance's work limit when it computes forced tokens.
        # Such requests used to fail mid-engine as an internal_error carrying llguidance's whole
        # state dump. Taking that first step once, on a copy, refuses them here like any other
        # invalid grammar (both found by the websocket fuzzer).
        probe = template.deep_copy()
        probe.compute_logit_bias()
        if not probe.is_error():
            probe.compute_ff_tokens()
        if probe.is_error():
            reason = one_line(probe.get_error().split("<state>")[0]) or "no output can match it"
            raise ValueError(f"invalid {constraint.kind}: it fails at its first token ({reason})")
        with self._lock:
            if constraint not in self._templates:
                self._cached_chars += len(constraint.definition)
            self._templates[constraint] = template
            while len(self._templates) > 1 and (len(self._templates) > self.CACHE_SIZE
                                                or self._cached_chars > self.CACHE_CHARS):
                old, _ = self._templates.popitem(last=False)
                self._cached_chars -= len(old.definition)
        return template

    def cached(self, constraint: Constraint) -> bool:
        """Whether ``constraint`` is compiled already (a request with it needs no compile)."""
        with self._lock:
            return constraint in self._templates
