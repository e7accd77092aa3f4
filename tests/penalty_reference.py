"""Penalised greedy decoding written from the definitions, in float64 over transformers' logits — the
reference penalties.py is tested against (tests/engine/test_penalties.py, tests/server/test_openai_features.py):
OpenAI's frequency/presence penalties over the generated tokens, transformers'/vLLM's repetition penalty
over prompt and output, logit_bias added, EOS banned before min_tokens."""

from __future__ import annotations

import numpy as np
import torch


def penalise(logits: np.ndarray, prompt: list[int], generated: list[int], params: SamplingParams,
             eos: tuple[int, ...] = ()) -> np.ndarray:
    """float64[V] logits after the documented penalties, from their definitions."""
    out = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=out.shape[0]).astype(np.float64)
    if params.repetition_penalty != 1:
        for t in set(prompt) | set(generated):
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    if len(generated) < params.min_tokens:
        out[list(eos)] = -np.inf
    return out


def greedy_reference(hf, prompt: list[int], params: SamplingParams, eos: tuple[int, ...], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].double().numpy()
            ids.append(int(np.argmax(penalise(logits, prompt, ids[len(prompt):], params, eos))))
    return ids[len(prompt):]
