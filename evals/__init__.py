"""Acceptance and speed evaluation, benchmarks."""

from pathlib import Path

from specserve.numba_cache import package_dir, register_package

register_package(Path(__file__).parent, package_dir("specserve.kernels"))  # roofline inlines the kernels


