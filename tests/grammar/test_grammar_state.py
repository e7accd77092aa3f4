"""GrammarState against a fresh matcher: any tree's row masks equal the masks after each node's path
computed from scratch, walking a tree leaves the matcher as it was, and random draft trees under
random constraints keep greedy speculative output equal to plain constrained output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import scripted_drafter  # noqa: F401  (registers "scripted")
from specserve import LLM, SamplingParams
from specserve.grammar import Constraint, GrammarCompiler
from specserve.verify import DraftTree


def _constraints(draw) -> dict:
    kind = draw(st.sampled_from(["regex", "choice", "json_schema"]))
    if kind == "regex":
        low = draw(st.integers(0, 3))
        return {"regex": f"[{draw(st.sampled_from(['a-e', '0-9', 'a-z ']))}]{{{low},{low + draw(st.integers(1, 6))}}}"}
    if kind == "choice":
        return {"choice": draw(st.lists(st.sampled_from(["def", "de", "class", "x", "self", "1"]), min_size=1,
                                        max_size=4, unique=True))}
    return {"json_schema": {"type": "object", "properties": {"a": {"type": "integer", "maximum": draw(st.integers(1, 99))}},
                            "required": ["a"], "additionalProperties": False}}


@st.composite
def constraint_and_tree(draw, vocab: int):
    constraint = _constraints(draw)
    n = draw(st.integers(0, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    # Half the tokens from a small pool the constraints like (digits, letters, JSON punctuation), half random.
    pool = st.one_of(st.integers(0, vocab - 1), st.sampled_from(POOL))
    tokens = [draw(pool) for _ in range(n)]
    prefix = draw(st.lists(st.sampled_from(POOL), max_size=3))
    return constraint, DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64)), prefix


POOL: list[int] = []


@pytest.fixture(scope="module")
def compiler(llama_dir):
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    POOL[:] = sorted({t for text in ['{"a": 12}', "abcde 0123", "def class self x"] for t in tok.encode(text)})
    return GrammarCompiler(tok, len(tok), (tok.eos_token_id,))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tree_masks_equal_masks_from_scratch(compiler, data):
    spec, tree, prefix = data.draw(constraint_and_tree(compiler.vocab_size))
    kind, value = next(iter(spec.items()))
    constraint = Constraint.build(kind, value)
    state = compiler.state(constraint)
    legal_prefix = prefix[:state.matcher.validate_tokens(prefix)]
    state.advance(legal_prefix)
    before = state.allowed()
    masks, legal = state.tree_masks(tree)
    assert (state.allowed() == before).all()  # the walk rolled everything back
    assert (masks[0] == before).all()
    for node in range(tree.num_nodes):
        path = [int(tree.tokens[i]) for i in tree.path_to(node)]
        fresh = compiler.state(constraint)
        fresh.advance(legal_prefix)
        consumed = fresh.matcher.try_consume_tokens(path)
        assert legal[node] == (consumed == len(path))
        if legal[node]:
            assert (masks[node + 1] == fresh.allowed()).all()
    kept = state.legal_subtree(tree)
    assert kept.num_nodes == int(legal.sum())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), mode=st.sampled_from(["random", "mixed", "wide_fan", "deep_chain"]),
       with_probs=st.booleans(), drafting=st.sampled_from(["verify", "aware", "forced"]))
def test_random_trees_under_random_constraints_keep_greedy_output(llama_dir, compiler, data, mode, with_probs, drafting):
    spec = _constraints(data.draw)
    params = SamplingParams(max_tokens=24, temperature=0, **spec)
    prompts = ["x = ", "def f(x):"]
    plain = LLM(llama_dir, drafter=None, device="cpu").generate(prompts, params)
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    references = [tok.encode(p) + o.token_ids for p, o in zip(prompts, plain)]
    llm = LLM(llama_dir, drafter="scripted", device="cpu", speculation="static", grammar_drafting=drafting,
              drafter_options=dict(mode=mode, seed=data.draw(st.integers(0, 99)), references=references, max_budget=8,
                                   with_probs=with_probs))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain]
    assert np.all([o.finish_reason in ("stop", "length") for o in outs])
