#!/usr/bin/env bash
# Device session (2×H200, last 6 device-minutes): session14 hung in the PRE configuration with
# STAGES = U (a loop body waited for a ring stage it had not released yet; now refused and removed).
# GPU0: the Gluon prefill GPU tests, then the rest of the GPU test file. GPU1: the kernel benchmark
# at prefill M = 2048 over the 70B layer set, the dispatcher timing every prefill candidate.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-prefill-2026-11-30-h200-rs
( export CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 60 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k gluon_prefill > $R/tests1.log 2>&1
  echo "tests rc $?" >> $R/tests1.log
  timeout 160 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k "not gluon_prefill" > $R/tests2.log 2>&1
  echo "tests rc $?" >> $R/tests2.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 225 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[2048] tenants=[1] \
      batched_impls=[] bitdelta_style=false report_name=$NAME > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/$NAME* $R/ 2>/dev/null ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -2 $R/tests1.log; tail -2 $R/tests2.log; grep -v "^\[20" $R/bench.log | tail -12
