#!/usr/bin/env bash
# Device session (2×H200, last 7 device-minutes): session19's benchmark stopped after T = 2 at the
# gate_up layer. GPU0: every int8 tenant-kernel configuration and K split at T = 2 on gate_up, then
# qkv, each announced and synchronised (tests/gpu/hang_probe.py). GPU1: the benchmark at T = 4, 8, 16.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-tenants-sk-$(date +%F)-h200
( export CUDA_VISIBLE_DEVICES=0
  timeout 60 python3 tests/gpu/hang_probe.py 57344 8192 2 > $R/hang.log 2>&1; echo "rc $?" >> $R/hang.log
  timeout 40 python3 tests/gpu/hang_probe.py 10240 8192 2 > $R/hang2.log 2>&1; echo "rc $?" >> $R/hang2.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 250 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] tenants=[4,8,16] \
      batched_impls=[] bitdelta_style=false report_name=$NAME > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/$NAME* $R/ 2>/dev/null ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -3 $R/hang.log; tail -2 $R/hang2.log; grep -v "^\[20" $R/bench.log | tail -12
