#!/usr/bin/env bash
# Device session (2×H200): GPU0 the int8 tensor-core tenant kernels' GPU tests; GPU1 the kernel
# benchmark for T = 1, 2, 4, 8, 16 on the 70B layer set (the dispatcher's pick, the table-lookup and
# the non-specialised int8 kernel as reference rows). Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout 330 \
    python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -k "planes" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log ) &
( CUDA_VISIBLE_DEVICES=1 timeout ${TB:-400} python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] \
    tenants=[1,2,4,8,16] batched_impls=[lut,planes] bitdelta_style=false \
    report_name=bench-kernels-tenants-planes-2026-11-30-h200 > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log; cp reports/bench-kernels-tenants-planes-2026-11-30-h200* $R/ 2>/dev/null ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -4 $R/tests.log; tail -25 $R/bench.log
