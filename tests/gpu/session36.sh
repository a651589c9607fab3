#!/usr/bin/env bash
# For the next device session (2×H200, about 8 minutes): issue 5's closing benchmark, every target in one
# run, GPU0 alone with nothing on GPU1, the dispatcher as on main (at 16 rows: bits, bits + PDL and
# stream-K). Session32's full run timed out at T = 16 (the 16-row candidates took 210 s of compiles on
# qkv beside the GPU tests); with the 16-row set trimmed, T = 16 alone took 116 s (session34), and
# M = 1, 2048 and T = 1–8 took 344 s in session32, so the whole run should take about 460 s.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
NAME=bench-kernels-streamk-rounds-$(date +%F)-h200
CUDA_VISIBLE_DEVICES=0 timeout 580 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1,2048] \
    tenants=[1,2,4,8,16] batched_impls=[] bitdelta_style=false sign_layout=tiled rounds=3 report_name=$NAME \
    > $R/bench.log 2>&1
echo "bench rc $?" >> $R/bench.log
cp reports/$NAME* $R/ 2>/dev/null
grep -v "^\[20" $R/bench.log | tail -n 34
