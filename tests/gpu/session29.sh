#!/usr/bin/env bash
# Branch bits (2×H200, about 7 minutes), after session28 found the bit-plane kernel failing to compile
# for K > 1024 (a loop-carried name reused at another block size) and K not a power of two (its chunk):
# the kernel benchmark with the dispatcher timing the binary variants (GPU0), and the int8 / binary
# tenant kernels' GPU tests with the bit-plane test (GPU1; session28 ran the rest: 92 passed).
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-bits-rounds-$(date +%F)-h200
( CUDA_VISIBLE_DEVICES=0 timeout 400 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1,2048] \
    tenants=[1,2,4,8,16] batched_impls=[] bitdelta_style=false sign_layout=tiled rounds=3 report_name=$NAME \
    > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/$NAME* $R/ 2>/dev/null ) &
( export CUDA_VISIBLE_DEVICES=1 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k "planes_tenants or bitplanes" \
      > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log ) &
wait
tail -n 30 $R/tests.log | grep -E "passed|failed|FAILED|Error|rc " | head -20
grep -v "^\[20" $R/bench.log | grep -v "^\[ " | tail -n 16
