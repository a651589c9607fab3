#!/usr/bin/env bash
# Device session (2×H200, about 6 minutes): the int8 tenant kernel with sign copies of 2 or 4 K steps
# (SK: 32 or 64 bytes of each sign row per copy, into a ring of two groups of its own; the row
# layout of the kernel contract is kept). GPU0: the int8 tenant-kernel GPU tests (every
# configuration), then the probe of every configuration and K split at T = 16 and 8. GPU1: the
# kernel benchmark at T = 1–16 over the 70B layer set, the dispatcher timing every configuration.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-tenants-sk-$(date +%F)-h200
( export CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k "tile_signs or planes or warp_specialised" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  timeout 300 python3 tests/gpu/planes_probe.py $R/planes.json 16 8 > $R/planes.log 2>&1
  echo "probe rc $?" >> $R/planes.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 440 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] tenants=[1,2,4,8,16] \
      batched_impls=[] bitdelta_style=false report_name=$NAME > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/$NAME* $R/ 2>/dev/null ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -2 $R/tests.log; grep "^T=\|rc " $R/planes.log | cut -c1-1500; grep -v "^\[20" $R/bench.log | tail -9
