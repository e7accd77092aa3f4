"""`SamplingParams.return_hidden_states`: the target's hidden states at the engine's capture layers, taken from
the rows prefill and decode steps compute anyway (EAGLE-3's training data is captured this way).

The reference is transformers' forward of prompt + output (`output_hidden_states`): every token whose row the
engine ran — all but the last — must come back, in order, with transformers' values, whether steps verified
nothing (plain), accepted several drafted tokens (the scripted drafter's trees) or fed a drafter that reads
other target layers itself (an EAGLE-3 head), and whether or not the prompt's blocks sit in the prefix cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import scripted_drafter  # noqa: F401  (registers "scripted")
from specserve import LLM, SamplingParams

PROMPTS = ["def add(a, b):\n    return a + b\n" * 3, "class Point:", "for i in range(10):\n"]
N = 24
LAYERS = (0, 1, 2)  # the embeddings, the first layer's output, the final normed output (2 layers)


def assert_rows_are_transformers(hf, prompt_ids: list[int], out, rows: int) -> None:
    assert set(out.hidden_states) == set(LAYERS)
    tokens = prompt_ids + out.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for layer in LAYERS:
        got = out.hidden_states[layer]
        assert got.shape == (rows, hf.config.hidden_size)
        torch.testing.assert_close(got.float(), ref[layer][0, :rows], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("drafter", [None, "scripted", "eagle"])
def test_every_decoded_rows_hidden_states_equal_transformers(llama_dir, drafter, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    plain = LLM(llama_dir, drafter=None, device="cpu")
    prompts = [plain.encode(p) for p in PROMPTS]
    greedy = dict(temperature=0, max_tokens=N, ignore_eos=True)
    reference = plain.generate(prompts, SamplingParams(**greedy))
    options = None
    if drafter == "scripted":  # trees that accept several tokens a step and reject others
        options = {"mode": "mixed", "seed": 3, "references": [p + o.token_ids for p, o in zip(prompts, reference)]}
    elif drafter == "eagle":  # a random EAGLE-3 head: it reads target layers of its own beside LAYERS
        from specserve.drafters.eagle_checkpoint import save_head
        from tests.drafters.test_eagle import random_head

        head = save_head(random_head(llama_dir, "eagle3", seed=2, std=0.1), tmp_path / "head", torch.float32)
        drafter, options = f"eagle:{head}", {"depth": 3, "topk": 2}
    llm = LLM(llama_dir, drafter=drafter, drafter_options=options, speculation="static", device="cpu",
              capture_layers=LAYERS)
    params = [SamplingParams(**greedy, return_hidden_states=True), SamplingParams(**greedy),
              SamplingParams(**greedy, return_hidden_states=True)]
    for _ in range(2):  # the second time the prompts' blocks are in the prefix cache: still every row comes back
        outs = llm.generate(prompts, params)
        for prompt_ids, out, ref, p in zip(prompts, outs, reference, params):
            assert out.token_ids == ref.token_ids  # greedy: capturing and speculation change nothing
            if not p.return_hidden_states:
                assert out.hidden_states is None
                continue
            assert_rows_are_transformers(hf, prompt_ids, out, len(prompt_ids) + N - 1)
    if drafter is not None:
        assert sum(o.spec.num_drafted for o in outs) > 0
    if options and "references" in options:
        assert max(o.spec.mean_accepted_length for o in outs) > 1.5  # steps accepted several tokens


def test_a_stop_inside_an_accepted_path_keeps_only_the_outputs_rows(llama_dir):
    """A stop string met at an accepted node drops the tokens after it — and their rows."""
    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    plain = LLM(llama_dir, drafter=None, device="cpu")
    prompt = plain.encode(PROMPTS[0])
    ref = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    stop = plain.tokenizer.decode(ref.token_ids[:N // 2])[-3:]
    options = {"mode": "all_right", "references": [prompt + ref.token_ids]}  # whole chains accepted
    llm = LLM(llama_dir, drafter="scripted", drafter_options=options, speculation="static", device="cpu",
              capture_layers=LAYERS)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop],
                                                return_hidden_states=True))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < N
    rows = len(out.hidden_states[0])
    assert rows in (len(prompt) + len(out.token_ids) - 1, len(prompt) + len(out.token_ids))
    assert_rows_are_transformers(hf, prompt, out, rows)


def test_asking_an_engine_that_captures_nothing_is_an_error(llama_dir):
    llm = LLM(llama_dir, drafter=None, device="cpu")
    with pytest.raises(ValueError, match="return_hidden_states needs an engine that captures"):
        llm.generate(["x"], SamplingParams(max_tokens=2, return_hidden_states=True))
    with pytest.raises(ValueError, match="capture layers .* must lie in 0..2"):
        LLM(llama_dir, drafter=None, device="cpu", capture_layers=(1, 3))
    with pytest.raises(ValueError, match="return_hidden_states must be a bool"):
        SamplingParams(return_hidden_states=1)
