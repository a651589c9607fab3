#!/usr/bin/env bash
# Device session (2×H200): GPU0 the GPU tests of the Gluon prefill kernels, including the new
# register-operand kernel (kernels/gluon_prefill_rs.py), then the prefill probe (every prefill
# configuration ÷ dense, 70B layer set, M = 2048 and 256); GPU1 the kernel benchmark for mixed
# tenants T = 2…16 with the dispatcher timing splits 1–8. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0
  DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout 200 python3 -m pytest -q -n 4 \
      -p no:cacheprovider tests/test_kernels_triton.py -k "gluon_prefill" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  timeout 240 python3 tests/gpu/prefill_gluon.py $R/prefill.json > $R/prefill.log 2>&1; echo "prefill rc $?" >> $R/prefill.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 420 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] tenants=[1,2,4,8,16] \
      batched_impls=[lut,planes] bitdelta_style=false report_name=bench-kernels-tenants-splits-2026-11-30-h200 > $R/bench.log 2>&1
  echo "bench rc $?" >> $R/bench.log
  cp reports/bench-kernels-tenants-splits-2026-11-30-h200* $R/ 2>/dev/null ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -3 $R/tests.log; grep "===\|rel err" $R/prefill.log | cut -c1-600; tail -12 $R/bench.log
