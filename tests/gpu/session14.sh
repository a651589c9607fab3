#!/usr/bin/env bash
# Device session (2×H200): the dispatcher with the register-operand prefill kernel wired in.
# GPU0: the whole GPU test file (the untimed defaults, QUICK_TUNE), then the prefill probe of the
# register-operand configurations at M = 2048. GPU1: the kernel benchmark, decode M = 1, prefill
# M = 2048 and mixed tenants T = 1…16 over the 70B layer set. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-2026-11-30-h200-rs
( export CUDA_VISIBLE_DEVICES=0
  DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout 240 python3 -m pytest -q -n 8 \
      -p no:cacheprovider tests/test_kernels_triton.py > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  PROBE_MS=2048 PROBE_SETS=rs timeout 150 python3 tests/gpu/prefill_gluon.py $R/prefill.json > $R/prefill.log 2>&1
  echo "prefill rc $?" >> $R/prefill.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 420 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1,2048] tenants=[1,2,4,8,16] \
      batched_impls=[lut,planes] bitdelta_style=false report_name=$NAME > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/$NAME* $R/ 2>/dev/null ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -3 $R/tests.log; grep "===\|rel err" $R/prefill.log | cut -c1-500; grep -v "^\[" $R/bench.log | tail -22
