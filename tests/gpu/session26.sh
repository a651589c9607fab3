#!/usr/bin/env bash
# Prepared for the next device session (2×H200, about 8 minutes), on branch base-spread: where the int8
# tenant kernel spends its time at 16 variants on tiled signs (2.598× dense over the 70B layer set
# against a 2.20× target, reports/bench-kernels-tiled-rounds-2026-11-30-h200.*), and whether spreading
# the base product over the consumers (base_spread: 2 instead of 8 base wgmmas per consumer and K step
# at 16 rows, offline compile) helps.
# GPU0: ncu (full set) of one call on the 70B `o` shape at the T = 16 default (128, 4, 4, 96, 2),
#       split 1: tiled, tiled + base_spread, rows; and dense bf16 at M = 16.
# GPU1: the int8 kernel's GPU tests (with the base_spread cases), then the probe at T = 8 and 16 on
#       tiled signs with and without base_spread (PROBE_TILED=1 PROBE_BASE_SPREAD=1).
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NCU="ncu --profile-from-start off --clock-control none --set full --print-details all"
( export CUDA_VISIBLE_DEVICES=0
  PLANES_TILED=1 PLANES_CFG=128,4,4,96,2,1 timeout 120 $NCU python3 tests/gpu/profile_kernels.py planesws-T16 \
      > $R/ncu-planes-tiled.txt 2>&1
  PLANES_TILED=1 PLANES_BS=1 PLANES_CFG=128,4,4,96,2,1 timeout 120 $NCU python3 tests/gpu/profile_kernels.py planesws-T16 \
      > $R/ncu-planes-tiled-bs.txt 2>&1
  PLANES_CFG=128,4,4,96,2,1 timeout 120 $NCU python3 tests/gpu/profile_kernels.py planesws-T16 > $R/ncu-planes-rows.txt 2>&1
  timeout 90 $NCU python3 tests/gpu/profile_kernels.py dense-M16 > $R/ncu-dense-M16.txt 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k "planes_tenants" \
      > $R/tests-planes.log 2>&1
  echo "tests rc $?" >> $R/tests-planes.log
  PROBE_TILED=1 PROBE_BASE_SPREAD=1 timeout 280 python3 tests/gpu/planes_probe.py $R/probe-bs.json 8 16 \
      > $R/probe-bs.log 2>&1
  echo "probe rc $?" >> $R/probe-bs.log ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -n 3 $R/tests-planes.log; grep -E "^T=" $R/probe-bs.log | cut -c1-600
for f in $R/ncu-*.txt; do echo "== $f"; grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|Compute \(SM\) Throughput|Achieved Occupancy" $f | head -8; done
