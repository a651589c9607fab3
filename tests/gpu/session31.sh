#!/usr/bin/env bash
# After session30 (branch persist, or main once merged; 2×H200, about 6 minutes): the kernel benchmark
# on GPU0 with nothing on GPU1, the dispatcher timing every variant (int8, bits, bits + PDL, bits +
# spread, persistent, stream-K), tiled signs, M = 1 and 2048, T = 1–16, 3 rounds. The figures for the
# closing note of issue 5.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-persist-rounds-$(date +%F)-h200
CUDA_VISIBLE_DEVICES=0 timeout 570 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1,2048] \
    tenants=[1,2,4,8,16] batched_impls=[] bitdelta_style=false sign_layout=tiled rounds=3 report_name=$NAME \
    > $R/bench.log 2>&1
echo "bench rc $?" >> $R/bench.log
cp reports/$NAME* $R/ 2>/dev/null
grep -v "^\[20" $R/bench.log | grep -v "^\[ " | tail -n 16
