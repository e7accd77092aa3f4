"""A tokenizer directory read through transformers, without its model classes where they are not needed.

`AutoTokenizer.from_pretrained` on a model directory first reads config.json through `AutoConfig` to pick
a tokenizer class, which imports the model's config module and with it torch.distributed (~2 s of every
process start on 2 cores). A directory whose tokenizer_config.json names the generic fast tokenizer
(`TokenizersBackend`, `PreTrainedTokenizerFast`: every tokenizer we convert or train, and most Llama-family
ones) needs no config to choose it; anything else goes through `AutoTokenizer` as before.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The tokenizer_config.json classes that mean "the tokenizers library's tokenizer.json, as is".
GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(directory: str | Path, **kwargs):
    """transformers' tokenizer for `directory` (`kwargs` go to `from_pretrained`)."""
    directory = Path(directory)
    if not kwargs and generic_fast_class(directory):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), **kwargs)


def generic_fast_class(directory: Path) -> bool:
    """Whether `directory` holds a tokenizer.json whose tokenizer_config.json names the generic fast class."""
    config = directory / "tokenizer_config.json"
    if not (directory / "tokenizer.json").is_file() or not config.is_file():
        return False
    try:
        tokenizer_class = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # unreadable: AutoTokenizer reports it in its own words
        return False
    return tokenizer_class in GENERIC_FAST_CLASSES
