#!/usr/bin/env bash
# Device session (2×H200), last of the day: GPU0 the whole kernel test file on the GPU (8 workers);
# GPU1 the 7B serving benchmark with the int8 tensor-core tenant kernel as the untimed default
# (kernel_autotune: false), written under a new report name. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
( CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout ${TT:-400} \
    python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log ) &
( CUDA_VISIBLE_DEVICES=1 timeout ${TS:-400} python3 serve/bench.py machine=h200 \
    report_name=bench-serve-2026-11-30-h200-llama2-7b-14v-planes > $R/serve7b.log 2>&1
  echo "serve rc $?" >> $R/serve7b.log
  cp outputs/bench-serve/*/server.log $R/serve7b-server.log 2>/dev/null ) &
wait
cp reports/bench-serve-2026-11-30-h200-llama2-7b-14v-planes* $R/ 2>/dev/null
tar czf $OUT/r.tgz -C /tmp r
tail -4 $R/tests.log; tail -30 $R/serve7b.log
