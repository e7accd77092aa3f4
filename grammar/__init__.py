"""Structured output: constraints (JSON schema, regex, Lark grammar, choice) over llguidance matchers,
shaping verification (masks), drafting (drafters mask their own distributions) and forced tokens;
`hooks.py` applies them to the step as a `specserve.step_hooks.RequestRule`.

Exports load on first use (`specserve.lazy`): `specserve.grammar.constraint` — what the CLI and datasets
validate — then imports neither torch nor llguidance."""

from specserve.lazy import lazy_exports as _lazy_exports

__all__ = ["CONSTRAINT_KINDS", "JSON_WHITESPACE", "Constraint", "GrammarCompiler", "GrammarState"]

_LAZY = {"CONSTRAINT_KINDS": "specserve.grammar.constraint", "JSON_WHITESPACE": "specserve.grammar.constraint",
         "Constraint": "specserve.grammar.constraint", "GrammarCompiler": "specserve.grammar.compiler",
         "GrammarState": "specserve.grammar.state"}

__getattr__, __dir__ = _lazy_exports(__name__, _LAZY, globals())
