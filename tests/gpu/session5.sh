#!/usr/bin/env bash
# Device session (2×H200): GPU0 the int8 tensor-core tenant kernels' GPU tests, then ncu profiles of
# the warp-specialised kernel (o layer, T = 16 and 8); GPU1 tests/gpu/planes_probe.py over every
# configuration in kernels.gluon_planes.WS_CONFIGS. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0
  DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout 300 \
    python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_triton.py -k "planes" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  for c in "16 128,4,4,96,1" "16 128,8,3,128,1" "8 128,4,3,80,1"; do set -- $c
    PLANES_CFG=$2 timeout 100 ncu --profile-from-start off --clock-control none --set full --print-details all \
      python3 tests/gpu/profile_kernels.py planesws-T$1 > $R/ncu-T$1-$2.txt 2>&1
  done ) &
( CUDA_VISIBLE_DEVICES=1 timeout ${TP:-450} python3 tests/gpu/planes_probe.py $R/probe.json 16 8 4 2 > $R/probe.log 2>&1
  echo "probe rc $?" >> $R/probe.log ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -3 $R/tests.log; grep -h "Duration\|Issue Slots Busy\|DRAM Throughput\|Achieved Occupancy\|Registers Per" $R/ncu-*.txt | head -30; tail -6 $R/probe.log
