#!/usr/bin/env bash
# Device session (2×H200): the register-operand prefill kernel (kernels/gluon_prefill_rs.py) with W
# by TMA into shared memory and ldmatrix into registers (session12: W by 4-byte global loads straight
# into registers stalled on the L1, 1.60× at best). GPU0: its GPU
# tests, then the prefill probe at M = 2048 (Gluon SS kernel and RS configurations). GPU1: ncu of
# the RS kernel and of the SS kernel on the o shape at M = 2048. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0
  DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout 200 python3 -m pytest -q -n 4 -x \
      -p no:cacheprovider tests/test_kernels_triton.py -k "gluon_prefill" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  PROBE_MS=2048 PROBE_SETS=ss,rs timeout 200 python3 tests/gpu/prefill_gluon.py $R/prefill.json > $R/prefill.log 2>&1
  echo "prefill rc $?" >> $R/prefill.log ) &
( export CUDA_VISIBLE_DEVICES=1
  RS_CFG=256,4,2,240 timeout 150 ncu --profile-from-start off --clock-control none --set full -k regex:prefill \
      --print-details all python3 tests/gpu/profile_kernels.py prefillrs-M2048 > $R/ncu-rs.txt 2>&1
  timeout 150 ncu --profile-from-start off --clock-control none --set full -k regex:prefill \
      --print-details all python3 tests/gpu/profile_kernels.py prefillss-M2048 > $R/ncu-ss.txt 2>&1 ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -3 $R/tests.log; grep "===\|rel err" $R/prefill.log | cut -c1-700
for f in $R/ncu-*.txt; do echo "== $f"; grep -E "^\s+(Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per Thread|Stall (Long|Barrier|Wait|GMMA|Math|Not|Short|MIO|LG|Branch|Dispatch|No))" $f | head -24; done
