#!/usr/bin/env bash
# Prepared for the next device session (2×H200, about 4 minutes): where the int8 tenant kernel spends
# its time at 16 variants on tiled signs (2.598× dense over the 70B layer set against a 2.20× target,
# reports/bench-kernels-tiled-rounds-2026-11-30-h200.*). ncu, full set, of one call on the 70B `o`
# shape (8192 × 8192) at the T = 16 default (128, 4, 4, 96, 2) with split 1 and 2, tiled and rows, and
# of dense bf16 at M = 16 for the memory-system baseline. Compare with the row-layout profile quoted in
# kernels/gluon_planes.py (issue slots 41 %, L2 72 %, DRAM 56 %).
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NCU="ncu --profile-from-start off --clock-control none --set full --print-details all"
( export CUDA_VISIBLE_DEVICES=0
  for sp in 1 2; do
    PLANES_TILED=1 PLANES_CFG=128,4,4,96,2,$sp timeout 150 $NCU python3 tests/gpu/profile_kernels.py planesws-T16 \
        > $R/ncu-planes-tiled-split$sp.txt 2>&1
  done ) &
( export CUDA_VISIBLE_DEVICES=1
  PLANES_CFG=128,4,4,96,2,1 timeout 150 $NCU python3 tests/gpu/profile_kernels.py planesws-T16 > $R/ncu-planes-rows-split1.txt 2>&1
  timeout 100 $NCU python3 tests/gpu/profile_kernels.py dense-M16 > $R/ncu-dense-M16.txt 2>&1 ) &
wait
tar czf $OUT/r.tgz -C /tmp r
for f in $R/ncu-*.txt; do echo "== $f"; grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|Memory Throughput|Achieved Occupancy" $f | head -8; done
