"""Structured output in the evaluations: the built-in constrained workload, and checking outputs.

Built-in ``builtin:structured-code``: completion prompts for the embedded code model, each with a
constraint — JSON objects described by a code comment (bounded schemas: enums, maxLength, maximum,
maxItems, additionalProperties false), regex-shaped lines (a version string, an identifier list, a date,
an address, a signature), Lark grammars (an arithmetic expression, a call, an import line) and choices.
Every constraint is bounded, so a complete output takes well under 96 tokens of this model.

Validity is checked independently of the engine that produced the output, from the output's *text*:

- json_schema: ``json.loads``, then the ``jsonschema`` package (``validate_json_schema``).
- regex: Python's ``re.fullmatch`` (a regex Python cannot compile, Rust-only syntax, falls back to
  llguidance).
- grammar (Lark): llguidance over the text's UTF-8 bytes with a byte-level tokenizer — a fresh matcher
  (not the engine's, nor its tokenizer), the text consumed byte by byte, then ``is_accepting``.
- choice: the text is one of the choices.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from specserve.grammar.constraint import Constraint

__all__ = ["STRUCTURED_CODE", "check_output", "constraint_kwargs", "structured_code_records", "validate_json_schema"]


# ---- the built-in workload ------------------------------------------------------------------------

_IDENT = r"[a-z_][a-z0-9_]{0,15}"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"

# Lark grammars (llguidance's dialect): bounded repetition (~n..m), no unbounded recursion.
ARITHMETIC = r"""
start: expr "\n"
expr: term (OP term)~0..3
term: atom | "(" atom (OP atom)~1..2 ")"
atom: NAME | NUMBER
OP: " + " | " - " | " * " | " / " | " // " | " % "
NAME: /[a-z_][a-z0-9_]{0,11}/
NUMBER: /[0-9]{1,4}/
"""

CALL = r"""
start: call "\n"
call: NAME "(" [args] ")"
args: arg (", " arg)~0..3
arg: NAME | NUMBER | STRING | NAME "=" (NAME | NUMBER | STRING) | NAME "(" [NAME (", " NAME)~0..2] ")"
NAME: /[a-z_][a-z0-9_]{0,11}/
NUMBER: /-?[0-9]{1,4}/
STRING: /'[a-z0-9_ .]{0,12}'/
"""

IMPORT = r"""
start: (plain | from_) "\n"
plain: "import " module (", " module)~0..2
from_: "from " module " import " NAME (", " NAME)~0..3
module: NAME ("." NAME)~0..2
NAME: /[a-zA-Z_][a-zA-Z0-9_]{0,15}/
"""


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


def _str(max_length: int, **extra) -> dict:
    return {"type": "string", "maxLength": max_length} | extra


def _int(minimum: int, maximum: int) -> dict:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


# (id, category, prompt, constraint kind, constraint value)
STRUCTURED_CODE: list[tuple[str, str, str, str, Any]] = [
    ("json-parser-config", "json", "# config for the parser as JSON\nconfig = ", "json_schema", _obj({
        "name": _str(16), "port": _int(1, 65535), "debug": {"type": "boolean"},
        "mode": {"enum": ["fast", "safe", "strict"]}})),
    ("json-http-headers", "json", "# HTTP response headers as a JSON object\nheaders = ", "json_schema", _obj({
        "content_type": {"enum": ["text/html", "text/plain", "application/json"]},
        "content_length": _int(0, 100000), "charset": {"enum": ["utf-8", "ascii", "latin-1"]},
        "keep_alive": {"type": "boolean"}})),
    ("json-user", "json", "# a user record (JSON)\nuser = ", "json_schema", _obj({
        "id": _int(1, 9999), "name": _str(20), "email": _str(24),
        "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "active": {"type": "boolean"}})),
    ("json-test-case", "json", "# test case: function name, arguments and the expected result, as JSON\ncase = ",
     "json_schema", _obj({
         "func": _str(16, pattern=r"^[a-z_][a-z0-9_]*$"),
         "args": {"type": "array", "items": _int(-100, 100), "maxItems": 4},
         "expected": _int(-1000, 1000)})),
    ("json-logging", "json", "# logging configuration (JSON)\nLOGGING = ", "json_schema", _obj({
        "version": {"const": 1}, "level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR"]},
        "format": _str(24), "handlers": {"type": "array", "items": {"enum": ["console", "file", "syslog"]},
                                         "minItems": 1, "maxItems": 2}})),
    ("json-package", "json", "# package metadata as JSON\nmetadata = ", "json_schema", _obj({
        "name": _str(16, pattern=r"^[a-z][a-z0-9_-]*$"),
        "version": {"type": "string", "pattern": r"^[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}$"},
        "license": {"enum": ["MIT", "BSD", "Apache-2.0", "PSF"]},
        "zip_safe": {"type": "boolean"}})),
    ("json-point", "json", "# a rectangle as JSON: corner and size\nrect = ", "json_schema", _obj({
        "x": _int(-500, 500), "y": _int(-500, 500), "width": _int(0, 1000), "height": _int(0, 1000),
        "label": {"anyOf": [_str(12), {"type": "null"}]}})),
    ("json-database", "json", "# database connection settings as JSON\nDATABASE = ", "json_schema", _obj({
        "engine": {"enum": ["sqlite", "postgresql", "mysql"]}, "host": _str(24), "port": _int(1, 65535),
        "user": _str(12), "name": _str(16), "pool_size": _int(1, 64), "timeout": _int(0, 3600),
        "ssl": {"type": "boolean"}})),
    ("regex-version", "regex", "# the package version\n__version__ = \"", "regex", r'[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}"'),
    ("regex-all", "regex", "import os\nimport sys\n\n__all__ = [", "regex", rf'"{_IDENT}"(, "{_IDENT}"){{0,5}}\]'),
    ("regex-date", "regex", "# when this module was last released\nRELEASE_DATE = \"", "regex",
     r'(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"'),
    ("regex-address", "regex", "# the address the server listens on\nHOST = \"", "regex", rf'{_OCTET}(\.{_OCTET}){{3}}"'),
    ("regex-signature", "regex", "class Parser:\n\n    def ", "regex",
     rf"{_IDENT}\(self(, {_IDENT}(=(None|True|False|[0-9]{{1,3}}))?){{0,3}}\):"),
    ("regex-constant", "regex", "# limits\n", "regex", r"[A-Z][A-Z0-9_]{0,19} = [0-9]{1,6}\n"),
    ("grammar-arithmetic", "grammar", "def area(width, height):\n    return ", "grammar", ARITHMETIC),
    ("grammar-call", "grammar", "import os\n\nresult = ", "grammar", CALL),
    ("grammar-import", "grammar", "\"\"\"Utilities for reading files.\"\"\"\n\n", "grammar", IMPORT),
    ("choice-mode", "choice", "def open_file(path, mode=", "choice", ["'r'", "'w'", "'a'", "'rb'", "'wb'"]),
    ("choice-bool", "choice", "def is_empty(self):\n    return ", "choice", ["True", "False", "None"]),
]


def structured_code_records(limit: int | None = None) -> list:
    """The built-in workload as dataset records (completion prompts, one turn each), at most `limit`.

    Interleaved across categories (json, regex, grammar, choice, json, regex, ...), so the first
    `limit` cover every kind of constraint rather than the JSON prompts only."""
    from specserve.evals.datasets import Record

    by_category: dict[str, list] = {}
    for row in STRUCTURED_CODE:
        by_category.setdefault(row[1], []).append(row)
    rows = [rows[rank] for rank in range(max(map(len, by_category.values())))
            for rows in by_category.values() if rank < len(rows)]
    rows = rows if limit is None else rows[:limit]
    return [Record(rid, category, (prompt,), chat=False, constraint=Constraint.build(kind, value))
            for rid, category, prompt, kind, value in rows]


def constraint_kwargs(constraint: Constraint | None) -> dict:
    """`SamplingParams` keyword arguments for `constraint` (nothing for None)."""
    if constraint is None:
        return {}
    value = json.loads(constraint.definition) if constraint.kind == "choice" else constraint.definition
    kwargs = {constraint.kind: value}
    if constraint.kind == "json_schema":
        kwargs["json_whitespace"] = constraint.json_whitespace
    return kwargs


# ---- checking outputs ----------------------------------------------------------------------------


def check_output(constraint: Constraint, text: str) -> str:
    """'' when `text` satisfies `constraint` (whole), else why not (one line)."""
    if constraint.kind == "json_schema":
        try:
            instance = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc.msg} at {exc.pos}"
        if constraint.json_whitespace == "compact" and text != text.strip():
            return "whitespace around the JSON value"
        return "; ".join(validate_json_schema(instance, json.loads(constraint.definition))[:3])
    if constraint.kind == "regex":
        try:
            pattern = re.compile(constraint.definition)
        except re.error:
            return _llguidance_check(constraint, text)
        return "" if pattern.fullmatch(text) else f"does not match the regex: {text[:60]!r}"
    if constraint.kind == "choice":
        choices = json.loads(constraint.definition)
        return "" if text in choices else f"not one of the {len(choices)} choices: {text[:60]!r}"
    return _llguidance_check(constraint, text)


class _ByteTokenizer:
    """One token per byte, and an EOS: what llguidance needs to match text independently of any model."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s) -> list[int]:
        return list(s.encode("utf-8") if isinstance(s, str) else s)


@lru_cache(maxsize=1)
def _byte_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_ByteTokenizer()))


@lru_cache(maxsize=64)
def _template(constraint: Constraint):
    from llguidance import LLMatcher

    matcher = LLMatcher(_byte_tokenizer(), constraint.llguidance_grammar(), log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid {constraint.kind}: {matcher.get_error().splitlines()[0]}")
    return matcher


def _llguidance_check(constraint: Constraint, text: str) -> str:
    matcher = _template(constraint).deep_copy()
    data = text.encode("utf-8")
    if not matcher.consume_tokens(list(data)):
        err = matcher.get_error().splitlines()[0] if matcher.get_error() else ""
        return f"the {constraint.kind} rejects the text: {err}"[:300]
    return "" if matcher.is_accepting() else f"the {constraint.kind} is incomplete: {text[-40:]!r}"


# ---- JSON Schema ---------------------------------------------------------------------------------


def validate_json_schema(instance, schema) -> list[str]:
    """Errors of `instance` against `schema` (empty: valid), by the `jsonschema` package (the schema's
    declared draft, else 2020-12), one line each with the path: "$.tags[2]: 'z' is not one of ['x']"."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(instance)]
