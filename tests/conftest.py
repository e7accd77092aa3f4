import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run only in Triton's interpreter, chosen when triton is imported: set it
# before anything imports triton (the `triton` attention backend's tests run in CI this way).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The default model (SmolLM2-135M-Instruct, fetched into the user's cache) stays out of the tests: they get an
# empty cache of their own, and pip no index, so a test that reached for the default model fails at once with
# the fetch's one-line error instead of downloading it. Tests use the tiny model (`"tiny"`) or build their own.
_TEST_CACHE = Path(tempfile.mkdtemp(prefix="specserve-test-cache-"))
os.environ["SPECSERVE_CACHE_DIR"] = str(_TEST_CACHE)
os.environ["PIP_NO_INDEX"] = "1"
# What runs when a test names no model (the CLI's and LLM()'s default): the tiny 9M code model.
os.environ["SPECSERVE_MODEL"] = "tiny"

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models helpers
# Tiny models gain nothing from threads, and one thread per test process avoids OpenMP spin-wait
# thrashing when other processes share the two cores.
torch.set_num_threads(1)

from tiny_models import build_model  # noqa: E402


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A 2-layer GQA Llama with a trained BPE tokenizer (random weights, scaled up so outputs vary)."""
    return build_model(tmp_path_factory.mktemp("llama"), "llama", init_std=0.2)


@pytest.fixture(scope="session")
def small_vocab_dir(tmp_path_factory) -> Path:
    """A Llama with a 16-token vocabulary and no tokenizer: random drafts often hit, sampling tests are cheap."""
    return build_model(tmp_path_factory.mktemp("small_vocab"), "llama", vocab_size=16, tokenizer=False, init_std=0.3)


@pytest.fixture(scope="session")
def near_draft_dir(small_vocab_dir, tmp_path_factory) -> Path:
    """`small_vocab_dir`'s weights plus noise, as a draft model: q close to p but not equal, so drafts are
    accepted often and rejected siblings matter (the regime where a wrong sibling distribution would show)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("near_draft")
    for name in ("config.json", "generation_config.json"):
        (out / name).write_text((small_vocab_dir / name).read_text())
    gen = torch.Generator().manual_seed(0)
    state = load_file(str(small_vocab_dir / "model.safetensors"))
    save_file({k: v + 0.15 * v.std() * torch.randn(v.shape, generator=gen) for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


BROWSER_TESTS = "tests/server/test_browser.py"
CHROMIUM = "/usr/bin/chromium"


def pytest_unconfigure(config):
    """Say loudly, after the last line of the run, that the chat page's browser tests did not run and what
    enables them: a `-ra` skip line among the others is easy to miss, and the page then goes untested."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or Path(CHROMIUM).exists():
        return
    skipped = [r for r in reporter.stats.get("skipped", []) if getattr(r, "nodeid", "").startswith(BROWSER_TESTS)]
    if not skipped:
        return
    reporter.write_sep("=", "the chat page was NOT tested", yellow=True, bold=True)
    reporter.write_line(f"{len(skipped)} browser tests ({BROWSER_TESTS}) were skipped: they drive Debian's chromium, "
                        f"which is not at {CHROMIUM}.")
    reporter.write_line("Enable them with:  sudo apt-get install -y chromium   (then run the tests again; .ci/run "
                        "does this)")
