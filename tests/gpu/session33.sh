#!/usr/bin/env bash
# Session 2026-11-30 (eighth), after session32 (whose full benchmark ran out of time at T = 16, the
# dispatcher compiling every variant: 210 s on qkv alone, beside the GPU tests): the benchmark at
# T = 16 only, GPU0 alone, with the dispatcher timing at 16 rows only bits, bits + PDL and stream-K.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=${NAME:-bench-kernels-streamk-T16-rounds-$(date +%F)-h200}  # session34.sh passes its own
CUDA_VISIBLE_DEVICES=0 timeout 500 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[] \
    tenants=[16] batched_impls=[] bitdelta_style=false sign_layout=tiled rounds=3 report_name=$NAME \
    > $R/bench.log 2>&1
echo "bench rc $?" >> $R/bench.log
cp reports/$NAME* $R/ 2>/dev/null
grep -v "^\[20" $R/bench.log | tail -n 12
