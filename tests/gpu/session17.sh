#!/usr/bin/env bash
# Device session (2×H200, about 7 minutes): the int8 tenant kernel with 2 or 4 loader warps sharing
# out the TMA copies of a K step (22 at 16 rows; one warp issued them all before), and K steps of
# 256 with four consumer warpgroups. GPU0: the int8 tenant-kernel GPU tests (every configuration,
# with and without programmatic dependent launch), then the probe of every configuration and K split
# at T = 4, 8, 16. GPU1: the kernel benchmark at T = 1–16 over the 70B layer set, the dispatcher
# timing every configuration at K splits 1–8. Results in $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-tenants-loaders-$(date +%F)-h200
( export CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k "planes or warp_specialised" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  timeout 330 python3 tests/gpu/planes_probe.py $R/planes.json 4 8 16 > $R/planes.log 2>&1
  echo "probe rc $?" >> $R/planes.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 420 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] tenants=[1,2,4,8,16] \
      batched_impls=[] bitdelta_style=false report_name=$NAME > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/$NAME* $R/ 2>/dev/null ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -2 $R/tests.log; grep "^T=\|rc " $R/planes.log | cut -c1-900; grep -v "^\[20" $R/bench.log | tail -10
