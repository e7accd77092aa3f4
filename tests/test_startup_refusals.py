"""Start-up refusals (issue 19): a checkpoint that fails to load, or a drafter that does not fit the target,
is refused at start with one line on stderr and exit code 2 — by `specserve generate` and `specserve serve`
(which never gets as far as listening): in process for speed, and a few as real subprocesses."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_runner import cli, run


def _write_config(model, **patch):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **patch}))


def _truncate_weights(model):
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


# name -> how a good checkpoint is broken; each one once crashed or could crash with a traceback
BROKEN = {
    "garbage_config": lambda m: (m / "config.json").write_text("{ not json"),
    "config_is_a_list": lambda m: (m / "config.json").write_text("[1, 2]"),  # was AttributeError: 'list'.get
    "no_config": lambda m: (m / "config.json").unlink(),
    "size_of_wrong_type": lambda m: _write_config(m, hidden_size="big"),
    "negative_vocab": lambda m: _write_config(m, vocab_size=-5),  # was a torch RuntimeError traceback
    "zero_heads": lambda m: _write_config(m, num_attention_heads=0),  # was "integer modulo by zero"
    "config_does_not_match_weights": lambda m: _write_config(m, hidden_size=128),
    "truncated_weights": _truncate_weights,
    "garbage_weights": lambda m: (m / "model.safetensors").write_bytes(b"\x00" * 100),
    "no_weights": lambda m: (m / "model.safetensors").unlink(),
}
NEEDLES = {
    "garbage_config": "not readable JSON", "config_is_a_list": "expected a JSON object", "no_config": "config.json",
    "size_of_wrong_type": "hidden_size", "negative_vocab": "vocab_size=-5", "zero_heads": "num_attention_heads=0",
    "config_does_not_match_weights": "do not match", "truncated_weights": "corrupt or truncated",
    "garbage_weights": "corrupt or truncated", "no_weights": "model.safetensors",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tiny_models import build_model

    root = tmp_path_factory.mktemp("refusals")
    good = build_model(root / "good", "llama")
    for name, breaks in BROKEN.items():
        breaks(shutil.copytree(good, root / name))
    build_model(root / "other_vocab", "llama", vocab_size=200, tokenizer=False)  # a drafter for another tokenizer
    return root


def assert_one_line(returncode: int, stderr: str, needle: str) -> None:
    lines = stderr.strip().splitlines()
    assert returncode == 2 and len(lines) == 1, (returncode, stderr)
    assert needle in lines[0] and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("name", list(BROKEN))
def test_generate_refuses_a_broken_checkpoint(capsys, checkpoints, name):
    res = cli(capsys, "generate", "--model", str(checkpoints / name), "--prompt", "x", "--max-tokens", "2")
    assert_one_line(res.returncode, res.stderr, NEEDLES[name])


@pytest.mark.parametrize("name", ["config_is_a_list", "negative_vocab", "truncated_weights"])
def test_a_real_process_prints_only_that_line(checkpoints, name):
    """Nothing else reaches stderr either: no library warning (transformers warned about a negative
    vocab_size before it crashed), no progress bar."""
    res = run("generate", "--model", str(checkpoints / name), "--prompt", "x", "--max-tokens", "2")
    assert_one_line(res.returncode, res.stderr, NEEDLES[name])


@pytest.mark.parametrize("name", ["config_is_a_list", "negative_vocab", "truncated_weights"])
def test_generate_refuses_a_broken_draft_checkpoint(capsys, checkpoints, name):
    res = cli(capsys, "generate", "--model", str(checkpoints / "good"), "--drafter", f"draft:{checkpoints / name}",
              "--prompt", "x", "--max-tokens", "2")
    assert_one_line(res.returncode, res.stderr, NEEDLES[name])


def test_generate_refuses_a_drafter_that_does_not_fit_the_target(capsys, checkpoints):
    res = cli(capsys, "generate", "--model", str(checkpoints / "good"), "--drafter", f"draft:{checkpoints / 'other_vocab'}",
              "--prompt", "x", "--max-tokens", "2")
    assert_one_line(res.returncode, res.stderr, "vocab_size 200")


@pytest.mark.parametrize("args, needle", [
    (["--model", "{root}/config_is_a_list"], "expected a JSON object"),
    (["--model", "{root}/negative_vocab"], "vocab_size=-5"),
    (["--model", "{root}/truncated_weights"], "corrupt or truncated"),
    (["--model", "{root}/good", "--drafter", "draft:{root}/other_vocab"], "vocab_size 200"),
    (["--model", "{root}/good", "--drafter", "draft:{root}/no_such_drafter"], "no_such_drafter"),
])
def test_serve_refuses_at_start_with_one_line(capsys, checkpoints, args, needle):
    res = cli(capsys, "serve", "--port", "0", *[a.replace("{root}", str(checkpoints)) for a in args])
    assert_one_line(res.returncode, res.stderr, needle)
