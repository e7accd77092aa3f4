"""Byte-level BPE tokenizer trained with `tokenizers`, saved as a transformers tokenizer.

Byte-level means every string is encodable (no unknown token) and decoding is exact. Special tokens:
``<|endoftext|>`` (end of text: separates documents in training and ends a chat turn) and the chat role
markers ``<|system|>``, ``<|user|>``, ``<|assistant|>`` used by the chat template::

    <|user|>
    hello<|endoftext|>
    <|assistant|>
    ...
"""

from __future__ import annotations

from pathlib import Path

from specserve.tokenizer_fingerprint import tokenizer_fingerprint  # noqa: F401 (the runtime's; re-exported for training)

EOS_TOKEN = "<|endoftext|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (EOS_TOKEN, *ROLE_TOKENS)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|endoftext|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path | None = None):
    """Train a byte-level BPE on ``texts``; return a `PreTrainedTokenizerFast` (saved to out_dir if given).

    The EOS token has id 0. Training is deterministic for the same texts in the same order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= 65536:
        raise ValueError(f"vocab_size must be an integer in [{MIN_VOCAB}, 65536], got {vocab_size!r}")
    if not texts:
        raise ValueError("no text to train the tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(model_dir: str | Path, what: str = "directory"):
    """The transformers tokenizer in ``model_dir``; ValueError naming the directory when it has none."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{what} {str(model_dir)!r} does not exist")
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{what} {str(model_dir)!r} has no tokenizer (tokenizer.json is missing)")
    from specserve.loading.tokenizer_files import load_tokenizer as read_tokenizer

    try:
        return read_tokenizer(model_dir)
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise ValueError(f"cannot load the tokenizer in {str(model_dir)!r}: {exc}") from exc


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    """Copy the tokenizer files of one model directory into another."""
    import shutil

    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, dst_dir / name)
