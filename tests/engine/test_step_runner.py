"""The step runner (issue 12): mixed steps, chunked prefill, sliding windows with trees, transfers per
step, and the seams — logits processors, forced tokens, the StepRecord the budget policy learns from.

Everything greedy is compared token for token with plain greedy decoding of each prompt alone; trees
come from the scripted drafter (right, wrong, random, deep, wide), which knows that reference.
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scripted_drafter  # noqa: F401  (registers "scripted")
from scripted_drafter import MODES
from specserve import LLM, SamplingParams
from specserve import step_batch as step_batch_module
from specserve.budget import DraftPlan, StaticBudget, StepRecord
from specserve.drafters import TargetInfo, create_drafter
from specserve.engine import Engine, EngineConfig
from specserve.model import LlamaModel
from specserve.verify import accept as accept_module
from tiny_models import build_model

VOCAB = 16
MAX_TOKENS = 24
# Prompt lengths 1..23: with max_prefill_tokens of a few tokens, long ones take many chunks.
PROMPTS = [[11], [3, 1, 4], [7, 7, 7, 2, 9, 1], [2, 7, 1, 8, 2, 8, 1, 8, 2],
           [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2], [1, 4, 1, 4, 2, 1, 3, 5, 6, 2, 3, 7, 3, 0, 9, 5, 0, 4, 8, 8, 1, 6, 8]]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


# ---- helpers ----------------------------------------------------------------------------------------


class RecordingBudget(StaticBudget):
    """A static budget (optionally per request) that keeps every StepRecord it is shown."""

    def __init__(self, budget: int, per_request=None) -> None:
        super().__init__(budget)
        self.per_request = per_request
        self.records: list[StepRecord] = []
        self.asked: list[list[str]] = []

    def plan(self, requests, fixed_rows):
        self.asked.append([r.request_id for r in requests])
        if self.per_request is None:
            return super().plan(requests, fixed_rows)
        return DraftPlan([self.per_request(r.request_id) for r in requests])

    def observe(self, record: StepRecord) -> None:
        self.records.append(record)


def make_engine(model_dir, drafter_options=None, *, executor="kernels", max_prefill_tokens=256, max_forced_tokens=0,
                block_size=4, max_num_seqs=16, policy=None) -> Engine:
    """An engine on `model_dir` (CPU, fp32) with the scripted drafter when options are given."""
    model = LlamaModel.from_pretrained(model_dir, torch.device("cpu"), torch.float32, cpu_kernels=executor == "kernels")
    assert (model.kernels is not None) == (executor == "kernels")
    cfg = model.config
    drafter = None
    if drafter_options is not None:
        target = TargetInfo(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                            device=torch.device("cpu"), dtype=torch.float32, model_dir=str(model_dir), model=model)
        drafter = create_drafter("scripted", target, drafter_options)
    config = EngineConfig(max_model_len=cfg.max_position_embeddings, kv_cache_slots=4096, block_size=block_size,
                          max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
                          max_forced_tokens=max_forced_tokens)
    return Engine(model, None, drafter, config, budget_policy=policy)


def run(engine: Engine, arrivals, max_steps: int = 400, inference_mode: bool = False) -> dict[str, list[int]]:
    """arrivals: (step, request_id, prompt, params[, speculate]); requests join the queue at their step.
    Steps until every request finished (inside torch.inference_mode when asked, as the server's engine
    thread runs them); returns their output tokens."""
    if inference_mode:
        with torch.inference_mode():
            return run(engine, arrivals, max_steps)
    pending = sorted(arrivals, key=lambda a: a[0])
    reqs = {}
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, *speculate = pending.pop(0)
            reqs[rid] = engine.add_request(prompt, params, rid, *speculate)
        if not pending and not engine.has_unfinished():
            break
        engine.step()
    else:
        raise AssertionError("requests did not finish")
    assert all(r.finish_reason == "length" for r in reqs.values())
    return {rid: r.output_ids for rid, r in reqs.items()}


def record_steps(engine: Engine) -> list[tuple[list[tuple[str, int, int, bool]], list[tuple[str, int]]]]:
    """Wrap the runner: per forward, its prefill chunks (id, start, end, completes) and decodes (id, tree size)."""
    seen = []
    original = engine.runner.run

    def run_and_record(step, trees):
        seen.append(([(c.request.request_id, c.start, c.end, c.completes_prompt) for c in step.prefills],
                     [(r.request_id, t.num_nodes) for r, t in zip(step.decodes, trees)]))
        return original(step, trees)

    engine.runner.run = run_and_record
    return seen


@pytest.fixture(scope="module")
def reference(small_vocab_dir):
    """Plain greedy continuation of every prompt, alone (prompt + output)."""
    outs = LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)
    return [p + o.token_ids for p, o in zip(PROMPTS, outs)]


def _expected(reference, i):
    return reference[i][len(PROMPTS[i]):]


# ---- mixed steps and chunked prefill -------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["kernels", "torch"])
def test_mixed_steps_equal_plain_decoding(small_vocab_dir, reference, executor):
    # Prefill chunks of at most 5 tokens; requests arrive while others decode, so steps mix partial and
    # completing chunks with decodes verifying trees of different sizes (and a plainly decoded request).
    policy = RecordingBudget(6)
    engine = make_engine(small_vocab_dir, dict(mode="mixed", seed=5, references=reference, max_budget=6),
                         executor=executor, max_prefill_tokens=5, policy=policy)
    steps = record_steps(engine)
    arrivals = [(0, "p1", PROMPTS[1], GREEDY), (1, "p2", PROMPTS[2], GREEDY), (2, "p5", PROMPTS[5], GREEDY),
                (3, "p0", PROMPTS[0], GREEDY, False), (4, "p4", PROMPTS[4], GREEDY), (6, "p3", PROMPTS[3], GREEDY)]
    outs = run(engine, arrivals)
    for _, rid, *_ in arrivals:
        assert outs[rid] == _expected(reference, int(rid[1:])), rid
    mixed = [(chunks, decodes) for chunks, decodes in steps
             if any(not done for *_, done in chunks) and len({n for _, n in decodes if n}) >= 2]
    assert mixed, "no step mixed a partial prefill chunk with decodes of different tree sizes"
    assert any(len(chunks) >= 2 for chunks, _ in steps), "no step carried two prompts' chunks"
    assert all(sum(end - start for _, start, end, _ in chunks) <= 5 for chunks, _ in steps)
    # The long prompt went through in chunks, in order, each starting where the last ended.
    p5 = [(start, end) for chunks, _ in steps for rid, start, end, _ in chunks if rid == "p5"]
    assert len(p5) >= 5 and p5[0][0] == 0 and p5[-1][1] == len(PROMPTS[5])
    assert all(a[1] == b[0] for a, b in zip(p5, p5[1:]))
    assert all(n == 0 for chunks, decodes in steps for rid, n in decodes if rid == "p0")  # speculate=False
    alloc = engine.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    order=st.permutations(range(len(PROMPTS))),
    arrival=st.lists(st.integers(0, 6), min_size=len(PROMPTS), max_size=len(PROMPTS)),
    speculate=st.lists(st.booleans(), min_size=len(PROMPTS), max_size=len(PROMPTS)),
    count=st.integers(2, len(PROMPTS)),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**31 - 1),
    budget=st.integers(1, 8),
    max_prefill_tokens=st.sampled_from([1, 3, 7, 64]),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_any_mix_of_arrivals_chunks_and_trees_equals_plain(small_vocab_dir, reference, order, arrival, speculate, count,
                                                            mode, seed, budget, max_prefill_tokens, block_size):
    engine = make_engine(small_vocab_dir, dict(mode=mode, seed=seed, references=reference, max_budget=budget),
                         max_prefill_tokens=max_prefill_tokens, block_size=block_size)
    chosen = order[:count]
    outs = run(engine, [(arrival[i], f"p{i}", PROMPTS[i], GREEDY, speculate[i]) for i in chosen])
    for i in chosen:
        assert outs[f"p{i}"] == _expected(reference, i), (i, mode, seed, budget, max_prefill_tokens)
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


# ---- sliding-window targets with trees --------------------------------------------------------------


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory):
    """A Mistral with a 4-token sliding window (head_dim 16: the kernels run it): contexts pass it quickly."""
    return build_model(tmp_path_factory.mktemp("mistral_window"), "mistral", vocab_size=VOCAB, tokenizer=False,
                       init_std=0.3, sliding_window=4)


@pytest.fixture(scope="module")
def window_reference(window_dir):
    out = {}
    for executor in ("kernels", "torch"):
        engine = make_engine(window_dir, executor=executor)
        outs = run(engine, [(0, f"p{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        out[executor] = [p + outs[f"p{i}"] for i, p in enumerate(PROMPTS)]
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 2**31 - 1), budget=st.integers(1, 10),
       max_prefill_tokens=st.sampled_from([2, 5, 256]), batch=st.sampled_from([1, 3, 6]))
def test_sliding_window_target_with_trees_equals_plain(window_dir, window_reference, mode, seed, budget,
                                                       max_prefill_tokens, batch):
    ref = window_reference["kernels"]
    engine = make_engine(window_dir, dict(mode=mode, seed=seed, references=ref, max_budget=budget),
                         max_prefill_tokens=max_prefill_tokens)
    outs = run(engine, [(0, f"p{i}", PROMPTS[i], GREEDY) for i in range(batch)])
    for i in range(batch):
        assert outs[f"p{i}"] == ref[i][len(PROMPTS[i]):], (i, mode, seed, budget)


@pytest.mark.parametrize("mode", ["mixed", "wide_fan", "deep_chain"])
def test_sliding_window_target_with_trees_on_the_torch_path(window_dir, window_reference, mode):
    ref = window_reference["torch"]
    engine = make_engine(window_dir, dict(mode=mode, seed=3, references=ref, max_budget=8), executor="torch",
                         max_prefill_tokens=5)
    outs = run(engine, [(i, f"p{i}", PROMPTS[i], GREEDY) for i in range(len(PROMPTS))])
    for i in range(len(PROMPTS)):
        assert outs[f"p{i}"] == ref[i][len(PROMPTS[i]):], (i, mode)


# ---- host <-> device transfers per step ---------------------------------------------------------------


def accept_on_device_path(count: Counter):
    """`accept_trees`' CPU implementation replaced by its accelerator one (tensor ops, here on CPU tensors),
    counting its calls."""
    on_device = accept_module._accept_on_device

    def accept(*args):
        count["accept_on_device"] += 1
        paths, bonus, bad = on_device(*args)
        assert bad < 0
        return paths, bonus, bad

    return accept


@pytest.mark.parametrize("executor", ["torch", "kernels"])
def test_each_step_moves_one_batch_to_the_device_and_brings_back_one_result(small_vocab_dir, reference, monkeypatch,
                                                                           executor):
    """The two transfer chokepoints, counted per step: `StepBatch.device_arrays` building the device copy
    (host -> device: once per forward; the CPU kernels read the numpy arrays and need none) and the
    acceptance result coming back (device -> host: `accept_on_device`'s one `.cpu()`). A step must not
    do more than one of each, whatever mix of prefill chunks, trees and greedy/sampled requests it has."""
    count: Counter = Counter()
    to_device = step_batch_module._to_device
    cpu = torch.Tensor.cpu

    def counted_to_device(batch, device):
        count["host_to_device"] += 1
        return to_device(batch, device)

    def counted_cpu(self, *args, **kwargs):
        count["device_to_host"] += 1
        return cpu(self, *args, **kwargs)

    monkeypatch.setattr(step_batch_module, "_to_device", counted_to_device)
    monkeypatch.setattr(accept_module, "_accept_on_cpu", accept_on_device_path(count))
    engine = make_engine(small_vocab_dir, dict(mode="mixed", seed=2, references=reference, max_budget=6),
                         executor=executor, max_prefill_tokens=6)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, GREEDY if i % 2 else sampled, f"p{i}")
    per_step = []
    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    while engine.has_unfinished():
        count.clear()
        engine.step()
        per_step.append(dict(count))
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    for step, c in enumerate(per_step):
        assert c.get("host_to_device", 0) == (1 if executor == "torch" else 0), (step, c)
        assert c.get("device_to_host", 0) <= 1 and c.get("accept_on_device", 0) <= 1, (step, c)
    assert sum(c.get("accept_on_device", 0) for c in per_step) > len(per_step) // 2  # the device path did run
    greedy_ids = [i for i in range(len(PROMPTS)) if i % 2]
    for i in greedy_ids:
        assert engine.requests[f"p{i}"].output_ids == _expected(reference, i)


# The engine's chi-square cases (test_lossless_sampling.py, unchanged), with acceptance through the
# accelerator implementation: same trees, same uniforms, tensor ops instead of the compiled kernel.
from engine.test_lossless_sampling import CASES as SAMPLING_CASES  # noqa: E402
from engine.test_lossless_sampling import N as SAMPLING_N  # noqa: E402
from engine.test_lossless_sampling import PROMPT as SAMPLING_PROMPT  # noqa: E402
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target  # noqa: E402


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampled_tokens_follow_target_distribution_with_on_device_acceptance(small_vocab_dir, case, monkeypatch):
    count: Counter = Counter()
    monkeypatch.setattr(accept_module, "_accept_on_cpu", accept_on_device_path(count))
    spec = SAMPLING_CASES[case]
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=seed, ignore_eos=True, **spec["params"])
              for seed in range(SAMPLING_N)]
    reference = LLM(small_vocab_dir, device="cpu").generate([SAMPLING_PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    llm = LLM(small_vocab_dir, drafter="scripted", device="cpu", max_num_seqs=SAMPLING_N, drafter_options={
        "mode": spec["mode"], "seed": 7, "references": [SAMPLING_PROMPT + reference[0].token_ids], "max_budget": 6,
        "with_probs": spec["with_probs"]}, speculation="static")
    outs = llm.generate([SAMPLING_PROMPT] * SAMPLING_N, params)
    assert count["accept_on_device"] >= SAMPLED_MAX_TOKENS - 1
    assert_follows_target(outs, small_vocab_dir, SAMPLING_PROMPT, params[0])
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > SAMPLING_N // 10


# Sync points counted per step on CUDA (torch.cuda.set_sync_debug_mode): each is a host<->device round
# trip. By reading the code a greedy step now has about 4-6 (the sdpa mask check, the draft q upload, the
# acceptance pass and its one result, KV moves); the bound leaves a little room, and fails when a
# change adds a per-request or per-layer sync.
MAX_CUDA_SYNCS_PER_STEP = 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_synchronise_a_bounded_number_of_times(small_vocab_dir):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plain = LLM(small_vocab_dir, device="cuda").generate(PROMPTS[:3], params)
    llm = LLM(small_vocab_dir, device="cuda", drafter="scripted", drafter_options={
        "mode": "mixed", "seed": 1, "references": [p + o.token_ids for p, o in zip(PROMPTS, plain)], "max_budget": 6}, speculation="static")
    engine = llm.engine
    for i in range(3):
        engine.add_request(PROMPTS[i], params, f"p{i}")
    for _ in range(2):  # prefill and a first verify step: one-time allocations and library initialisation
        engine.step()
    per_step = []
    try:
        while engine.has_unfinished():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                engine.step()
                torch.cuda.set_sync_debug_mode("default")
            syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
            per_step.append(syncs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    worst = max(per_step, key=len)
    assert len(worst) <= MAX_CUDA_SYNCS_PER_STEP, f"{len(worst)} syncs in one step: {Counter(worst)}"
    for i in range(3):
        assert engine.requests[f"p{i}"].output_ids == plain[i].token_ids


# ---- seams: logits processors -------------------------------------------------------------------------


def _banned_token(reference) -> int:
    """The token plain greedy decoding emits most often: banning it changes the outputs."""
    return _common_tokens(reference)[0]


class Ban:
    """A logits processor that bans one token, checking it is handed exactly the step's verify rows."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.rows_per_step: list[int] = []

    def __call__(self, logits: torch.Tensor, rows) -> None:
        sizes = [1 + t.num_nodes for t in rows.trees]
        assert len(rows.requests) == len(rows.trees) and np.diff(rows.cu_rows).tolist() == sizes
        assert logits.shape == (rows.cu_rows[-1], VOCAB)
        for row in range(logits.shape[0]):
            b, node = rows.node_of_row(row)
            assert -1 <= node < rows.trees[b].num_nodes
        self.rows_per_step.append(logits.shape[0])
        logits[:, self.token] = float("-inf")


def test_banned_token_never_appears_and_greedy_equals_plain_with_the_same_processor(small_vocab_dir, reference):
    banned = _banned_token(reference)
    prompts = [(i, p) for i, p in enumerate(PROMPTS)]
    plain = make_engine(small_vocab_dir)
    plain.hooks.logits_processors.append(Ban(banned))
    plain_outs = run(plain, [(0, f"p{i}", p, GREEDY) for i, p in prompts], inference_mode=True)
    for i, _ in prompts:
        assert banned not in plain_outs[f"p{i}"]
    assert any(plain_outs[f"p{i}"] != _expected(reference, i) for i, _ in prompts)  # the ban bites

    # Drafts follow the UNconstrained reference, so they propose the banned token again and again.
    policy = RecordingBudget(6)
    spec = make_engine(small_vocab_dir, dict(mode="mixed", seed=9, references=reference, max_budget=6), policy=policy,
                       max_prefill_tokens=7)
    ban = Ban(banned)
    spec.hooks.logits_processors.append(ban)
    proposed = Counter()
    propose = spec.drafter.propose

    def counting_propose(requests, budgets, depth=None):
        trees = propose(requests, budgets, depth)
        proposed.update(int(t) for tree in trees for t in tree.tokens.tolist())
        return trees

    spec.drafter.propose = counting_propose
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, ignore_eos=True) for s in range(12)]
    arrivals = [(i % 3, f"p{i}", p, GREEDY) for i, p in prompts]
    arrivals += [(s % 4, f"s{s}", PROMPTS[s % len(PROMPTS)], sampled[s]) for s in range(12)]  # in the same batches
    outs = run(spec, arrivals, inference_mode=True)
    assert proposed[banned] > 0
    for i, _ in prompts:
        assert outs[f"p{i}"] == plain_outs[f"p{i}"]
    for s in range(12):
        assert banned not in outs[f"s{s}"]
    # Every verify row of every step went through the processor (none skipped, none extra).
    verifying = [sum(1 + r.drafted for r in rec.requests) for rec in policy.records]
    assert [n for n in ban.rows_per_step if n] == [n for n in verifying if n]


def test_banned_token_never_appears_in_sampled_output(small_vocab_dir, reference):
    banned = _banned_token(reference)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in range(150)]
    for options in (dict(mode="random", with_probs=False), dict(mode="wide_fan", with_probs=True)):
        llm = LLM(small_vocab_dir, drafter="scripted", device="cpu", max_num_seqs=150,
                  drafter_options=dict(seed=4, references=reference, max_budget=6, **options), speculation="static")
        free = llm.generate([PROMPTS[2]] * 150, params)
        assert sum(banned in o.token_ids for o in free) > 10  # without the ban it is common
        llm.engine.hooks.logits_processors.append(Ban(banned))
        with torch.inference_mode():
            outs = llm.generate([PROMPTS[2]] * 150, params)
        assert all(banned not in o.token_ids for o in outs), options
        assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0


def test_in_place_processor_works_through_llm_generate(small_vocab_dir, reference):
    banned = _banned_token(reference)
    llm = LLM(small_vocab_dir, drafter="scripted", device="cpu",
              drafter_options=dict(mode="mixed", seed=0, references=reference, max_budget=4), speculation="static")
    llm.engine.hooks.logits_processors.append(Ban(banned))
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(banned not in o.token_ids for o in outs)


# ---- seams: forced tokens -----------------------------------------------------------------------------


def _next_tokens(reference, req, n: int) -> list[int]:
    """The plain greedy tokens right after the request's root (a greedy request follows its reference)."""
    ref = next(r for r in reference if r[:req.num_tokens] == req.token_ids.tolist())
    return ref[req.num_tokens:req.num_tokens + n]


def _common_tokens(reference) -> list[int]:
    """Tokens by how often plain greedy decoding emits them, most often first."""
    return [t for t, _ in Counter(t for i, r in enumerate(reference) for t in r[len(PROMPTS[i]):]).most_common()]


def test_forced_wrong_token_is_rejected_and_output_equals_plain(small_vocab_dir, reference):
    policy = RecordingBudget(0)
    engine = make_engine(small_vocab_dir, max_forced_tokens=3, policy=policy)
    engine.hooks.forced_tokens.append(lambda req: [(_next_tokens(reference, req, 1)[0] + 1) % VOCAB])
    outs = run(engine, [(0, f"p{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    for i in range(len(PROMPTS)):
        assert outs[f"p{i}"] == _expected(reference, i)
    decodes = [r for rec in policy.records for r in rec.requests if r.drafted]
    assert len(decodes) >= len(PROMPTS) * (MAX_TOKENS - 2)
    assert all(r.drafted == 1 and r.budget == 0 and r.accepted == 0 for r in decodes)


def test_forced_right_tokens_are_accepted_outside_the_drafter_budget(small_vocab_dir, reference):
    policy = RecordingBudget(2)
    engine = make_engine(small_vocab_dir, dict(mode="all_wrong", seed=0, references=reference, max_budget=2),
                         max_forced_tokens=4, policy=policy)
    budgets_asked = []
    propose = engine.drafter.propose

    def recording_propose(requests, budgets, depth=None):
        budgets_asked.append({r.request_id: b for r, b in zip(requests, budgets)})
        return propose(requests, budgets, depth)

    engine.drafter.propose = recording_propose
    # Requests p0..p2 get their next 6 right tokens forced (capped to 4 by max_forced_tokens); the others
    # draft (all wrong) within the drafter's budget of 2.
    forced_ids = {"p0", "p1", "p2"}
    engine.hooks.forced_tokens.append(lambda req: _next_tokens(reference, req, 6) if req.request_id in forced_ids else [])
    outs = run(engine, [(0, f"p{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    for i in range(len(PROMPTS)):
        assert outs[f"p{i}"] == _expected(reference, i)
    by_request = {}
    for rec in policy.records:
        for r in rec.requests:
            by_request.setdefault(r.request_id, []).append(r)
    for rid, recs in by_request.items():
        steps = recs[1:]  # the first record is the prefill's (empty tree)
        if rid in forced_ids:
            # 4 forced tokens per step (fewer at the end: max_tokens), beyond the drafter's budget of 2,
            # each accepted: 5 tokens per step.
            assert steps[0].drafted == 4 > engine.drafter.max_budget
            assert all(r.budget == 0 and r.accepted == r.drafted == r.depth for r in steps)
            assert sum(r.accepted + 1 for r in recs) == MAX_TOKENS and len(steps) == 5
        else:
            assert all(r.drafted <= r.budget <= 2 and r.accepted == 0 for r in steps)
    # The drafter was asked nothing for forced requests (budget 0) and its budget for the others.
    for asked in budgets_asked:
        for rid, b in asked.items():
            assert (b == 0) if rid in forced_ids else (b <= 2)


def test_forced_tokens_are_verified_under_sampling(small_vocab_dir, reference):
    # A sampled request forced to a token the processor bans (probability 0) must never emit it;
    # a forced token the target likes is still accepted some of the time.
    banned, liked = _common_tokens(reference)[:2]
    policy = RecordingBudget(0)
    engine = make_engine(small_vocab_dir, max_forced_tokens=2, policy=policy, max_num_seqs=64)
    engine.hooks.logits_processors.append(Ban(banned))
    engine.hooks.forced_tokens.append(lambda req: [banned, banned] if req.request_id.startswith("b") else [liked])
    params = [SamplingParams(max_tokens=10, temperature=0.7, seed=s, ignore_eos=True) for s in range(40)]
    outs = run(engine, [(0, f"b{s}", PROMPTS[1], params[s]) for s in range(20)]
               + [(0, f"r{s}", PROMPTS[1], params[s]) for s in range(20, 40)], inference_mode=True)
    assert all(banned not in outs[f"b{s}"] for s in range(20))
    forced = [r for rec in policy.records for r in rec.requests if r.drafted]
    assert all(r.accepted == 0 for r in forced if r.request_id.startswith("b"))
    assert any(r.accepted > 0 for r in forced if r.request_id.startswith("r"))


# ---- the StepRecord the budget policy receives ----------------------------------------------------


@pytest.mark.parametrize("mode", ["all_right", "mixed"])
def test_budget_policy_gets_one_step_record_per_step(small_vocab_dir, reference, mode):
    wanted = {"p0": 1, "p1": 3, "p2": 5, "p3": 9, "p4": 0, "p5": 2}  # p3 above the drafter's cap of 6
    policy = RecordingBudget(0, per_request=lambda rid: wanted[rid])
    engine = make_engine(small_vocab_dir, dict(mode=mode, seed=1, references=reference, max_budget=6), policy=policy,
                         max_prefill_tokens=8)
    steps = record_steps(engine)
    # The 23-token prompt arrives first, alone: its first two chunks are steps with nothing to verify.
    outs = run(engine, [(0 if i == 5 else 1 + i % 2, f"p{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    for i in range(len(PROMPTS)):
        assert outs[f"p{i}"] == _expected(reference, i)
    records = policy.records
    assert len(records) == len(steps)  # one record per step that ran a forward
    emitted = Counter()
    for rec, (chunks, decodes) in zip(records, steps):
        assert rec.draft_s > 0 and rec.verify_s > 0
        assert rec.num_prefill_tokens == sum(end - start for _, start, end, _ in chunks)
        assert rec.num_tokens == rec.num_prefill_tokens + sum(1 + n for _, n in decodes)
        completing = [rid for rid, _, _, done in chunks if done]
        assert [r.request_id for r in rec.requests] == [rid for rid, _ in decodes] + completing
        for r, (_, n) in zip(rec.requests, decodes):
            req = engine.requests[r.request_id]
            remaining = MAX_TOKENS - (emitted[r.request_id]) - 1
            assert r.budget == min(wanted[r.request_id], 6, remaining)
            assert r.drafted == n <= r.budget and r.depth <= r.drafted and r.accepted <= r.depth
            if mode == "all_right":
                assert r.drafted == r.budget and r.accepted == r.depth == r.drafted
            assert req.request_id == r.request_id
        for r in rec.requests[len(decodes):]:  # prefills finishing their prompt: the empty tree
            assert (r.budget, r.drafted, r.depth, r.accepted) == (0, 0, 0, 0)
        for r in rec.requests:
            emitted[r.request_id] += r.accepted + 1
    assert all(emitted[f"p{i}"] == MAX_TOKENS for i in range(len(PROMPTS)))
    # Steps that only prefilled part of a prompt still report (with no verifying requests).
    assert any(not rec.requests and rec.num_prefill_tokens for rec in records)
