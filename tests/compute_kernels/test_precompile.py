"""`specserve.kernels.precompile`: a signature compiled in a child process lands in numba's cache, and the parent
then loads it from there instead of compiling it; a cached signature starts no child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from scratch_numba import scratch_env, write_scratch_package

_MODULES = {
    "product.py": """
        import numba

        @numba.njit(cache=True)
        def scaled_sum(x, factor):
            total = 0.0
            for v in x:
                total += v * factor
            return total
        """,
}
# In a process of its own (the child must import the scratch package too): float32 rows are compiled elsewhere,
# then called here; float64 ones were never compiled.
_DRIVER = """
    import numpy as np
    from scratchprecompile.product import scaled_sum
    from specserve.kernels.precompile import compile_elsewhere, is_cached
    import numba

    rows = np.arange(4, dtype=np.float32)
    signature = (numba.typeof(rows), numba.typeof(2.0))
    assert is_cached(scaled_sum, signature) is False
    job = compile_elsewhere(scaled_sum, (rows, 2.0))
    assert job is not None
    job.wait()
    assert is_cached(scaled_sum, signature) is True
    assert scaled_sum(rows, 2.0) == 12.0
    print("loaded from the cache:", scaled_sum.stats.cache_hits.get(signature, 0) == 1)
    print("another child for a cached signature:", compile_elsewhere(scaled_sum, (rows, 3.0)) is not None)
    print("float64 cached:", is_cached(scaled_sum, (numba.typeof(rows.astype(np.float64)), numba.typeof(2.0))))
    """


def test_a_signature_compiled_in_a_child_is_loaded_from_the_cache(tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: compile_elsewhere starts no child there")
    write_scratch_package(tmp_path, "scratchprecompile", _MODULES)
    (tmp_path / "driver.py").write_text(textwrap.dedent(_DRIVER))
    done = subprocess.run([sys.executable, str(tmp_path / "driver.py")], env=scratch_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["loaded from the cache: True", "another child for a cached signature: False",
                                        "float64 cached: False"], done.stdout
