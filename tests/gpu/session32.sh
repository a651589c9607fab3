#!/usr/bin/env bash
# Session 2026-11-30 (eighth; 2×H200, about 9.5 minutes), main with branch persist merged: the closing
# benchmark of issue 5 on GPU0 (tests/gpu/session31.sh: the dispatcher timing int8, bits, bits + PDL,
# bits + spread, persistent and stream-K), and on GPU1, niced, the tenant kernels' GPU tests with the
# persistent / stream-K cases (session30 ran out of time after 14 of 21).
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=1 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  nice -n 19 timeout 560 python3 -m pytest -q -rf -n 8 -p no:cacheprovider tests/test_kernels_triton.py \
      -k "planes_tenants or bitplanes or ws_slots or refuses" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log ) &
bash tests/gpu/session31.sh
wait
grep -E "passed|failed|FAILED|rc " $R/tests.log | head -20
