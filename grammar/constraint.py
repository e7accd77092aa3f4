"""What a request's output may be constrained to, as one value: a JSON schema, a regex, a Lark grammar
or a list of choices (`SamplingParams` holds at most one), turned into an llguidance grammar.

llguidance (Microsoft's guidance engine: a Rust Earley parser with a token-level lexer) is our matcher:
it compiles all four kinds to one grammar format, computes a token mask in microseconds, consumes and
rolls back tokens (what walking a draft tree needs), and reports "fast-forward" tokens a grammar
leaves no choice about. We hand-write none of that.

JSON whitespace: ``compact`` (the default) fixes the separators to ``", "`` and ``": "`` and allows no
other whitespace; ``flexible`` lets any JSON whitespace appear between tokens — with it a small model
can emit newlines forever, so it is an opt-in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["CONSTRAINT_KINDS", "JSON_WHITESPACE", "Constraint"]

CONSTRAINT_KINDS = ("json_schema", "regex", "grammar", "choice")
JSON_WHITESPACE = ("compact", "flexible")

# The longest definition accepted, in characters. Compile time grows with a grammar's size (a Lark
# alternation of 20,000 words, 209 kB, took 0.83 s; 650 kB took 7.3 s on the 2-core CI machine), and
# llguidance's own size limits trip only after most of that work; real schemas are a few kB.
MAX_DEFINITION_CHARS = 65_536

_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FLEXIBLE = {"whitespace_flexible": True}


def one_line(message: str) -> str:
    """llguidance's multi-line errors (message, source excerpt, caret) as one line: the message lines."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    kept = [line for line in lines if not set(line) <= set("^ ") and not line[:1].isdigit()]
    return " ".join(kept or lines)


@dataclass(frozen=True)
class Constraint:
    """kind: one of CONSTRAINT_KINDS; definition: its text (a JSON schema serialised — keys keep their
    order: properties are generated in schema order —, the regex, the Lark source, or the choices as
    a JSON list); compiled grammars are cached by it. json_whitespace: for json_schema only."""

    kind: str
    definition: str
    json_whitespace: str = "compact"

    @staticmethod
    def build(kind: str, value, json_whitespace: str = "compact") -> "Constraint":
        """A validated constraint from what a user gave; ValueError naming the problem."""
        if kind not in CONSTRAINT_KINDS:
            raise ValueError(f"unknown constraint kind {kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}")
        if json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {', '.join(JSON_WHITESPACE)}, got {json_whitespace!r}")
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object (a dict or its JSON text), got {type(value).__name__}")
            definition = json.dumps(value)
        elif kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"choice must be a non-empty list of strings, got {value!r}")
            if not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"choice must hold non-empty strings, got {value!r}")
            definition = json.dumps(list(value))
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
            definition = value
        if len(definition) > MAX_DEFINITION_CHARS:
            raise ValueError(f"invalid {kind}: its definition is {len(definition)} characters, more than the "
                             f"{MAX_DEFINITION_CHARS} this server compiles")
        constraint = Constraint(kind, definition, json_whitespace if kind == "json_schema" else "compact")
        error = constraint.check()
        if error:
            raise ValueError(f"invalid {kind}: {one_line(error)}")
        return constraint

    def llguidance_grammar(self) -> str:
        """The llguidance grammar (its JSON format) this constraint compiles to."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json_schema":
            options = _COMPACT if self.json_whitespace == "compact" else _FLEXIBLE
            return LLMatcher.grammar_from_json_schema(self.definition, overrides=options)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.definition)
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.definition)
        return grammar_from("choice", self.definition)

    def check(self) -> str:
        """'' when llguidance accepts the grammar, else its error message (no tokenizer needed)."""
        from llguidance import LLMatcher

        try:
            grammar = self.llguidance_grammar()
        except ValueError as exc:
            return str(exc)
        return LLMatcher.validate_grammar(grammar).strip()
