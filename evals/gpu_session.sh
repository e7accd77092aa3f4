#!/bin/bash
# One lent-GPU session's checks in one call: the CUDA tests, then `specserve bench gpu`.
#
# The device machine has torch, triton, transformers, numba, aiohttp, hypothesis, pytest but no package
# registry: carry the rest as cp312 wheels in .whl/ (ignored by git), made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
#     websockets llguidance jsonschema jsonschema-specifications referencing rpds-py aiohttp-sse
# and run (device tool, carry [".whl"]):  bash evals/gpu_session.sh PYTEST_SECONDS BENCH_SECONDS [bench gpu args]
# SERIAL=1 runs the tests before the benchmark (on one GPU they time-slice each other otherwise: figures
# from a parallel run are not figures); PYTEST_TESTS overrides the test list. First used 2026-11-27
# (BENCHMARKS.md, "GPU path, first figures"): setup 15 s, tests ~60 s, bench gpu ~100 s with --no-compile.
export PYTHONUNBUFFERED=1
PYTEST_S=${1:-150}; BENCH_S=${2:-200}; shift 2
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "== setup $(( $(date +%s)-t0 )) s"
( timeout $PYTEST_S python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 90 \
    ${PYTEST_TESTS:-tests/engine/test_gpu.py tests/compute_kernels/test_triton_attention.py tests/engine/test_triton_backend.py \
    tests/engine/test_cuda_graphs.py tests/engine/test_step_runner.py tests/evals/test_bench_gpu.py} \
    > $OUT/pytest.log 2>&1; echo "pytest rc $?" >> $OUT/pytest.log ) &
PYTEST_PID=$!
if [ "${SERIAL:-0}" = 1 ]; then wait $PYTEST_PID; fi
timeout $BENCH_S specserve bench gpu --json $OUT/gpu.json --markdown $OUT/gpu.md "$@" > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
wait $PYTEST_PID
echo "== total $(( $(date +%s)-t0 )) s"
echo "---- pytest (tail)"; tail -c 4000 $OUT/pytest.log
echo "---- bench (tail)"; tail -c 6000 $OUT/bench.log
