"""On the CPU a half-size checkpoint keeps its own storage by default: exactly its values at half the
bytes, so the forward equals float32 storage's bitwise; float32 checkpoints stay float32."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.step_batch import StepBatchBuilder


def _logits(llm, ids):
    alloc = llm.engine.allocator
    alloc.allocate("x", len(ids) + 4)
    batch = StepBatchBuilder(alloc)
    batch.add("x", 0, np.asarray(ids, dtype=np.int64), logits="all")
    out = llm.model.forward(batch.build(), llm.engine.cache).logits.clone()
    alloc.free("x")
    return out


def test_half_size_checkpoint_keeps_its_storage_and_equals_float32(llama_dir, tmp_path):
    for half in (torch.float16, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).to(half)
        out = tmp_path / str(half)
        model.save_pretrained(str(out))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (llama_dir / name).is_file():
                (out / name).write_bytes((llama_dir / name).read_bytes())
        default, wide = LLM(out, device="cpu"), LLM(out, device="cpu", dtype="float32")
        assert default.dtype == half and wide.dtype == torch.float32
        ids = [5, 17, 42, 3, 9, 9, 1]
        assert torch.equal(_logits(default, ids), _logits(wide, ids))
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        assert default.generate([ids], params)[0].token_ids == wide.generate([ids], params)[0].token_ids
    assert LLM(llama_dir, device="cpu").dtype == torch.float32  # saved in float32: stays float32
