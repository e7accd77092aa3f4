"""`load_tokenizer` gives the tokenizer `AutoTokenizer` gives, on every kind of directory we read: the same class,
ids, special tokens and chat template rendering."""

from __future__ import annotations

import json
import shutil

import pytest

from specserve.loading.tokenizer_files import generic_fast_class, load_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "Héllo wörld — ünïcode\t tabs  and  spaces", "<|endoftext|>x<|endoftext|>", ""]


def assert_same_tokenizer(ours, theirs):
    assert type(ours) is type(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.all_special_tokens == theirs.all_special_tokens and ours.eos_token_id == theirs.eos_token_id
    assert len(ours) == len(theirs) and ours.chat_template == theirs.chat_template
    if theirs.chat_template:
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "?"}]
        assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_the_tiny_models_tokenizer_is_autotokenizers():
    from transformers import AutoTokenizer

    from specserve.bundle_paths import default_model_dir

    directory = default_model_dir()
    assert generic_fast_class(directory)  # the case that skips AutoTokenizer
    assert_same_tokenizer(load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory)))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_tokenizer_with_a_chat_template_is_autotokenizers(llama_dir, tmp_path, where):
    from transformers import AutoTokenizer

    directory = tmp_path / "t"
    shutil.copytree(llama_dir, directory)
    if where == "chat_template.jinja":
        (directory / where).write_text(CHATML)
    else:
        config = json.loads((directory / where).read_text())
        (directory / where).write_text(json.dumps({**config, "chat_template": CHATML}))
    assert generic_fast_class(directory)
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    assert ours.chat_template == CHATML
    assert_same_tokenizer(ours, theirs)


@pytest.mark.parametrize("tokenizer_class", ["GPT2Tokenizer", None])
def test_another_class_goes_through_autotokenizer(llama_dir, tmp_path, tokenizer_class):
    """A config naming a model-specific class (or none) is AutoTokenizer's to resolve."""
    from transformers import AutoTokenizer

    directory = tmp_path / "t"
    shutil.copytree(llama_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert not generic_fast_class(directory)
    assert_same_tokenizer(load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory)))
