#!/usr/bin/env bash
# Device session prepared for the next run (2×H200, about 8 minutes), on branch tiled-signs: every
# kernel reading signs in kernels.tile_signs' layout. GPU0: the tiled-sign GPU tests (Triton kernels,
# both Hopper prefill kernels at every usable configuration, the dispatcher's int8 tenant path), then
# the row-layout Gluon tests as a regression check. GPU1: the kernel benchmark on tiled signs at
# M = 1 and 2048 and T = 1–16 over the 70B layer set (compare with
# reports/bench-kernels-tenants-loaders-2026-11-30-h200.* and bench-kernels-prefill-2026-11-30-h200-rs.*).
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-tiled-$(date +%F)-h200
( export CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_tiled.py > $R/tests-tiled.log 2>&1
  echo "tests rc $?" >> $R/tests-tiled.log
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k "planes or gluon_prefill or warp_specialised" > $R/tests-rows.log 2>&1
  echo "tests rc $?" >> $R/tests-rows.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 480 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1,2048] tenants=[1,2,4,8,16] \
      batched_impls=[] bitdelta_style=false sign_layout=tiled report_name=$NAME > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/$NAME* $R/ 2>/dev/null ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -2 $R/tests-tiled.log $R/tests-rows.log; grep -v "^\[20" $R/bench.log | tail -12
