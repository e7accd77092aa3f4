"""Structured output: constraints (JSON schema, regex, Lark grammar, choice) over llguidance matchers,
shaping verification (masks), drafting (drafters mask their own distributions) and forced tokens."""

from specserve.grammar.compiler import GrammarCompiler
from specserve.grammar.constraint import CONSTRAINT_KINDS, JSON_WHITESPACE, Constraint
from specserve.grammar.state import GrammarState

__all__ = ["CONSTRAINT_KINDS", "JSON_WHITESPACE", "Constraint", "GrammarCompiler", "GrammarState"]
