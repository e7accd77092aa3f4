"""Peer systems for `specserve eval`: Hugging Face transformers' `generate` and llama.cpp on the same
checkpoint.

- ``transformers``: plain `generate` (greedy, or sampled at the same temperature with top-k/top-p
  off), prompt groups batched with left padding.
- ``transformers-assisted``: assisted generation with ``assistant_model=`` the draft model.
- ``transformers-prompt-lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens=``).
- ``llama.cpp``: plain decoding in llama-cpp-python, one prompt at a time, on the checkpoint converted
  by llama.cpp's own converter (f32 against float32, f16 against half-size weights; see
  llamacpp_peer.py), with the kernels' thread count. When llama-cpp-python or the converter is not
  available it is skipped with one line and the other systems still run.
- ``llama.cpp-prompt-lookup``: the same, with llama-cpp-python's own prompt-lookup speculative decoding
  (`LlamaPromptLookupDecoding`, ``--prompt-lookup-tokens`` drafted a step).

Assisted and prompt-lookup generation take one sequence at a time in transformers, so those two
run each prompt of a group in turn. ``min_new_tokens = max_new_tokens`` makes every system generate
the same number of tokens (our runs use ``ignore_eos``); note that transformers gets there by
masking EOS, so after a point where the target's argmax is EOS its tokens differ from ours.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from specserve.evals import llamacpp_peer
from specserve.evals.common import sync

PEERS = ("transformers", "transformers-assisted", "transformers-prompt-lookup", "llama.cpp", "llama.cpp-prompt-lookup")
LLAMA_CPP_PEERS = PEERS[3:]
TRANSFORMERS_PEERS = PEERS[:3]


def parse_peers(text: str | None) -> list[str]:
    """``"a,b"`` → ["a", "b"]; raises ValueError naming an unknown peer and the known ones."""
    if not text:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(map(repr, unknown))}; peers: {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


def resolve_peer_draft(model_dir: str, peer_draft: str | None) -> str:
    """The assistant model's directory: --peer-draft, else the bundle's draft model for the default target."""
    if peer_draft:
        if not (Path(peer_draft) / "config.json").is_file():
            raise ValueError(f"--peer-draft {peer_draft!r} is not a model directory (no config.json)")
        return peer_draft
    from specserve.bundle_paths import default_drafters, is_default_model

    if is_default_model(model_dir) and "draft" in default_drafters():
        return default_drafters()["draft"]
    raise ValueError("the transformers-assisted peer needs a draft model: pass --peer-draft DIR "
                     "(the embedded model's draft model is used only with the embedded target)")


@dataclass
class Peer:
    name: str
    model: object
    generate_kwargs: dict = field(default_factory=dict)
    one_at_a_time: bool = False
    pad_token_id: int = 0

    def run(self, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int) -> tuple[float, list[list[int]]]:
        """Generate exactly `max_tokens` tokens for each prompt; (seconds, output token ids per prompt)."""
        import torch

        device = next(self.model.parameters()).device
        if temperature > 0:
            sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        else:
            sample = {"do_sample": False}
        kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=self.pad_token_id,
                      **sample, **self.generate_kwargs)
        batches = [[p] for p in prompts] if self.one_at_a_time else [prompts]
        outputs: list[list[int]] = []
        sync(device)
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            width = max(len(p) for p in batch)
            ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            if temperature > 0:
                torch.manual_seed(seed + i)
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, **kwargs)
            outputs += out[:, width:].tolist()
        sync(device)
        return time.perf_counter() - t0, outputs


@dataclass
class LlamaCppPeer:
    """llama.cpp through llama-cpp-python: each prompt in turn (its `generate` takes one sequence)."""

    name: str
    runner: llamacpp_peer.LlamaCpp

    def run(self, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int) -> tuple[float, list[list[int]]]:
        """Generate exactly `max_tokens` tokens for each prompt; (seconds, output token ids per prompt)."""
        t0 = time.perf_counter()
        outputs = [self.runner.generate(p, max_tokens, temperature, seed + i) for i, p in enumerate(prompts)]
        return time.perf_counter() - t0, outputs


def load_peers(names: list[str], model_dir: str, *, draft_dir: str | None, device, dtype,
               prompt_lookup_tokens: int = 10) -> dict[str, Peer]:
    """Load transformers' model once (and the assistant when asked); one Peer per transformers name
    (llama.cpp: `LlamaCppPeer` over `llamacpp_peer.load`)."""
    names = [n for n in names if n in TRANSFORMERS_PEERS]
    if not names:
        return {}
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    def load(path: str, what: str):
        try:
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
        except Exception as exc:  # any loader failure is bad input here: say which model and why
            raise ValueError(f"transformers cannot load the {what} in {str(path)!r}: {str(exc).splitlines()[0]}") from exc

    model = load(model_dir, "target")
    pad = model.generation_config.pad_token_id
    if isinstance(pad, list):
        pad = pad[0]
    pad = 0 if pad is None else int(pad)
    peers: dict[str, Peer] = {}
    for name in names:
        if name == "transformers":
            peers[name] = Peer(name, model, pad_token_id=pad)
        elif name == "transformers-assisted":
            assistant = load(resolve_peer_draft(model_dir, draft_dir), "draft model")
            peers[name] = Peer(name, model, {"assistant_model": assistant}, one_at_a_time=True, pad_token_id=pad)
        elif name == "transformers-prompt-lookup":
            lookup = {"prompt_lookup_num_tokens": prompt_lookup_tokens}
            peers[name] = Peer(name, model, lookup, one_at_a_time=True, pad_token_id=pad)
    return peers
