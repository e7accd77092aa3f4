"""`LLM(quantization="int8")`: Q8_0-layout weights quantized at load, on the CPU kernels.

The kernel arithmetic and packing are checked in test_linear.py (bitwise against an emulation of llama.cpp's
q8_0 x q8_0 dot product, written in numpy) and batch invariance in test_batch_invariance.py. Here: a model
quantizes from float32, float16 and bfloat16 checkpoints alike, with logits within 7.5 % (relative, whole
prompt; 5.0 % measured on this random 2-layer model, whose amplified weights make it far harsher than a
trained one: `specserve bench quantization` measures the embedded model) of the float32 model's; speculation on the
quantized model is lossless against it (greedy output equal to its plain output for a draft model and
n-gram, batch 1 and 4); what cannot be quantized is refused before anything loads, with a clear error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams
from specserve.kv_cache import BlockAllocator
from specserve.step_batch import StepBatchBuilder

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [11]]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def _checkpoint_as(src, dst, dtype: torch.dtype):
    """A copy of the model directory `src` with its weights stored as `dtype`."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _logits(llm, prompt) -> torch.Tensor:
    allocator = BlockAllocator(len(prompt) // 4 + 2, 4)
    allocator.allocate("s", len(prompt))
    builder = StepBatchBuilder(allocator)
    builder.add("s", 0, np.asarray(prompt), logits="all")
    return llm.model.forward(builder.build(), llm.model.new_cache(allocator)).logits.double()


@pytest.fixture(scope="module")
def checkpoints(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"float32": _checkpoint_as(llama_dir, root / "f32", torch.float32),
            "float16": _checkpoint_as(llama_dir, root / "f16", torch.float16),
            "bfloat16": _checkpoint_as(llama_dir, root / "bf16", torch.bfloat16)}


def test_quantizes_from_every_float_checkpoint_close_to_the_float_model(checkpoints):
    prompt = list(range(3, 40))
    reference = _logits(LLM(checkpoints["float32"], drafter=None, device="cpu", dtype="float32"), prompt)
    for name, path in checkpoints.items():
        llm = LLM(path, drafter=None, device="cpu", quantization="int8")
        assert llm.model.kernels.storage == "int8", name
        float_bytes = LLM(path, drafter=None, device="cpu").model.bytes_read_per_token()
        assert llm.model.bytes_read_per_token() < 0.6 * float_bytes or name == "float32", name
        got = _logits(llm, prompt)
        gap = float((got - reference).norm() / reference.norm())
        assert gap < 0.075, (name, gap)


def test_speculation_on_the_quantized_model_is_lossless(llama_dir, tmp_path):
    from tiny_models import build_model

    draft = build_model(tmp_path / "draft", "llama", hidden_size=32, layers=1, heads=2, kv_heads=1, seed=5, init_std=0.2)
    prompts = ["def f(x):\n    return x + 1\n" * 2, "class Point:", "for i in range(10):", "import os"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(llama_dir, drafter=None, device="cpu", quantization="int8").generate(prompts, params)]
    for spec in (f"draft:{draft}", "ngram"):
        llm = LLM(llama_dir, drafter=spec, device="cpu", quantization="int8", speculation="static")
        for batch in (1, 4):
            outs = llm.generate(prompts[:batch], params)
            assert [o.token_ids for o in outs] == plain[:batch], (spec, batch)
        assert sum(o.spec.num_drafted for o in outs) > 0, spec


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="int4"), "quantization must be one of int8"),
    (dict(quantization="int8", attention="sdpa"), "CPU kernels only"),
])
def test_what_cannot_be_quantized_is_refused(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, drafter=None, device="cpu", **kwargs)


def test_cli_refuses_a_bad_quantization_in_one_line(llama_dir):
    for extra in (["--quantization", "int4"], ["--quantization", "int8", "--attention", "sdpa"]):
        res = subprocess.run([sys.executable, "-m", "specserve", "generate", "--model", str(llama_dir), "--prompt", "hi",
                              "--max-tokens", "4", *extra], capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "quantization" in res.stderr, res.stderr
