"""`kernels.cache.drop_stale_entries`: numba's cache files of the kernels go when any kernel source changes.

numba validates a cached function against its own file only; a kernel that inlines another (the decoder
layer inlines the product) would keep the old code after the other's file changed. Checked on a scratch
package: cache files survive while the sources stay the same and are dropped when any one changes.
"""

from __future__ import annotations

from specserve.kernels.cache import drop_stale_entries, kernel_cache_dirs


def test_cache_files_are_dropped_when_any_source_changes(tmp_path):
    (tmp_path / "layer.py").write_text("def layer(): return product()\n")
    (tmp_path / "linear.py").write_text("def product(): return 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def fake_entries():
        for name in ("layer.layer-1.py311.nbi", "layer.layer-1.py311.1.nbc"):
            (cache / name).write_bytes(b"compiled")

    fake_entries()
    assert drop_stale_entries(tmp_path, [cache])  # no stamp yet: whatever is there may be stale
    assert not list(cache.glob("*.nb*"))
    fake_entries()
    assert not drop_stale_entries(tmp_path, [cache])  # same sources: kept
    assert len(list(cache.glob("*.nb*"))) == 2
    (tmp_path / "linear.py").write_text("def product(): return 2\n")  # a callee's file, not the layer's
    assert drop_stale_entries(tmp_path, [cache])
    assert not list(cache.glob("*.nb*"))
    fake_entries()
    assert not drop_stale_entries(tmp_path, [cache])
    assert (cache / "layer.layer-1.py311.nbi").exists()


def test_the_check_covers_where_numba_really_caches_the_kernels():
    import specserve.kernels  # noqa: F401  (imports every kernel module)
    from specserve.kernels.layer import decoder_layer

    dirs = kernel_cache_dirs()
    assert decoder_layer._cache._cache_path in [str(d) for d in dirs]
