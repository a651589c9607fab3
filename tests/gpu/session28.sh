#!/usr/bin/env bash
# Branch bits (2×H200, about 8 minutes): the kernel benchmark with the dispatcher timing the binary
# tensor-core variants too (bits, bits + programmatic dependent launch, bits + base spread), tiled
# signs, M = 1 and 2048, T = 1–16, 3 rounds, on GPU0; the kernel GPU tests on GPU1 meanwhile.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-bits-rounds-$(date +%F)-h200
( CUDA_VISIBLE_DEVICES=0 timeout 460 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1,2048] \
    tenants=[1,2,4,8,16] batched_impls=[] bitdelta_style=false sign_layout=tiled rounds=3 report_name=$NAME \
    > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/$NAME* $R/ 2>/dev/null ) &
( export CUDA_VISIBLE_DEVICES=1 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 440 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py tests/test_kernels_tiled.py \
      > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -n 30 $R/tests.log | grep -E "passed|failed|FAILED|Error|rc " | head -20
grep -v "^\[20" $R/bench.log | grep -v "^\[ " | tail -n 16
