#!/usr/bin/env bash
# Device session (2×H200, about 6 minutes): the int8 tenant kernel reading sign tiles stored whole
# (gluon_planes.tile_signs: one K step's 64 × BK/8 bytes in one piece, instead of 64 pieces of 16 or
# 32 bytes a sign row apart), against the row layout. GPU0: the int8 tenant-kernel GPU tests (tiled
# cases included), then the probe at T = 16. GPU1: the probe at T = 8 and 4. Results in $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1 PROBE_TILED=1
( export CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k "tile_signs or planes or warp_specialised" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  timeout 270 python3 tests/gpu/planes_probe.py $R/planes16.json 16 > $R/planes16.log 2>&1
  echo "probe rc $?" >> $R/planes16.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 400 python3 tests/gpu/planes_probe.py $R/planes8.json 8 4 > $R/planes8.log 2>&1
  echo "probe rc $?" >> $R/planes8.log ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -2 $R/tests.log; grep "^T=\|rc " $R/planes16.log $R/planes8.log | cut -c1-1200
