"""The sampling oracle (tests/sampling_oracle.py) that every chi-square suite takes its exact target
distribution from, checked three ways:

- by hand, on distributions small enough to work out (filter order included);
- against transformers' logits warpers (Temperature, TopK, TopP, MinP, composed in generate()'s order,
  which is specserve's), where the two conventions agree;
- and used as the reference for `specserve.sampling.logits_to_probs` (the code under test) on random
  logits and parameters, batched with a different setting per row.

Then the suites' own machinery (`exact_marginals`, `chi_square_p_value`, `assert_follows_target`) is shown
to reject deliberately off-by-one top-k and top-p filters, so a passing suite means something.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_oracle import target_probs, target_probs_rows
from target_stats import assert_follows_target, chi_square_p_value, exact_marginals
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specserve import SamplingParams
from specserve.sampling import logits_to_probs

P = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(P)


def _approx(a, b, tol=1e-12):
    return np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=0, atol=tol)


# ---- by hand -----------------------------------------------------------------------------------------

def test_oracle_by_hand():
    assert _approx(target_probs(LOGITS, 1.0), P)
    assert _approx(target_probs(LOGITS, 2.0), np.sqrt(P) / np.sqrt(P).sum())  # softmax(log p / 2) ∝ √p
    assert _approx(target_probs(LOGITS, 0.0), [1, 0, 0, 0])  # greedy
    assert _approx(target_probs(LOGITS + 1000, 1e-6), [1, 0, 0, 0])  # tiny T, large logits: no overflow
    # top-k keeps the k largest and renormalises.
    assert _approx(target_probs(LOGITS, 1.0, top_k=2), [0.625, 0.375, 0, 0])
    assert _approx(target_probs(LOGITS, 1.0, top_k=4), P) and _approx(target_probs(LOGITS, 1.0, top_k=99), P)
    # top-p: the smallest most-likely set with mass >= p (0.5 < 0.7 <= 0.8; 0.8 < 0.85 <= 0.95).
    assert _approx(target_probs(LOGITS, 1.0, top_p=0.7), [0.625, 0.375, 0, 0])
    assert _approx(target_probs(LOGITS, 1.0, top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert _approx(target_probs(LOGITS, 1.0, top_p=0.01), [1, 0, 0, 0])  # the top token always survives
    # min-p: drop p < m * max (0.35 * 0.5 = 0.175: 0.3 stays, 0.15 goes).
    assert _approx(target_probs(LOGITS, 1.0, min_p=0.35), [0.625, 0.375, 0, 0])
    assert _approx(target_probs(LOGITS, 1.0, min_p=0.3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    # Order: top-p runs on what top-k left. After top_k=2 (0.625, 0.375) p=0.6 keeps one token; top-p on
    # the unfiltered distribution would have kept two (0.5 < 0.6).
    assert _approx(target_probs(LOGITS, 1.0, top_k=2, top_p=0.6), [1, 0, 0, 0])
    assert _approx(target_probs(LOGITS, 1.0, top_p=0.6), [0.625, 0.375, 0, 0])
    # ... and temperature comes first: at T=2 the distribution is flatter, so p=0.7 needs three tokens.
    flat = np.sqrt(P) / np.sqrt(P).sum()
    assert flat[:2].sum() < 0.7 <= flat[:3].sum()
    assert _approx(target_probs(LOGITS, 2.0, top_p=0.7), np.r_[flat[:3], 0] / flat[:3].sum())
    # min-p after top-p: relative to the most likely survivor, which top-p never removes.
    assert _approx(target_probs(LOGITS, 1.0, top_p=0.85, min_p=0.35), [0.625, 0.375, 0, 0])
    # A grammar mask comes before everything: token 0 forbidden, the rest renormalised, then top-k=1.
    allowed = np.array([False, True, True, True])
    assert _approx(target_probs(LOGITS, 1.0, allowed=allowed), [0, 0.6, 0.3, 0.1])
    assert _approx(target_probs(LOGITS, 1.0, top_k=1, allowed=allowed), [0, 1, 0, 0])
    assert _approx(target_probs(LOGITS, 1.0, top_p=0.55, allowed=allowed), [0, 1, 0, 0])  # 0.6 >= 0.55
    assert _approx(target_probs(LOGITS, 0.0, allowed=allowed), [0, 1, 0, 0])
    # Rows: one setting, a shared mask or one per row.
    rows = target_probs_rows(torch.tensor(np.stack([LOGITS, LOGITS[::-1].copy()])), SamplingParams(top_k=1))
    assert rows.dtype == torch.float64 and rows.tolist() == [[1, 0, 0, 0], [0, 0, 0, 1]]
    per_row = target_probs_rows(np.stack([LOGITS, LOGITS]), SamplingParams(top_k=1), np.stack([allowed, ~allowed]))
    assert per_row.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_top_k_ties_exactly_k_unlike_transformers():
    """At an exact tie with the k-th logit, SamplingParams' "the k most likely tokens" (and logits_to_probs,
    rank < k) keep exactly k; the oracle breaks the tie by the lower token id. transformers' TopKLogitsWarper
    (and vLLM) keep every tied token. Model logits are continuous, so the suites never meet this case."""
    logits = np.array([1.0, 2.0, 2.0, 0.0])
    assert _approx(target_probs(logits, 1.0, top_k=1), [0, 1, 0, 0])
    hf = TopKLogitsWarper(top_k=1)(None, torch.tensor(logits)[None]).softmax(-1)[0].numpy()
    assert _approx(hf, [0, 0.5, 0.5, 0])
    ours = logits_to_probs(torch.tensor(logits, dtype=torch.float32)[None], torch.ones(1), torch.ones(1, dtype=torch.int64),
                           torch.ones(1), torch.zeros(1))[0]
    assert sorted(ours.tolist()) == [0, 0, 0, 1]  # one of the two tied tokens, whichever the sort put first


# ---- random cases ------------------------------------------------------------------------------------

@st.composite
def cases(draw, vocab: int | None = None):
    """Continuous random logits (no ties) and one setting: T, top-k (0 = off), top-p (1 = off), min-p (0 = off)."""
    vocab = vocab or draw(st.integers(2, 48))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = rng.normal(size=vocab) * draw(st.sampled_from([0.3, 1.0, 3.0])) + draw(st.floats(-50, 50))
    temperature = draw(st.floats(0.1, 4.0))
    top_k = draw(st.one_of(st.just(0), st.integers(1, vocab + 2)))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.02, 1.0)))
    min_p = draw(st.one_of(st.just(0.0), st.floats(0.005, 1.0)))
    return logits, temperature, top_k, top_p, min_p


def _boundary_margin(logits, temperature, top_k, top_p, min_p) -> float:
    """How far (in probability) a case is from flipping a filter's decision: top-p's cumulative masses
    from p, min-p's ratios from the threshold, and the k-th vs (k+1)-th probabilities. Implementations
    that round differently (float32, or a cumulative sum from the other end) may only disagree on
    cases closer than their rounding."""
    x = (logits - logits.max()) / temperature
    desc = np.sort(np.exp(x) / np.exp(x).sum())[::-1]
    margins = [1.0]
    if 0 < top_k < len(desc) and desc[top_k - 1] > 1e-6:  # (two negligible tokens may swap harmlessly)
        margins.append(desc[top_k - 1] - desc[top_k])
        desc = desc[:top_k] / desc[:top_k].sum()
    if top_p < 1:
        cumulative = np.cumsum(desc)
        margins.append(np.abs(cumulative[:-1] - top_p).min(initial=1.0))
        desc = desc[: int(np.searchsorted(cumulative, top_p)) + 1]
        desc = desc / desc.sum()
    if min_p > 0:
        margins.append(np.abs(desc[1:] / desc[0] - min_p).min(initial=1.0))  # the top token always stays
    return float(min(margins))


def _transformers(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """transformers' warpers in generate()'s order (temperature, top-k, top-p, min-p), in float64.
    Where the conventions differ from specserve's (see tests/sampling_oracle.py):
    - TopKLogitsWarper keeps every token tied with the k-th largest logit (the oracle: exactly k); the
      random logits here have no ties, and TopK rejects top_k=0, so "off" is simply not applied;
    - TopPLogitsWarper removes the ascending tail whose cumulative probability is <= 1 - p (the oracle:
      keeps a token while the mass before it, from the top, is < p): the same set in exact arithmetic,
      but the rounding differs, so the two may disagree when a cumulative mass lies within rounding of p
      (skipped by `_boundary_margin`);
    - min_tokens_to_keep=1 (their default) is the oracle's "the most likely token always survives"."""
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    if min_p > 0:
        warpers.append(MinPLogitsWarper(min_p=min_p))
    for warp in warpers:
        scores = warp(None, scores)
    return scores.softmax(-1)[0].numpy()


@settings(max_examples=300, deadline=None)
@given(cases())
def test_oracle_matches_transformers_warpers(case):
    if _boundary_margin(*case) < 1e-9:
        return  # within rounding of a filter's boundary: both answers are right
    assert _approx(target_probs(*case), _transformers(*case), tol=1e-9)


def _rows_disagree(function, rows: list[tuple]) -> list[int]:
    """Rows where `function` (logits_to_probs' signature), called once on every row with its own setting,
    differs from the oracle by more than float32 rounding."""
    logits = torch.tensor(np.stack([r[0] for r in rows]), dtype=torch.float32)
    got = function(logits, torch.tensor([r[1] for r in rows], dtype=torch.float32),
                   torch.tensor([r[2] for r in rows], dtype=torch.int64),
                   torch.tensor([r[3] for r in rows], dtype=torch.float32),
                   torch.tensor([r[4] for r in rows], dtype=torch.float32))
    # The oracle sees the same float32 logits the code does.
    return [m for m, r in enumerate(rows)
            if not _approx(got[m].double().numpy(), target_probs(logits[m], *r[1:]), tol=2e-5)]


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 40).flatmap(lambda vocab: st.lists(cases(vocab), min_size=1, max_size=4)))
def test_logits_to_probs_matches_the_oracle(rows):
    """The code under test, batched (each row its own T, top-k, top-p, min-p, some rows with every filter
    off, so the per-row "off" values must not leak into other rows), against the oracle."""
    rows = [r for r in rows if _boundary_margin(np.float32(r[0]).astype(np.float64), *r[1:]) > 1e-4]
    if rows:
        assert _rows_disagree(logits_to_probs, rows) == []


# ---- the checks have power ---------------------------------------------------------------------------

def _top_k_keeps_one_more(logits, temperature, top_k, top_p, min_p):
    """Off-by-one top-k: k + 1 tokens survive."""
    return logits_to_probs(logits, temperature, torch.where(top_k > 0, top_k + 1, top_k), top_p, min_p)


def _top_p_drops_the_crossing_token(logits, temperature, top_k, top_p, min_p):
    """Off-by-one top-p: the token whose mass reaches p is dropped (keep while the mass *including* it < p)."""
    probs = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    for m in range(probs.shape[0]):
        alive = torch.nonzero(probs[m]).flatten()
        if top_p[m] < 1 and len(alive) > 1:
            probs[m, alive[probs[m, alive].argmin()]] = 0
    return probs / probs.sum(-1, keepdim=True)


BROKEN = {"top-k keeps k+1": (_top_k_keeps_one_more, dict(temperature=1.0, top_k=3)),
          "top-p drops the crossing token": (_top_p_drops_the_crossing_token, dict(temperature=1.0, top_p=0.8))}


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_the_oracle_comparison_catches_an_off_by_one_filter(bug):
    broken, setting = BROKEN[bug]
    rng = np.random.default_rng(0)
    rows = [(rng.normal(size=16) * 2, setting.get("temperature", 1.0), setting.get("top_k", 0),
             setting.get("top_p", 1.0), setting.get("min_p", 0.0)) for _ in range(8)]
    assert _rows_disagree(logits_to_probs, rows) == []
    assert len(_rows_disagree(broken, rows)) == len(rows)


class _Out:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


def _sample_outputs(model_dir, prompt, params, probs_fn, n: int, seed: int) -> list[_Out]:
    """`n` three-token continuations of `prompt` drawn from transformers' logits through `probs_fn`
    (logits_to_probs' signature): a stand-in for the engine whose sampling transform is `probs_fn`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size

    def dist(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
        m = len(prefixes)
        return probs_fn(logits, torch.full((m,), params.temperature), torch.full((m,), params.top_k),
                        torch.full((m,), params.top_p), torch.full((m,), params.min_p)).double()

    p1 = dist([[]])[0]
    p2 = dist([[a] for a in range(vocab)])
    p3 = dist([[a, b] for a, b in itertools.product(range(vocab), repeat=2)]).view(vocab, vocab, vocab)
    g = torch.Generator().manual_seed(seed)
    t1 = torch.multinomial(p1, n, replacement=True, generator=g)
    t2 = torch.multinomial(p2[t1], 1, generator=g)[:, 0]
    t3 = torch.multinomial(p3[t1, t2], 1, generator=g)[:, 0]
    return [_Out([a, b, c]) for a, b, c in zip(t1.tolist(), t2.tolist(), t3.tolist())]


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_the_chi_square_suite_rejects_an_off_by_one_filter(small_vocab_dir, bug):
    """`assert_follows_target` — the check every lossless-sampling suite ends with — passes samples drawn
    through the real logits_to_probs and fails samples drawn through an off-by-one one, at the suites'
    sample size (1500) and threshold. The top-p bug only narrows the support, so there the chi-square
    test itself must catch it."""
    broken, setting = BROKEN[bug]
    prompt, n = [3, 1, 4, 1, 5], 1500
    params = SamplingParams(**setting)
    good = _sample_outputs(small_vocab_dir, prompt, params, logits_to_probs, n, seed=1)
    assert_follows_target(good, small_vocab_dir, prompt, params)
    bad = _sample_outputs(small_vocab_dir, prompt, params, broken, n, seed=1)
    with pytest.raises(AssertionError, match="chi-square p-value" if "top-p" in bug else "zero probability|chi-square"):
        assert_follows_target(bad, small_vocab_dir, prompt, params)
    # Far beyond the suites' 1e-3 threshold at the 2nd token (the chi-square statistic on its own).
    exact2, _ = exact_marginals(small_vocab_dir, prompt, params)
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in bad]), minlength=exact2.numel()).double()
    support = exact2 > 0
    assert chi_square_p_value(counts[support], exact2[support] / exact2[support].sum()) < 1e-6
