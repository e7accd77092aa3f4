"""Chat prompts for self-distillation, built offline from the corpus (the standard library by default).

There is no hub here, so no ShareGPT: the questions come from code we can read. Every public function
and class of a corpus file that has a docstring gives one prompt, in one of four kinds a chat model
is asked in practice:

- ``write``   — "Write a Python function `name(args)` that <its docstring's first line>."
- ``explain`` — "Explain what `module.name` does, with a short example."
- ``review``  — "What does this code do?" over the function's source (≤ 40 lines)
- ``edit``    — "Add type hints and a docstring to this function" over its source: answers that copy the
  prompt, where prompt lookup drafts well

The kind is a seeded choice per definition; ``every_kind`` asks every kind a definition allows instead (about
3.4 times the prompts: the standard library's train split gives 2,309 definitions, ~7,900 prompts), for data
sets larger than one question per definition allows. Prompts inherit the corpus split: a held-out module's
definitions are held-out prompts, never trained on. (HumanEval, the evaluation set, is not read at all.)
Returned as chat messages; the caller applies the target's chat template.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass

KINDS = ("write", "explain", "review", "edit")
MAX_SOURCE_LINES = 40


@dataclass(frozen=True)
class ChatPrompt:
    kind: str
    module: str
    name: str
    text: str  # the user message

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.text}]


def chat_prompts(corpus, split: str, count: int, seed: int = 0, kinds: tuple[str, ...] = KINDS,
                 every_kind: bool = False) -> list[ChatPrompt]:
    """``count`` prompts from the ``split`` files of ``corpus`` (`training.corpus.Corpus`), a seeded sample
    without repeats (fewer when the split has fewer definitions), in a seeded order; only those of ``kinds``
    (each definition's kind is drawn as always, then filtered: a kind's prompts are the same whatever else
    is asked for). every_kind: each definition gives one prompt of every kind it allows, not one drawn kind
    (the draw still happens, so the seeded order's randomness is the same either way)."""
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"chat prompt kinds are {', '.join(KINDS)}; got {', '.join(sorted(unknown)) or 'none'}")
    rng = random.Random(f"chat-prompts/{seed}/{split}")
    every = []
    for f in corpus.split(split):
        every.extend(_file_prompts(f.path.read_text(encoding="utf-8"), f.rel, f.module, rng, every_kind))
    rng.shuffle(every)
    return [p for p in every if p.kind in kinds][:count]


def _file_prompts(source: str, rel: str, module: str, rng: random.Random, every_kind: bool) -> list[ChatPrompt]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    dotted = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        if not 12 <= len(summary) <= 300:
            continue
        code = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        short = node.end_lineno - node.lineno + 1 <= MAX_SOURCE_LINES
        kinds = [k for k in KINDS if short or k in ("write", "explain")]
        drawn = rng.choice(kinds)  # drawn either way, so the seeded order does not depend on every_kind
        out.extend(ChatPrompt(kind, module, node.name, _question(kind, node, dotted, summary, code))
                   for kind in (kinds if every_kind else [drawn]))
    return out


def _question(kind: str, node, dotted: str, summary: str, code: str) -> str:
    """The user message of one kind of question about a definition (``node``, its source ``code``, its
    docstring's first paragraph ``summary``, its module's dotted name)."""
    if kind == "write":
        what = "class" if isinstance(node, ast.ClassDef) else "function"
        signature = node.name if isinstance(node, ast.ClassDef) else f"{node.name}({ast.unparse(node.args)})"
        return f"Write a Python {what} `{signature}`. {summary[0].upper()}{summary[1:]}"
    if kind == "explain":
        return f"Explain what `{dotted}.{node.name}` does in Python, with a short example."
    if kind == "review":
        return f"What does this Python code do?\n\n```python\n{_undocumented(code, node)}\n```"
    return f"Add type hints and a one-line docstring to this function:\n\n```python\n{_undocumented(code, node)}\n```"


def _undocumented(code: str, node) -> str:
    """The definition's source without its docstring (the answer should not be a copy of it)."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        first, last = body[0].lineno - node.lineno, body[0].end_lineno - node.lineno
        lines = code.splitlines()
        if len(body) > 1:
            rest = lines[last + 1 :]
            while rest and not rest[0].strip():
                rest = rest[1:]
            return "\n".join(lines[:first] + rest)
    return code
