"""A scratch package of numba functions, for tests whose real processes compile into a cache of their own: written
under a test's tmp_path, registered with `specserve.numba_cache` by its ``__init__`` (so cached per version of
its sources, as ours are), importable by processes started with `scratch_env`."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_REGISTER = """
    from pathlib import Path
    from specserve.numba_cache import register_package
    register_package(Path(__file__).parent)
    """


def write_scratch_package(tmp_path: Path, name: str, modules: dict[str, str]) -> Path:
    """tmp_path/name with `modules` (file name -> source, dedented) and an ``__init__`` registering it."""
    package = tmp_path / name
    package.mkdir()
    for file, source in {"__init__.py": _REGISTER, **modules}.items():
        (package / file).write_text(textwrap.dedent(source))
    return package


def scratch_env(tmp_path: Path) -> dict:
    """The environment of a process that imports scratch packages under tmp_path and caches into tmp_path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
            "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
