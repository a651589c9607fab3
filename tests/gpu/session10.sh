#!/usr/bin/env bash
# Device session prepared for the next run (2×H200, about 8 minutes): GPU0 the GPU tests of the
# warp-specialised prefill kernel (kernels/gluon_prefill_ws.py, compiled in CI but never run) and of
# the int8 tenant kernels, then the prefill probe (every prefill configuration ÷ dense, 70B layer set,
# M = 2048 and 256); GPU1 ncu of the int8 tenant kernel at T = 16 for K steps of 128 and 256, then
# the tenant probe at T = 4, 8, 16. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0
  DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout 240 python3 -m pytest -q -n 4 \
      -p no:cacheprovider tests/test_kernels_triton.py -k "gluon_prefill or planes" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  timeout 200 python3 tests/gpu/prefill_gluon.py $R/prefill.json > $R/prefill.log 2>&1; echo "prefill rc $?" >> $R/prefill.log ) &
( export CUDA_VISIBLE_DEVICES=1
  for c in "16 128,4,4,96,1" "16 256,8,2,128,1"; do set -- $c
    PLANES_CFG=$2 timeout 90 ncu --profile-from-start off --clock-control none --set full --print-details all \
      python3 tests/gpu/profile_kernels.py planesws-T$1 > $R/ncu-T$1-$2.txt 2>&1
  done
  timeout 240 python3 tests/gpu/planes_probe.py $R/probe.json 4 8 16 > $R/probe.log 2>&1; echo "probe rc $?" >> $R/probe.log ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -3 $R/tests.log; grep "===" $R/prefill.log; tail -4 $R/probe.log
