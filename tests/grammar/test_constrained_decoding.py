"""Constrained decoding is lossless: greedy constrained speculative output equals greedy constrained
plain output token for token (every drafter, every grammar-drafting mode, mixed batches), sampled
constrained output follows the masked target distribution (chi-square), and outputs satisfy their
constraint."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest
import torch
from sampling_oracle import target_probs
from target_stats import chi_square_p_value
from transformers import AutoModelForCausalLM, AutoTokenizer

import specserve.drafters.eagle  # noqa: F401  (registers "eagle")
import specserve.drafters.medusa  # noqa: F401  (registers "medusa")
from specserve import LLM, SamplingParams
from specserve.drafters.eagle_checkpoint import save_head
from specserve.drafters.medusa_heads import MedusaHeads, save_heads
from specserve.grammar import Constraint, GrammarCompiler
from specserve.grammar.hooks import ConstraintRule

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"},
                                           "tag": {"type": "string", "enum": ["def", "class", "self"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}
CONSTRAINTS = {
    "json": dict(json_schema=SCHEMA),
    "regex": dict(regex=r"[a-e]{2,5}( [0-9]{1,3})?"),
    "lark": dict(grammar='start: call\ncall: NAME "(" args ")"\nargs: NUM ("," NUM)*\nNAME: /[a-z]{1,6}/\nNUM: /[0-9]{1,2}/'),
    "choice": dict(choice=["self", "return x", "def f"]),
}
PROMPTS = ["def f(x):\n    return x + 1\n", "class Point:", "x = "]


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return set(value) == {"id", "ok", "tag"} and 0 <= value["id"] <= 999 and value["tag"] in ("def", "class", "self")
    if kind == "regex":
        return re.fullmatch(CONSTRAINTS["regex"]["regex"], text) is not None
    if kind == "lark":
        return re.fullmatch(r"[a-z]{1,6}\([0-9]{1,2}(,[0-9]{1,2})*\)", text) is not None
    return text in CONSTRAINTS["choice"]["choice"]


@pytest.fixture(scope="module")
def drafters(llama_dir, tmp_path_factory):
    """Drafter specs for the tokenizer-bearing tiny target: the target itself as a draft model (drafts
    almost always right), random EAGLE-3 and EAGLE-1 heads and random Medusa heads (mostly wrong)."""
    from tests.drafters.test_eagle import random_head

    out = {"ngram": ("ngram", None), "draft": (f"draft:{llama_dir}", {"depth": 3, "topk": 2})}
    for mode in ("eagle1", "eagle3"):
        head = save_head(random_head(llama_dir, mode, seed=3, std=0.1), tmp_path_factory.mktemp(mode), torch.float32)
        out[mode] = (f"eagle:{head}", {"depth": 3, "topk": 2})
    heads = MedusaHeads(64, 300, 3, 1, "own")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.4).half().float())
    medusa = tmp_path_factory.mktemp("medusa")
    save_heads(heads, medusa, llama_dir)
    out["medusa"] = (f"medusa:{medusa}", {"tree": "dynamic", "topk": 2, "depth": 2})
    out["medusa-static"] = (f"medusa:{medusa}", None)
    # The same heads over a draft vocabulary of 200 of the 300 tokens: grammar masks map through it.
    ids = torch.randperm(300, generator=gen)[:200].sort().values
    vocab_heads = MedusaHeads(64, 300, 3, 1, "own", 200)
    with torch.no_grad():
        vocab_heads.weight.copy_(heads.weight)
        vocab_heads.bias.copy_(heads.bias)
        vocab_heads.lm_heads.copy_(heads.lm_heads[:, ids])
    vocab_heads.set_draft_vocab(ids)
    medusa_vocab = tmp_path_factory.mktemp("medusa_vocab")
    save_heads(vocab_heads, medusa_vocab, llama_dir)
    out["medusa-vocab"] = (f"medusa:{medusa_vocab}", None)
    out["medusa-vocab-dynamic"] = (f"medusa:{medusa_vocab}", {"tree": "dynamic", "topk": 2, "depth": 2})
    # Heads that read the root's and each node's parent's token: every row's mask and logits are its own.
    parent_heads = MedusaHeads(64, 300, 3, 1, "own", root_token=True, parent_token=True)
    with torch.no_grad():
        for p in parent_heads.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.4).half().float())
    medusa_parent = tmp_path_factory.mktemp("medusa_parent")
    save_heads(parent_heads, medusa_parent, llama_dir, extra={"choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]})
    out["medusa-parent"] = (f"medusa:{medusa_parent}", None)
    return out


@pytest.fixture(scope="module")
def plain_reference(llama_dir):
    llm = LLM(llama_dir, drafter=None, device="cpu")
    return {kind: [(o.token_ids, o.finish_reason) for o in
                   llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0, **spec))]
            for kind, spec in CONSTRAINTS.items()}


@pytest.mark.parametrize("drafter", ["ngram", "draft", "eagle1", "eagle3", "medusa", "medusa-static", "medusa-vocab",
                                     "medusa-vocab-dynamic", "medusa-parent"])
@pytest.mark.parametrize("mode", ["verify", "aware", "forced"])
def test_greedy_constrained_speculation_equals_plain(llama_dir, drafters, plain_reference, drafter, mode):
    spec, options = drafters[drafter]
    llm = LLM(llama_dir, drafter=spec, drafter_options=options, device="cpu", speculation="static", grammar_drafting=mode)
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    free_ref = LLM(llama_dir, drafter=None, device="cpu").generate(PROMPTS[:1], free)[0].token_ids
    for kind, constraint in CONSTRAINTS.items():
        params = [SamplingParams(max_tokens=48, temperature=0, **constraint)] * len(PROMPTS)
        outs = llm.generate(PROMPTS + PROMPTS[:1], params + [free])  # one unconstrained request in the batch
        assert [(o.token_ids, o.finish_reason) for o in outs[:-1]] == plain_reference[kind], (kind, drafter, mode)
        assert outs[-1].token_ids == free_ref
        for o in outs[:-1]:
            assert o.finish_reason == "stop" and _valid(kind, o.text), (kind, o.text)


@pytest.mark.parametrize("drafter", ["draft", "medusa-static"])
def test_grammar_aware_drafting_beats_masks_in_verification_only(llama_dir, drafters, drafter):
    """Drafts that respect the grammar are accepted more often (the draft model equal to the target
    drafts right whenever it drafts a legal token; random Medusa heads at least draft legal ones):
    τ under "aware" beats "verify", and forced tokens cut steps further."""
    spec, options = drafters[drafter]
    steps, accepted = {}, {}
    for mode in ("verify", "aware", "forced"):
        llm = LLM(llama_dir, drafter=spec, drafter_options=options, device="cpu", speculation="static", grammar_drafting=mode)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0, **CONSTRAINTS["json"]))
        steps[mode] = sum(o.spec.num_steps for o in outs)
        accepted[mode] = sum(sum(o.spec.accepted_per_position) for o in outs)
    assert accepted["aware"] > accepted["verify"]
    assert steps["forced"] <= steps["aware"] < steps["verify"]



def grammar_of(req):
    """A constrained request's matcher state (its ConstraintRule's)."""
    return next(rule.state for rule in req.rules if isinstance(rule, ConstraintRule))

def test_matcher_state_after_steps_equals_one_fed_the_output(llama_dir, drafters):
    spec, options = drafters["draft"]
    llm = LLM(llama_dir, drafter=spec, drafter_options=options, device="cpu", speculation="static")
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, **CONSTRAINTS["lark"])
    req = engine.add_request(llm.encode(PROMPTS[0]), params, "r")
    compiler = GrammarCompiler(llm.tokenizer, llm.model.config.vocab_size, engine.eos_token_ids)
    while engine.has_unfinished():
        engine.step()
        fresh = compiler.state(params.constraint)
        fresh.advance(req.output_ids)
        assert (fresh.allowed() == grammar_of(req).allowed()).all()
        assert fresh.accepting == grammar_of(req).accepting and fresh.stopped == grammar_of(req).stopped


def test_invalid_constraints_are_clear_errors_and_leave_other_requests_alone(llama_dir):
    for bad, message in [(dict(regex="a(b"), "invalid regex"), (dict(json_schema="{"), "not valid JSON"),
                         (dict(json_schema={"type": "nope"}), "invalid json_schema"),
                         (dict(grammar="start: missing_rule"), "invalid grammar"), (dict(choice=[]), "choice"),
                         (dict(regex="a", choice=["b"]), "at most one"),
                         (dict(json_schema={}, json_whitespace="loose"), "json_whitespace")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(**bad)
    llm = LLM(llama_dir, drafter="ngram", device="cpu")
    engine = llm.engine
    engine.add_request(llm.encode("x = "), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "ok")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        GrammarCompiler(None, 300, ())
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_finished("ok").output_ids) == 8


def test_max_tokens_inside_the_structure_finishes_with_length(llama_dir):
    out = LLM(llama_dir, drafter="ngram", device="cpu").generate(
        ["x = "], SamplingParams(max_tokens=3, temperature=0, json_schema=SCHEMA))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith('{"i')


def test_compact_and_flexible_json_whitespace(llama_dir):
    llm = LLM(llama_dir, drafter=None, device="cpu")
    compiler = GrammarCompiler(llm.tokenizer, llm.model.config.vocab_size, llm.engine.eos_token_ids)
    tok = llm.tokenizer
    compact = compiler.state(Constraint.build("json_schema", SCHEMA))
    flexible = compiler.state(Constraint.build("json_schema", SCHEMA, "flexible"))
    compact.advance(tok.encode('{"id":'))
    flexible.advance(tok.encode('{"id":'))
    newline = tok.encode("\n")[0]
    assert not compact.allowed()[newline] and flexible.allowed()[newline]
    assert compact.allowed()[tok.encode(" ")[0]]  # ": " is the compact key separator


# ---- sampling: the masked target distribution ------------------------------------------------------

N = 1500
SAMPLED_REGEX = "[a-e]{6,10}"  # tokens a..e and "de" in the tiny tokenizer: at least 3 tokens, few choices


def _masked_marginals(model_dir, prompt: list[int], params: SamplingParams):
    """Exact P(2nd token) and P(3rd token) under mask-then-temperature (then top-k/top-p/min-p), enumerating
    allowed prefixes."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = hf.config.vocab_size
    compiler = GrammarCompiler(tok, vocab, ())

    def dist(prefix: list[int]) -> torch.Tensor:
        state = compiler.state(params.constraint)
        state.advance(prefix)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + prefix])).logits[:, -1]
        # The independent oracle (tests/sampling_oracle.py), not logits_to_probs (the code under test).
        return torch.from_numpy(target_probs(logits[0], params.temperature, params.top_k, params.top_p, params.min_p,
                                             allowed=state.allowed()))

    p1 = dist([])
    second, third = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = dist([a])
        second += p1[a] * p2
        for b in torch.nonzero(p2).flatten().tolist():
            third += p1[a] * p2[b] * dist([a, b])
    return second, third


@pytest.mark.slow
@pytest.mark.parametrize("drafter,mode", [("draft", "aware"), ("eagle3", "forced"), ("ngram", "aware"), ("draft", "verify"),
                                          ("medusa-static", "aware"), ("medusa", "forced"), ("medusa-vocab", "aware"),
                                          ("medusa-parent", "aware")])
def test_sampled_constrained_output_follows_the_masked_target(llama_dir, drafters, drafter, mode):
    spec, options = drafters[drafter]
    llm = LLM(llama_dir, drafter=spec, drafter_options=options, device="cpu", speculation="static",
              grammar_drafting=mode, max_num_seqs=N)
    prompt = llm.encode("def abc(")
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, regex=SAMPLED_REGEX) for s in range(N)]
    outs = llm.generate([prompt] * N, params)
    assert all(re.fullmatch(SAMPLED_REGEX, o.text) for o in outs)
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > N // 10  # drafts were used
    for position, exact in zip((1, 2), _masked_marginals(llama_dir, prompt, params[0])):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=exact.numel()).double()
        assert float(counts[exact == 0].sum()) == 0, f"token {position + 1}: a token the masked target rules out"
        p_value = chi_square_p_value(counts, exact)
        assert p_value > 1e-3, f"token {position + 1}: chi-square p-value {p_value:.2e}"


def test_a_failed_matcher_ends_only_its_request(llama_dir):
    """llguidance leaves a matcher in an error state when it gives up (its work limits on a pathological
    grammar); that request ends with "error" and none of the unvouched tokens, the batch goes on."""
    llm = LLM(llama_dir, drafter="ngram", device="cpu", speculation="static")
    engine = llm.engine
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = LLM(llama_dir, drafter=None, device="cpu").generate(["x = "], free)[0].token_ids
    engine.add_request(llm.encode("x = "), free, "free")
    broken = engine.add_request(llm.encode("x = "), SamplingParams(max_tokens=12, temperature=0, **CONSTRAINTS["regex"]), "g")
    engine.step()  # prefill: the constrained request's first token
    assert grammar_of(broken).accepting is False and not grammar_of(broken).failed
    forbidden = int(np.flatnonzero(~grammar_of(broken).allowed())[0])
    grammar_of(broken).matcher.consume_token(forbidden)  # the way llguidance fails: an error state
    assert grammar_of(broken).failed
    emitted = list(broken.output_ids)
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_finished("g").finish_reason == "error" and broken.output_ids == emitted
    assert "output constraint failed" in broken.error
    out = engine.pop_finished("free")
    assert out.output_ids == reference and out.finish_reason == "length"
    alloc = engine.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


def test_oversized_constraints_are_refused_and_compiles_happen_off_the_engine_thread(llama_dir):
    """Issue 19: a constraint's compile cost is bounded (definitions past MAX_DEFINITION_CHARS are refused
    before llguidance sees them; its errors carry no parser state), and a server compiles on a worker
    thread (`LLM.constraints.compile`) so the engine thread finds the grammar cached."""
    import threading

    from specserve.grammar.constraint import MAX_DEFINITION_CHARS

    words = " | ".join(f'"w{i}"' for i in range(MAX_DEFINITION_CHARS // 8))
    with pytest.raises(ValueError, match=f"more than the {MAX_DEFINITION_CHARS}"):
        SamplingParams(grammar="start: " + words)
    llm = LLM(llama_dir, drafter=None, device="cpu")
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0, **CONSTRAINTS["lark"])
    worker = threading.Thread(target=llm.constraints.compile, args=(params.constraint,))
    worker.start()
    worker.join()
    compiler = llm.constraints.compiler
    assert params.constraint in compiler._templates
    template = compiler._templates[params.constraint]
    engine.add_request(llm.encode("x = "), params, "c")
    assert compiler._templates[params.constraint] is template  # add_request reused it: no second compile
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_finished("c").finish_reason in ("stop", "length")
    # A matcher that gives up part-way (llguidance's per-step work limit): its error holds no parser state.
    engine.add_request(llm.encode("x = "), SamplingParams(max_tokens=4, grammar='start: "a"{99999}'), "g")
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_finished("g")
    assert out.finish_reason == "error" and "<state>" not in out.error and len(out.error) < 400, out.error


def test_the_template_cache_is_bounded_by_the_characters_it_holds(llama_dir, monkeypatch):
    """A compiled matcher costs ~80 bytes per definition character: the cache keeps its total under
    CACHE_CHARS (oldest out first), whatever the count."""
    llm = LLM(llama_dir, drafter=None, device="cpu")
    compiler = llm.constraints.compiler
    monkeypatch.setattr(compiler, "CACHE_CHARS", 3000)
    words = [" | ".join(f'"{tag}{i}"' for i in range(150)) for tag in "abc"]  # ~1,200 characters each
    constraints = [SamplingParams(grammar="start: " + w).constraint for w in words]
    for c in constraints:
        llm.constraints.compile(c)
    assert [llm.constraints.compiled(c) for c in constraints] == [False, True, True]
    assert compiler._cached_chars == sum(len(c.definition) for c in constraints[1:]) <= 3000
