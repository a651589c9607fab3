#!/usr/bin/env bash
# Device session (2×H200): GPU0 the GPU tests of the int8 tensor-core tenant kernel and the other
# tenant kernels; GPU1 its timing per layer, ring depth and K split (tests/gpu/planes_probe.py).
# Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout ${TT:-420} \
    python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_triton.py -k "planes" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log ) &
( CUDA_VISIBLE_DEVICES=1 timeout ${TP:-420} python3 tests/gpu/planes_probe.py $R/probe.json 2 4 8 16 > $R/probe.log 2>&1
  echo "probe rc $?" >> $R/probe.log ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -5 $R/tests.log; tail -8 $R/probe.log
