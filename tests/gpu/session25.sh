#!/usr/bin/env bash
# Device session (2×H200, about 9 minutes), main after the tiled-sign merge (tiled is the serving
# default). In parallel: GPU0 the kernels' whole GPU test files (row and tiled layouts); GPU1 the
# CUDA-graph serving check (tests/gpu/check_serve_graphs.py: engine and DeltaSlots now tiled by
# default). Then, alone on GPU0: the kernel benchmark on rows, 3 rounds, to set beside session24's
# tiled run (reports/bench-kernels-tiled-rounds-2026-11-30-h200.*) under the same conditions.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py tests/test_kernels_tiled.py \
      > $R/tests-kernels.log 2>&1
  echo "tests rc $?" >> $R/tests-kernels.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 220 python3 tests/gpu/check_serve_graphs.py $R/serve-graphs.json > $R/serve-graphs.log 2>&1
  echo "graphs rc $?" >> $R/serve-graphs.log ) &
wait
NAME=bench-kernels-rows-rounds-$(date +%F)-h200
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1,2048] \
    tenants=[1,2,4,8,16] batched_impls=[] bitdelta_style=false sign_layout=rows rounds=3 report_name=$NAME \
    > $R/bench.log 2>&1
echo "bench rc $?" >> $R/bench.log
cp reports/$NAME* $R/ 2>/dev/null
tar czf $OUT/r.tgz -C /tmp r
tail -n 3 $R/tests-kernels.log; tail -n 6 $R/serve-graphs.log; grep -v "^\[20" $R/bench.log | grep -v "^\[ " | tail -n 14
