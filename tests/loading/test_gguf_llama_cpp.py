"""The same GGUF file in specserve and in llama.cpp (llama-cpp-python, where it is built: the peer tests' skip rule):
greedy tokens agree wherever the argmax is clear.

Both sides quantize activations their own way (llama.cpp: float16 scales in Q8_0 / Q8_1 for the 4- and 8-bit
products, float16 activations for F16 ones; specserve: float32 scales), so a near tie may go either way on a
random model; a position whose top-2 logits (float64 reference of the file's own weights) are apart by more than
`CLEAR` of the logits' range must give the same token, and most positions are clear.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model import LlamaModel

from loading.gguf_writer import write_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="needs llama-cpp-python (pip install -e \".[llamacpp]\")")

CLEAR = 0.05  # of max |logit|: far beyond what 8-bit activations move a logit on this model (~3 %)
STEPS = 8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tiny_models import build_model

    return build_model(tmp_path_factory.mktemp("hf"), "llama", hidden_size=256, heads=4, kv_heads=2, init_std=0.1,
                       rope_theta=5000.0, rms_norm_eps=1e-5)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "Q4_1", "F16"])
def test_greedy_tokens_equal_llama_cpps_on_the_same_file(hf_dir, tmp_path, weight_type):
    from specserve.evals.llamacpp_peer import LlamaCpp

    path = write_gguf(hf_dir, tmp_path / f"model-{weight_type}.gguf", weight_type)
    ours = LLM(path, drafter=None, device="cpu", dtype="float32")
    reference = LlamaModel.from_pretrained(path, torch.device("cpu"), torch.float32, cpu_kernels=False)
    # The peer's loader: it leaves out llama.cpp's extra weight buffers where they crash the host (an AMX Xeon)
    theirs = LlamaCpp(path, threads=1, n_ctx=128).llm
    gen = torch.Generator().manual_seed(7)
    clear = compared = 0
    for _ in range(8):
        prompt = torch.randint(3, ours.model.config.vocab_size, (int(torch.randint(4, 24, (1,), generator=gen)),),
                               generator=gen).tolist()
        mine = ours.generate([prompt], SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))[0].token_ids
        theirs.reset()
        other = []
        for token in theirs.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            other.append(int(token))
            if len(other) == STEPS:
                break
        # Compare along the common prefix: each position whose argmax is clear must agree.
        context = list(prompt)
        for a, b in zip(mine, other):
            logits = _last_logits(reference, context)
            top2 = np.sort(logits)[-2:]
            compared += 1
            if top2[1] - top2[0] > CLEAR * np.abs(logits).max():
                clear += 1
                assert a == b, (weight_type, prompt, context[len(prompt):], a, b)
            if a != b:
                break
            context.append(a)
    assert clear >= compared // 2 and clear >= 8  # the check above really ran


def _last_logits(model: LlamaModel, tokens: list[int]) -> np.ndarray:
    from specserve.kv_cache import BlockAllocator
    from specserve.step_batch import StepBatchBuilder

    allocator = BlockAllocator(len(tokens) // 4 + 2, 4)
    allocator.allocate("s", len(tokens))
    builder = StepBatchBuilder(allocator)
    builder.add("s", 0, np.asarray(tokens), logits="last")
    return model.forward(builder.build(), model.new_cache(allocator)).logits[-1].double().numpy()


def test_bench_verify_peer_rewinds_to_the_prefix_each_time(hf_dir, tmp_path):
    # `bench verify --peer llama.cpp` times one decode of the rows after a prefix decoded once, rewinding between
    # tries: each try must see exactly the prefix (its KV kept, the last try's rows dropped), so every row's logits
    # equal one fresh decode of prefix + rows.
    from specserve.evals.llamacpp_peer import LlamaCpp

    path = write_gguf(hf_dir, tmp_path / "model-Q8_0.gguf", "Q8_0")
    peer = LlamaCpp(path, threads=1, n_ctx=64, logits_all=True)
    prefix, rows = list(range(5, 25)), [40, 41, 42, 43]
    for other in ([50, 51, 52, 53, 54, 55], [60]):  # earlier tries with other rows, longer and shorter
        assert peer.verify_seconds(prefix, other) > 0
    peer.verify_seconds(prefix, rows)
    timed = np.array(peer.llm.scores[len(prefix):len(prefix) + len(rows)])
    fresh = LlamaCpp(path, threads=1, n_ctx=64, logits_all=True)
    fresh.llm.eval(prefix + rows)
    np.testing.assert_allclose(timed, np.array(fresh.llm.scores[len(prefix):len(prefix) + len(rows)]), atol=1e-4)


def test_llama_cpp_prompt_lookup_peer_decodes_what_plain_llama_cpp_does(hf_dir, tmp_path):
    """The `llama.cpp-prompt-lookup` peer is llama.cpp's own speculative decoding: greedy tokens equal plain llama.cpp's."""
    from specserve.evals.llamacpp_peer import LlamaCpp

    path = write_gguf(hf_dir, tmp_path / "model-F32.gguf", "F32")
    plain, lookup = LlamaCpp(path, 1, 256), LlamaCpp(path, 1, 256, prompt_lookup=10)
    assert plain.llm.draft_model is None and lookup.llm.draft_model is not None
    for prompt in ([5, 6, 7, 8, 9] * 6, [40, 41, 42, 43, 44, 45, 46]):
        assert lookup.generate(prompt, 24) == plain.generate(prompt, 24)
    # An answer that ends at the last slot of a context llama.cpp pads (250 -> 256): llama-cpp-python keeps drafts
    # within the padded size but its buffer of token ids holds 250, and overflowed ("could not broadcast") before
    # the peer made room for one draft past the answer. A greedy random model falls into a cycle, so a prompt
    # holding the cycle is continued by drafts to the end.
    plain, lookup = LlamaCpp(path, 1, 250), LlamaCpp(path, 1, 250, prompt_lookup=10)
    seed = [40, 41, 42, 43, 44, 45, 46]
    prompt = seed + plain.generate(seed, 160)
    assert lookup.generate(prompt, 250 - len(prompt)) == plain.generate(prompt, 250 - len(prompt))


def test_bench_drafters_runs_llama_cpp_beside_us_on_the_same_file(hf_dir, tmp_path, capsys):
    """`bench drafters --peer ...` times both llama.cpp peers in the same loop on a GGUF target; another target
    is refused with one line."""
    import json

    from specserve.cli import main

    path = write_gguf(hf_dir, tmp_path / "model-F32.gguf", "F32")
    out = tmp_path / "bench.json"
    assert main(["bench", "drafters", "--model", str(path), "--drafter", "ngram", "--prompts", "2", "--max-tokens", "8",
                 "--repeats", "1", "--threads", "1", "--peer", "llama.cpp", "--peer", "llama.cpp-prompt-lookup",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["peers"]) == {"llama.cpp", "llama.cpp-prompt-lookup"}
    assert all(p["tokens_per_s"] > 0 for p in result["peers"].values())
    capsys.readouterr()
    assert main(["bench", "drafters", "--model", str(hf_dir), "--drafter", "ngram", "--prompts", "1", "--max-tokens", "4",
                 "--repeats", "1", "--peer", "llama.cpp"]) == 2
    assert "GGUF" in capsys.readouterr().err
