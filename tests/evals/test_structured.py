"""Constrained datasets: constraint fields parsed (bad ones named by line), the built-in structured workload,
the validity checker failing what it must, and `specserve eval` on a constrained dataset (tiny model)."""

from __future__ import annotations

import json

import pytest

from specserve.evals.datasets import load_dataset, parse_spec_bench
from specserve.evals.structured import (
    ARITHMETIC,
    STRUCTURED_CODE,
    check_output,
    constraint_kwargs,
    validate_json_schema,
)
from specserve.grammar.constraint import Constraint

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["kind", "n"], "additionalProperties": False}
CALL = 'start: NAME "(" NUMBER ")"\nNAME: /[a-z]{1,4}/\nNUMBER: /[0-9]{1,2}/\n'


def line(qid, turns=("x = ",), **extra):
    return json.dumps({"question_id": qid, "category": "c", "turns": list(turns), **extra})


# ---- the dataset format ---------------------------------------------------------------------------


def test_constraint_fields_are_parsed():
    recs = parse_spec_bench([
        line(1, json_schema=SCHEMA), line(2, json_schema=json.dumps(SCHEMA), json_whitespace="flexible"),
        line(3, regex=r"[0-9]{1,3}"), line(4, grammar=CALL), line(5, choice=["yes", "no"]), line(6),
        line(7, regex=None),  # null: no constraint
    ])
    kinds = [(r.constraint.kind if r.constraint else None) for r in recs]
    assert kinds == ["json_schema", "json_schema", "regex", "grammar", "choice", None, None]
    assert recs[0].constraint.json_whitespace == "compact" and recs[1].constraint.json_whitespace == "flexible"
    assert constraint_kwargs(recs[0].constraint) == {"json_schema": recs[0].constraint.definition, "json_whitespace": "compact"}
    assert json.loads(constraint_kwargs(recs[0].constraint)["json_schema"]) == SCHEMA
    assert constraint_kwargs(recs[4].constraint) == {"choice": ["yes", "no"]}
    assert constraint_kwargs(recs[2].constraint) == {"regex": "[0-9]{1,3}"} and constraint_kwargs(None) == {}
    from specserve import SamplingParams

    for r in recs:  # every parsed constraint is one SamplingParams takes
        assert SamplingParams(**constraint_kwargs(r.constraint)).constraint == r.constraint


def test_bad_constraints_are_named_by_line(tmp_path):
    lines = [
        line(1, regex="[0-9]+"),
        line(2, regex="[0-9]+", choice=["a"]),          # two constraints
        line(3, regex="([0-9]"),                        # does not compile
        line(4, choice="yes"),                          # not a list
        line(5, json_schema=5),                         # not an object
        line(6, json_whitespace="compact"),             # whitespace without a schema
        line(7, grammar="start: ???"),                  # not Lark
        line(8, json_schema="{not json"),
        line(9, json_schema=SCHEMA, json_whitespace="wide"),
        line(10, choice=["a", ""]),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        load_dataset(str(path))
    msg = str(err.value)
    assert "9 malformed line(s)" in msg
    for n in range(2, 7):
        assert f"line {n} " in msg
    assert "and 4 more" in msg
    assert "at most one of json_schema, regex, grammar, choice per line, got regex, choice" in msg
    assert "invalid regex" in msg and "choice must be a non-empty list" in msg and "json_schema must be an object" in msg
    assert "json_whitespace needs a json_schema" in msg
    warnings = []
    recs = load_dataset(str(path), on_bad_line="skip", warn=warnings.append)
    assert [r.id for r in recs] == ["1"] and "skipped 9 malformed line(s)" in warnings[0]
    for bad, why in [(7, "invalid grammar"), (8, "not valid JSON"), (9, "json_whitespace must be"), (10, "choice must be")]:
        with pytest.raises(ValueError, match=why):
            parse_spec_bench([lines[bad - 1]])


def test_builtin_structured_code():
    recs = load_dataset("builtin:structured-code")
    assert len(recs) == len(STRUCTURED_CODE) and 12 <= len(recs) <= 24
    assert all(r.constraint is not None and not r.chat and len(r.turns) == 1 for r in recs)
    assert {r.constraint.kind for r in recs} == {"json_schema", "regex", "grammar", "choice"}
    first = load_dataset("builtin:structured-code", limit=4)
    assert [r.category for r in first] == ["json", "regex", "grammar", "choice"]  # interleaved kinds
    for r in recs:
        if r.constraint.kind == "json_schema":  # bounded: every object closed, strings and ints limited
            schema = json.loads(r.constraint.definition)
            assert schema["additionalProperties"] is False and validate_json_schema({}, schema)  # required fields


# ---- the validity checker -------------------------------------------------------------------------


def _json(schema=SCHEMA) -> Constraint:
    return Constraint.build("json_schema", schema)


@pytest.mark.parametrize("text, why", [
    ('{"kind": "a", "n": 3}', ""),
    ('{"kind": "c", "n": 3}', "is not one of"),
    ('{"kind": "a", "n": 10}', "maximum"),
    ('{"kind": "a", "n": true}', "is not of type 'integer'"),
    ('{"kind": "a", "n": 1.5}', "is not of type 'integer'"),
    ('{"kind": "a"}', "'n' is a required property"),
    ('{"kind": "a", "n": 1, "x": 0}', "('x' was unexpected)"),
    ('{"kind": "a", "n": 1', "not JSON"),
    (' {"kind": "a", "n": 1}', "whitespace"),
    ('["a", 1]', "is not of type 'object'"),
])
def test_json_checker(text, why):
    got = check_output(_json(), text)
    assert (got == "") if not why else (why in got)


def test_json_checker_keywords():
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4, "pattern": "^[a-z]+$"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        "label": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "v": {"const": 1}}, "additionalProperties": False}
    c = _json(schema)
    assert check_output(c, '{"name": "ab", "tags": ["x"], "label": null, "v": 1}') == ""
    for text, why in [('{"name": "abcde"}', "is too long"), ('{"name": "A"}', "does not match"),
                      ('{"tags": ["x", "y", "x"]}', "$.tags: ['x', 'y', 'x'] is too long"),
                      ('{"tags": ["z"]}', "is not one of"), ('{"label": 3}', "not valid under any"), ('{"v": true}', "1 was expected")]:
        assert why in check_output(c, text), text
    assert "non-unique" in validate_json_schema(["x", "x"], {"uniqueItems": True})[0]  # llguidance lacks uniqueItems
    assert validate_json_schema(2.0, {"type": "integer", "multipleOf": 2}) == []


def test_schemas_with_references_are_checked():
    c = _json({"$defs": {"d": {"type": "integer", "maximum": 5}}, "type": "object",
               "properties": {"a": {"$ref": "#/$defs/d"}}, "required": ["a"], "additionalProperties": False})
    assert check_output(c, '{"a": 3}') == ""
    assert check_output(c, '{"a": 3, "b": 1}') != ""
    assert check_output(c, '{"a": "x"}') != ""


def test_regex_choice_and_grammar_checkers():
    regex = Constraint.build("regex", r"[0-9]{1,2}\.[0-9]{1,2}")
    assert check_output(regex, "1.25") == ""
    assert "does not match" in check_output(regex, "1.256") and "does not match" in check_output(regex, "v1.2")
    rust_only = Constraint.build("regex", r"\p{Lu}[a-z]{0,3}")  # Python's re has no \p{..}: llguidance checks it
    assert check_output(rust_only, "Abc") == "" and check_output(rust_only, "abc") != ""
    choice = Constraint.build("choice", ["yes", "no"])
    assert check_output(choice, "no") == "" and "not one of" in check_output(choice, "nope")
    grammar = Constraint.build("grammar", CALL)
    assert check_output(grammar, "ab(12)") == ""
    assert "rejects" in check_output(grammar, "ab(123)") and "incomplete" in check_output(grammar, "ab(12")
    arithmetic = Constraint.build("grammar", ARITHMETIC)
    assert check_output(arithmetic, "(a + 2) * width\n") == "" and check_output(arithmetic, "a +\n") != ""


def test_every_builtin_constraint_accepts_a_hand_written_output():
    examples = {
        "json-parser-config": '{"name": "p", "port": 80, "debug": false, "mode": "fast"}',
        "regex-version": '1.2.3"', "regex-all": '"os", "path"]', "regex-date": '2024-02-29"',
        "regex-address": '127.0.0.1"', "regex-signature": "parse(self, text, strict=False):",
        "regex-constant": "MAX_SIZE = 1024\n", "grammar-arithmetic": "width * height\n",
        "grammar-call": "open(path, 'r', encoding=enc)\n", "grammar-import": "from os.path import join, exists\n",
        "choice-mode": "'rb'", "choice-bool": "True",
    }
    recs = {r.id: r for r in load_dataset("builtin:structured-code")}
    for rid, text in examples.items():
        assert check_output(recs[rid].constraint, text) == "", rid
    assert check_output(recs["regex-address"].constraint, '256.0.0.1"') != ""


# ---- specserve eval on a constrained dataset ------------------------------------------------------


def test_eval_reports_validity(llama_dir, tmp_path):
    from specserve.evals.suite import EvalConfig, run_eval

    data = tmp_path / "c.jsonl"
    data.write_text("\n".join([line(1, ("def f(x):",), json_schema=SCHEMA), line(2, ("x =",), regex=r" [0-9]{1,3}"),
                               line(3, ("call",), grammar=CALL), line(4, ("ok?",), choice=["yes", "no"]),
                               line(5, ("import os",))]) + "\n")
    res = run_eval(EvalConfig(drafters=["ngram"], dataset=str(data), out=str(tmp_path / "o"), model=str(llama_dir),
                              max_tokens=24, repeats=1, batch_size=2, device="cpu", progress=False, speculation="static"))
    assert res["settings"]["constrained_prompts"] == 4 and res["settings"]["grammar_drafting"] == "forced"
    assert res["plain"]["validity"] == 1.0 and res["drafters"]["ngram"]["validity"] == 1.0 == res["validity"]
    assert res["plain"]["constrained_outputs"] == 4
    assert res["identical_fraction"] == 1.0  # greedy: constrained speculation reproduces constrained plain decoding
    report = (tmp_path / "o" / "report.md").read_text()
    assert "| valid |" in report and "4 prompts are constrained" in report
    with pytest.raises(ValueError, match="peers cannot constrain"):
        run_eval(EvalConfig(drafters=["ngram"], dataset=str(data), out=str(tmp_path / "p"), model=str(llama_dir),
                            peers=["transformers"], device="cpu", progress=False))
