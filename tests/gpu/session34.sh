#!/usr/bin/env bash
# Session 2026-11-30 (eighth), after session33 (T = 16 at 2.206×, target 2.20×): the same T = 16 benchmark
# with (128, 8, 4, 128, 2) added to the 16-row configurations (the fastest stream-K one on qkv in
# session30's probe) and the dispatcher's pick per layer written to the log and the report.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-streamk-T16-picks-rounds-$(date +%F)-h200
CUDA_VISIBLE_DEVICES=0 timeout 500 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[] \
    tenants=[16] batched_impls=[] bitdelta_style=false sign_layout=tiled rounds=3 report_name=$NAME \
    > $R/bench.log 2>&1
echo "bench rc $?" >> $R/bench.log
cp reports/$NAME* $R/ 2>/dev/null
grep -v "^\[20" $R/bench.log | tail -n 12
