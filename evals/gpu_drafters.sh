#!/bin/bash
# The default model's EAGLE-3 head made on a lent GPU in two calls: `train feature-data` and `train eagle`, the
# same commands as on the CPU (training/README.md), with --device cuda.
#
# Why two calls: a call carries at most 64 MiB (the working tree included) and the default model's file is 98 MB.
# So the file travels in two halves to one warm machine (it goes back 30 s after a call ends: send the second at
# once), with the tracked checkpoints the run does not need left out of the tree (a throwaway branch without them).
# Here, once:
#   echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu
#   split -n 2 -d "$SPECSERVE_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf" .gpu/model.part   # part00, part01
#   (and the wheels of evals/gpu_session.sh plus gguf in .whl/)
# Calls (device tool):
#   1. carry [".whl", ".gpu/model.part00"]   bash evals/gpu_drafters.sh receive
#   2. carry [".gpu/model.part01"]           bash evals/gpu_drafters.sh train DATA_MINUTES STEPS [DEADLINE_S]
#   3. (optional, at once: the data is still in /tmp/runs/features) `specserve train eagle --data /tmp/runs/features
#      --device cuda ...` with more steps or other settings, copying the head to $OUT.
# Rates on an H200 (2026-12-04): data 5,160 rows/s (the 7,844 prompts ~5 minutes); training batches of 32 ~0.9 s a
# step for the first ~100 steps, then ~0.15 s.
# What comes back under $OUT: the head (eagle_head.safetensors, eagle_config.json), its train_log.jsonl and
# train_summary.json, the data's feature_manifest.json and the run's log.
export PYTHONUNBUFFERED=1
export SPECSERVE_CACHE_DIR=/tmp/ssc
MODEL=$SPECSERVE_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf
t0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s)-t0 )) s"; }

install() {
    python3 -c "import gguf, specserve" 2>/dev/null && return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; return 1; }
}
export PYTHONPATH=/tmp/site

case "$1" in
receive)
    install || exit 1
    mkdir -p /tmp/parts && cp .gpu/model.part00 /tmp/parts/ || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    stamp "received $(du -b /tmp/parts/model.part00 | cut -f1) bytes"
    ;;
train)
    # DEADLINE: seconds after this call starts by which the head must be under $OUT (the call's limit, less a margin)
    DATA_MIN=${2:-5}; STEPS=${3:-2000}; DEADLINE=${4:-570}
    install || exit 1
    mkdir -p "$(dirname $MODEL)"
    cat /tmp/parts/model.part00 .gpu/model.part01 > $MODEL || exit 1
    SHA256=$(python3 -c "from specserve.loading.default_model import SHA256; print(SHA256)")
    echo "$SHA256  $MODEL" | sha256sum -c - || exit 1
    stamp "model assembled"
    FEATURES=/tmp/runs/features; HEAD=/tmp/runs/eagle
    # Every kind of question over the standard library's train split (7,844 prompts), batches of 256 on the GPU,
    # float32 (features nearer the CPU kernels' that serve the head); if that fails, bfloat16, then the CPU kernels
    # on this machine's 16 cores: the same data either way.
    DATA_ARGS="--out $FEATURES --every-kind --num-prompts 7844 --max-minutes $DATA_MIN --force"
    for try in "--device cuda --dtype float32 --gen-batch-size 256" "--device cuda --gen-batch-size 256" \
               "--device cpu --threads 16 --gen-batch-size 64"; do
        echo "== feature-data $try" >> $OUT/run.log
        specserve train feature-data $DATA_ARGS $try >> $OUT/run.log 2>&1 && break
        echo "feature-data $try failed"; tail -c 2500 $OUT/run.log | tr '\r' '\n' | tail -20
    done
    [ -f $FEATURES/feature_manifest.json ] || exit 1
    cp $FEATURES/feature_manifest.json $OUT/
    stamp "feature data"; grep "^feature data" $OUT/run.log
    # STEPS is given, not calibrated: a short calibration measures the GPU's warm-up (on an H200 the first ~100
    # steps ran at ~0.9 s a step, later ones ~0.15 s: BENCHMARKS.md, 2026-12-04). The deadline stops it cleanly.
    EAGLE_ARGS="--data $FEATURES --device cuda --draft-vocab 4096 --batch-size 32 --lr 2e-3 --ttt-steps 5"
    LEFT_MIN=$(python3 -c "print(round(max(0.5, ($DEADLINE - ($(date +%s) - $t0) - 30) / 60), 2))")
    stamp "training $STEPS steps, at most $LEFT_MIN minutes"
    specserve train eagle $EAGLE_ARGS --out $HEAD --max-steps $STEPS --max-minutes $LEFT_MIN >> $OUT/run.log 2>&1 \
        || { tail -30 $OUT/run.log; exit 1; }
    stamp "trained"
    cp $HEAD/eagle_head.safetensors $HEAD/eagle_config.json $HEAD/train_log.jsonl $HEAD/train_summary.json $OUT/
    tail -c 3000 $OUT/run.log | tr '\r' '\n' | tail -25
    ;;
*)
    echo "usage: bash evals/gpu_drafters.sh receive | train DATA_MINUTES STEPS [DEADLINE_S]"; exit 2
    ;;
esac
