#!/usr/bin/env bash
# Device session (one H200, 4 device-minutes left): the kernel benchmark at T = 2, 4, 8 after the
# faster activation-planes kernel. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
timeout ${TB:-200} python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] tenants=[2,4,8] \
    batched_impls=[] bitdelta_style=false report_name=bench-kernels-tenants-planes-prep-2026-11-30-h200 > $R/bench.log 2>&1
echo "bench rc $?" >> $R/bench.log
cp reports/bench-kernels-tenants-planes-prep-2026-11-30-h200* $R/ 2>/dev/null
tar czf $OUT/r.tgz -C /tmp r
tail -16 $R/bench.log
