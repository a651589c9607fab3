#!/usr/bin/env bash
# Device session (2×H200, about 9 minutes), branch tiled-signs, nothing else running on the host's GPUs
# during each measurement: (1) the kernel benchmark on tiled signs, M = 1 and 2048, T = 1–16, dense and
# the kernels timed in turn over 3 rounds (kernels/bench.py rounds), on GPU0 alone; (2) the serving
# benchmark of the 70B-shaped family of 14 variants at tensor-parallel 2 with tiled device slots.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-tiled-rounds-$(date +%F)-h200
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1,2048] \
    tenants=[1,2,4,8,16] batched_impls=[] bitdelta_style=false sign_layout=tiled rounds=3 report_name=$NAME \
    > $R/bench.log 2>&1
echo "bench rc $?" >> $R/bench.log
cp reports/$NAME* $R/ 2>/dev/null
SNAME=bench-serve-$(date +%F)-h200x2-llama2-70b-synthetic-tp2-14v-tiled
timeout 230 python3 serve/bench.py --config-name bench_serve_70b machine=h200x2 sign_layout=tiled report_name=$SNAME \
    > $R/serve70b.log 2>&1
echo "serve70b rc $?" >> $R/serve70b.log
cp reports/$SNAME* $R/ 2>/dev/null
tar czf $OUT/r.tgz -C /tmp r
grep -v "^\[20" $R/bench.log | grep -v "^\[ " | tail -n 14; tail -n 25 $R/serve70b.log
