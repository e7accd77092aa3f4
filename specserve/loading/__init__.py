"""Loading a target: one owner, two readers that give `LlamaModel` the same things.

- `hf_directory.HFDirectory`: a Hugging Face Llama-family directory (config.json, safetensors, tokenizer).
- `gguf_file.GGUFFile`: a llama.cpp GGUF file (metadata, tokenizer and chat template, quantized blocks).

Both offer ``config`` (a `ModelConfig`), ``load(dtype, ...) -> (state, blocks)`` (float weights under
Hugging Face names; for GGUF also the Q8_0 / Q4_0 / Q4_1 blocks the kernels run as stored),
``tokenizer()``, ``tokenizer_dir()``, ``eos_token_ids(tokenizer)`` and ``describe()``.
Both read tokenizers through `tokenizer_files.load_tokenizer`. `resolve_model` turns what a user names (None,
"tiny", a directory, a .gguf file) into a path; `default_model` fetches the default model's file. Loading produces weights; `specserve.model` consumes them.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Names the model used when none is given (a path or "tiny"); unset, the default model.
MODEL_ENV_VAR = "SPECSERVE_MODEL"
#: The name of the small code model the tests and quick demos use (the bundle's 9M-parameter model).
TINY_MODEL = "tiny"


def open_checkpoint(path: str | Path):
    """The reader for `path`: a GGUF file (by its .gguf suffix) or a Hugging Face directory."""
    from specserve.loading.gguf_file import is_gguf

    if is_gguf(path):
        from specserve.loading.gguf_file import GGUFFile

        return GGUFFile(path)
    from specserve.loading.hf_directory import HFDirectory

    return HFDirectory(path)


def resolve_model(model: str | Path | None, *, fetch: bool = True) -> Path:
    """What a user named as the target, as a path: None -> ``$SPECSERVE_MODEL`` when set, else the default model's
    GGUF file (fetched into the user's cache the first time, when `fetch`); "tiny" -> the bundled 9M code model;
    else the path itself."""
    if model is None:
        model = os.environ.get(MODEL_ENV_VAR) or None
    if model is None:
        from specserve.loading.default_model import default_model_path

        return default_model_path(fetch=fetch)
    if str(model) == TINY_MODEL:
        from specserve.bundle_paths import default_model_dir

        path = default_model_dir()
        if path is None:
            raise ValueError("the tiny model is not installed (its bundle is missing: `specserve train bundle` builds it)")
        return path
    return Path(model).expanduser()
