"""Log-probabilities of a whole step's requests are computed in one call and cut back per request: in one
batch under speculation (the scripted drafter's trees accept several tokens a step and reject others), a
penalised request (its rows edited by a rule, so read from their copy), requests asking different k, one
asking 0 and one not asking — each equals transformers' float32 log_softmax at its own emitted tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import scripted_drafter  # noqa: F401  (registers "scripted")
from specserve import LLM, SamplingParams

PROMPTS = ["def add(a, b):", "import os\nimport os\n", "x = [1, 2, 3]\nfor", "class Point:"]
N = 20


@pytest.mark.parametrize("drafter", ["scripted", None])
def test_batched_logprobs_equal_transformers_per_request(llama_dir, drafter):
    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    plain = LLM(llama_dir, drafter=None, device="cpu")
    prompts = [plain.encode(p) for p in PROMPTS]
    base = dict(temperature=0, max_tokens=N, ignore_eos=True)
    params = [SamplingParams(**base, logprobs=3, frequency_penalty=0.8, presence_penalty=0.5),
              SamplingParams(**base, logprobs=5), SamplingParams(**base, logprobs=0), SamplingParams(**base)]
    outs = plain.generate(prompts, params)
    refs = [p + o.token_ids for p, o in zip(prompts, outs)]
    options = {"mode": "mixed", "seed": 3, "references": refs} if drafter else None
    llm = LLM(llama_dir, drafter=drafter, drafter_options=options, speculation="static", device="cpu")
    got = llm.generate(prompts, params)
    for prompt, out, p, mine in zip(prompts, outs, params, got):
        assert mine.token_ids == out.token_ids  # greedy: speculation changes nothing
        if p.logprobs is None:
            assert mine.logprobs is None
            continue
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
        assert len(mine.logprobs) == N
        for i, (e, token) in enumerate(zip(mine.logprobs, out.token_ids)):
            row = ref[len(prompt) - 1 + i]
            assert e.token == token and e.logprob == pytest.approx(float(row[token]), abs=2e-3)
            assert len(e.top) == p.logprobs
            if p.logprobs:
                top = row.topk(p.logprobs)
                assert [t for t, _ in e.top] == top.indices.tolist()
                assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=2e-3)
