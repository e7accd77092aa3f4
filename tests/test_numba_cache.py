"""`specserve.numba_cache`: numba caches our functions in one directory per version of their sources.

numba validates a cached function against its own file only; a kernel that calls another (the decoder layer
calls the product) would keep the old code after the other's file changed. The end-to-end test runs the race
that broke the earlier scheme, with real numba processes on a scratch package: a process started on the old
sources compiles after a newer one has run, and a third run on the new sources must not load its kernel. And
two processes saving one function's signatures at once each keep their own machine code (`lock_cache_index`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from scratch_numba import REPO, scratch_env, write_scratch_package

from specserve.numba_cache import KEEP_VERSIONS, package_dir, prune_other_versions, source_digest


def test_the_digest_covers_every_source_of_the_package(tmp_path):
    (tmp_path / "layer.py").write_text("def layer(): return product()\n")
    (tmp_path / "linear.py").write_text("def product(): return 1\n")
    first = source_digest(tmp_path)
    assert source_digest(tmp_path) == first
    (tmp_path / "linear.py").write_text("def product(): return 2\n")  # a callee's file, not the layer's
    assert source_digest(tmp_path) != first


def test_the_kernels_are_cached_under_their_sources_digest():
    import specserve.kernels
    from specserve.kernels.layer import decoder_layer

    package = Path(specserve.kernels.__file__).resolve().parent
    assert Path(decoder_layer._cache._cache_path).name == "sources-" + source_digest(package)


def test_a_package_calling_another_s_functions_is_versioned_by_both_sources():
    from specserve.drafters import medusa_tree

    cached = [f for f in vars(medusa_tree).values() if getattr(f, "_cache", None) is not None
              and type(f._cache).__name__ != "NullCache"]
    assert cached
    versions = {Path(f._cache._cache_path).name for f in cached}
    assert versions == {"sources-" + source_digest(package_dir("specserve.drafters"), package_dir("specserve.verify"))}


def test_pruning_keeps_this_version_and_the_most_recently_used_others(tmp_path):
    base = tmp_path / "__pycache__"
    versions = []
    for age in range(6):  # sources-v0 used most recently, sources-v5 longest ago
        directory = base / f"sources-v{age}"
        directory.mkdir(parents=True)
        (directory / "layer.decoder_layer-1.py311.nbi").write_bytes(b"index")
        stamp = time.time() - 3600 * (age + 1)
        os.utime(directory, (stamp, stamp))
        versions.append(directory)
    legacy = [base / "layer.decoder_layer-1.py311.nbi", base / "layer.decoder_layer-1.py311.1.nbc",
              base / "kernel-sources.sha1"]
    for path in legacy:
        path.write_bytes(b"old scheme")
    (base / "layer.cpython-311.pyc").write_bytes(b"bytecode")  # Python's own: not numba's to delete
    current = base / "sources-new"

    deleted = prune_other_versions(current)

    kept = sorted(d.name for d in base.glob("sources-*"))
    assert kept == sorted(["sources-new"] + [f"sources-v{i}" for i in range(KEEP_VERSIONS - 1)])
    assert set(deleted) == set(versions[KEEP_VERSIONS - 1:]) | set(legacy)
    assert (base / "layer.cpython-311.pyc").exists()
    assert prune_other_versions(current) == []  # nothing left to delete


_KERNELS = {
    "layer.py": """
        import numba
        from scratchkernels.linear import product

        @numba.njit(cache=True)
        def layer(x):
            return product(x) + 1
        """,
}
_PRODUCT = """
    import numba

    @numba.njit
    def product(x):
        return x * {factor}
    """
# Imports the scratch kernels (their sources' digest is taken then), waits for the go file, then compiles.
_RUNNER = """
    import sys, time
    from pathlib import Path
    import scratchkernels.layer as layer
    go = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if go is not None:
        Path(str(go) + ".ready").touch()
        while not go.exists():
            time.sleep(0.05)
    print(layer.layer(10))
    """


def _write_product(package: Path, factor: int) -> None:
    (package / "linear.py").write_text(textwrap.dedent(_PRODUCT.format(factor=factor)))


def _run(tmp_path: Path) -> int:
    done = subprocess.run([sys.executable, str(tmp_path / "runner.py")], env=scratch_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_a_process_on_old_sources_never_feeds_a_newer_version_its_kernels(tmp_path):
    package = write_scratch_package(tmp_path, "scratchkernels", _KERNELS)
    (tmp_path / "runner.py").write_text(textwrap.dedent(_RUNNER))
    _write_product(package, 2)
    assert _run(tmp_path) == 21  # compiled and cached: 10 * 2 + 1

    go = tmp_path / "go"
    old = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(go)], env=scratch_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not Path(str(go) + ".ready").exists():  # it has imported the old sources
            assert old.poll() is None and time.monotonic() < deadline, old.communicate()
            time.sleep(0.05)
        # The upgrade lands while it runs: only the callee's file changes, which numba does not check.
        (tmp_path / "numba-cache").rename(tmp_path / "numba-cache-old")  # the old process gets no cached kernel
        _write_product(package, 3)
        assert _run(tmp_path) == 31  # the new sources, compiled and cached
        go.touch()  # now the old process compiles the old sources and saves them
        out, err = old.communicate(timeout=300)
        assert old.returncode == 0, err
        assert int(out.split()[-1]) == 21
    finally:
        old.kill()
    assert _run(tmp_path) == 31  # still the new kernel: the old one went to its own version's directory


def test_the_kernels_a_forward_runs_are_cached_on_disk(small_vocab_dir):
    """numba refuses to cache a kernel that reads a ctypes pointer (numba.get_num_threads() inside a kernel did
    that to paged attention and the decoder layer: every start compiled them again, minutes on 2 cores). A kernel
    it refused has no index on disk after it ran."""
    from specserve import LLM, SamplingParams
    from specserve.kernels.cache import missing_from_cache

    LLM(small_vocab_dir, device="cpu").generate([[3, 1, 4]], SamplingParams(max_tokens=2, temperature=0.0))
    missing = missing_from_cache(quantized=False)
    for kernel in ("decoder_layer", "paged_attention", "visible_slots", "rms_norm"):
        assert kernel not in missing


# Child side of `_start_together`: announce this child is ready, then wait for the moment the parent names.
_WAIT_FOR_GO = """
import os, time


def wait_for_go(go, name, after=0.0):
    open(go + "." + name + ".ready", "w").close()  # imported: the parent then names the moment all start
    while not os.path.exists(go):
        time.sleep(0.005)
    with open(go) as f:
        start = float(f.read()) + after
    time.sleep(max(start - time.time(), 0))
"""


def _start_together(children: list[subprocess.Popen], go: Path, names) -> None:
    """Once every child has written ``<go>.<name>.ready`` (each has imported what it needs), write `go`: the
    moment, 0.3 s ahead, at which they all start (`_WAIT_FOR_GO`)."""
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.{name}.ready").exists() for name in names):
        assert all(c.poll() is None for c in children) and time.monotonic() < deadline, [c.communicate() for c in children]
        time.sleep(0.01)
    Path(f"{go}.tmp").write_text(str(time.time() + 0.3))
    Path(f"{go}.tmp").rename(go)  # whole when it appears


_SAVER = _WAIT_FOR_GO + """
import json, sys
import specserve.numba_cache as numba_cache

locked, cache_dir, key, go, delays = sys.argv[1] == "locked", sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
if locked:
    numba_cache.lock_cache_index()
cache_file_class = numba_cache._numba_class("IndexDataCacheFile")

# Pauses inside numba's own steps of a save (read the index, write it, write the data file): what a slow disk or a
# busy core does, placed to reach the interleaving that breaks an unlocked save.
load_index, save_data = cache_file_class._load_index, cache_file_class._save_data
def slow_load_index(self):
    overloads = load_index(self)
    time.sleep(delays.get("after_reading_the_index", 0))
    return overloads
def slow_save_data(self, name, data):
    time.sleep(delays.get("before_writing_the_data", 0))
    save_data(self, name, data)
cache_file_class._load_index, cache_file_class._save_data = slow_load_index, slow_save_data

cache_file = cache_file_class(cache_path=cache_dir, filename_base="scratch.kernel-1.py3", source_stamp=(1.0, 2))
wait_for_go(go, key, delays.get("start_after", 0))
cache_file.save(key, "machine code of " + key)
"""


def _save_at_once(tmp_path, locked: bool) -> dict:
    """Two processes save two signatures of one function into one version's directory at once; what each key
    then loads."""
    import json

    from specserve.numba_cache import _numba_class

    cache_dir = tmp_path / ("locked" if locked else "unlocked") / "sources-0123456789abcdef"
    cache_dir.mkdir(parents=True)
    go = cache_dir.parent / "go"
    # A reads the empty index (t = 0), then B does (0.2 s); A writes its index (1.5 s), then B (2.2 s: B's wins, B's
    # signature -> data file 1); B writes data file 1 (2.2 s), then A overwrites it with its own code (4.5 s).
    # Every step is at least 0.7 s from the one it must follow or precede.
    plans = {"signature A": {"after_reading_the_index": 1.5, "before_writing_the_data": 3.0},
             "signature B": {"start_after": 0.2, "after_reading_the_index": 2.0}}
    children = [subprocess.Popen([sys.executable, "-c", _SAVER, "locked" if locked else "unlocked", str(cache_dir), key,
                                  str(go), json.dumps(plan)],
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
                 for key, plan in plans.items()]
    _start_together(children, go, plans)
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    cache_file = _numba_class("IndexDataCacheFile")(cache_path=str(cache_dir), filename_base="scratch.kernel-1.py3",
                                                    source_stamp=(1.0, 2))
    return {key: cache_file.load(key) for key in plans}


def test_two_processes_saving_one_function_at_once_keep_each_signature_s_own_code(tmp_path):
    """numba's save is read-index, pick-a-number, write-index, write-data: unlocked, the interleaving above leaves
    signature B's entry naming A's machine code (a kernel that would run on B's arguments). Under
    `lock_cache_index` the second save waits for the first and takes the next number."""
    unlocked = _save_at_once(tmp_path, locked=False)
    assert unlocked["signature B"] == "machine code of signature A"  # the race is real, and this reaches it
    assert _save_at_once(tmp_path, locked=True) == {"signature A": "machine code of signature A",
                                                    "signature B": "machine code of signature B"}


# A caller of a parallel kernel, cached, compiled by a process that loaded the kernel from the cache instead of
# compiling it (numba/numba#4807, #8578): a later process loading the caller from the cache called a null pointer.
_PARALLEL_KERNEL = """
    import numba
    from numba import prange
    from specserve.numba_cache import CALLS_PARALLEL_KERNELS


    @numba.njit(parallel=True, cache=True)
    def kernel(x, out, flag):
        for i in prange(x.shape[0]):
            out[i] = x[i] * 2.0 + (1.0 if flag else 0.0)


    @numba.njit(cache=True)
    def plain_caller(x, out, flag):
        kernel(x, out, flag)


    @numba.njit(parallel=CALLS_PARALLEL_KERNELS, cache=True)
    def caller(x, out, flag):
        kernel(x, out, flag)
    """

_CALL = """
import sys, warnings
import numpy as np
warnings.simplefilter("error")  # the parallel-mode caller must not warn (`register_package` quiets it)
import scratchpar.kernels as k
x, out = np.ones(10), np.zeros(10)
getattr(k, sys.argv[1])(x, out, False)
print(out[0])
"""


def _call_in_a_process(tmp_path: Path, function: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CALL, function], env=scratch_env(tmp_path), cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_caller_of_a_parallel_kernel_compiled_against_its_cached_code_loads_and_runs(tmp_path):
    write_scratch_package(tmp_path, "scratchpar", {"kernels.py": _PARALLEL_KERNEL})
    first = _call_in_a_process(tmp_path, "kernel")  # compiles and caches the parallel kernel alone
    assert first.returncode == 0 and first.stdout.split() == ["2.0"], first.stderr
    for function in ("caller", "plain_caller"):
        compiled = _call_in_a_process(tmp_path, function)  # compiles the caller against the kernel's cached code
        assert compiled.returncode == 0 and compiled.stdout.split() == ["2.0"], compiled.stderr
    loaded = _call_in_a_process(tmp_path, "caller")  # loads the caller from the cache
    assert loaded.returncode == 0 and loaded.stdout.split() == ["2.0"], loaded.stderr
    # The same steps with a plain `njit` caller crash with numba 0.68 (SIGSEGV, tried): what the test guards against.
    plain = _call_in_a_process(tmp_path, "plain_caller")
    assert plain.returncode in (0, -11), plain.stderr


# A kernel that takes a second or more to compile (parallel loops: numba's parfor passes), so two processes started
# together are both inside its compile unless one waits for the other.
_SLOW_TO_COMPILE = """
    import numba
    import numpy as np
    from numba import prange


    @numba.njit(parallel=True, cache=True)
    def kernel(x, out):
        for i in prange(x.shape[0]):
            out[i] = np.sin(x[i]) * 2.0
        for i in prange(x.shape[0]):
            out[i] += np.sqrt(abs(x[i])) + np.cos(out[i])
        for i in prange(x.shape[0]):
            out[i] = out[i] * out[i] - np.tanh(x[i])
        total = 0.0
        for i in prange(x.shape[0]):
            total += out[i]
        return total
    """

_COMPILE_AT = _WAIT_FOR_GO + """
import sys
import numpy as np
import scratchslow.kernels as k
if sys.argv[1] == "unlocked":  # numba's own compile, for the test's proof that the race is reached
    from numba.core.dispatcher import Dispatcher
    Dispatcher.compile = Dispatcher.compile.__wrapped__
wait_for_go(sys.argv[2], sys.argv[3])
k.kernel(np.ones(8), np.zeros(8))
print(sum(k.kernel.stats.cache_misses.values()), sum(k.kernel.stats.cache_hits.values()))
"""


def _compile_at_once(tmp_path: Path, locked: bool) -> list[tuple[int, int]]:
    """Two processes call one uncached kernel at the same moment; each one's (signatures compiled, loaded)."""
    root = tmp_path / ("locked" if locked else "unlocked")
    root.mkdir()
    write_scratch_package(root, "scratchslow", {"kernels.py": _SLOW_TO_COMPILE})
    go = root / "go"
    children = [subprocess.Popen([sys.executable, "-c", _COMPILE_AT, "locked" if locked else "unlocked", str(go), name],
                                 env=scratch_env(root), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for name in ("a", "b")]
    _start_together(children, go, ("a", "b"))
    counts = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        counts.append(tuple(int(n) for n in out.split()))
    return counts


def test_two_processes_compiling_one_signature_at_once_compile_it_once(tmp_path):
    """numba compiles a signature it finds in no cache, whoever else is compiling it: unlocked, both processes do.
    Under `lock_compiles` the second waits for the first and loads its code."""
    assert _compile_at_once(tmp_path, locked=False) == [(1, 0), (1, 0)]  # the race is real, and this reaches it
    assert sorted(_compile_at_once(tmp_path, locked=True)) == [(0, 1), (1, 0)]
