"""A Hugging Face Llama-family model directory as a target: config.json, safetensors weights, tokenizer
files, generation_config.json. The weights' reader is `specserve.checkpoint` (exact name and shape checks);
the config's is `specserve.config`."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class HFDirectory:
    """An opened model directory (its config is read and checked on opening)."""

    kind = "hf"

    def __init__(self, path: str | Path) -> None:
        from specserve.config import load_config

        self.path = Path(path).expanduser()
        self.config = load_config(self.path)

    @property
    def hf_config(self):
        return self.config.hf_config

    def load(self, dtype: torch.dtype, device: torch.device = torch.device("cpu"), shard=None,
             stats: dict | None = None, blocks_only: bool = False):
        """(state, blocks): every weight under its Hugging Face name as `dtype` on `device` (`shard`: this tensor-
        parallel rank's slices), and no quantized blocks (a directory holds float weights)."""
        from specserve.checkpoint import load_state_dict

        return load_state_dict(self.path, self.config, device, dtype, shard, stats), {}

    def tokenizer(self):
        """The directory's tokenizer through transformers, or None when it ships none."""
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((self.path / n).exists() for n in names):
            return None
        from specserve.loading.tokenizer_files import load_tokenizer

        try:
            return load_tokenizer(self.path)
        except Exception as exc:
            raise ValueError(f"cannot load the tokenizer in {str(self.path)!r}: {exc}") from exc

    def tokenizer_dir(self) -> Path | None:
        return self.path if (self.path / "tokenizer.json").is_file() else None

    def eos_token_ids(self, tokenizer) -> tuple[int, ...]:
        """EOS ids from generation_config.json, else config.json, else the tokenizer."""
        eos = None
        gen = self.path / "generation_config.json"
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except (OSError, ValueError) as exc:
                raise ValueError(f"{str(gen)!r} is not valid JSON: {exc}") from exc
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def describe(self) -> str:
        return ""
