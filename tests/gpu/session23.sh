#!/usr/bin/env bash
# Device session (2×H200, about 4 minutes), branch tiled-signs: decode on tiled signs with its own tile
# set (kernels.triton_bitdelta._decode_configs_tiled). session22 measured M = 1 at 1.109× dense on tiled
# signs (gate_up 1.163×) against 1.084× on rows. GPU0: the tiled-sign GPU tests. GPU1: kernels/bench.py
# at M = 1 and T = 1 on tiled signs (the tuner's choices printed), then the same on rows, side by side.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_tiled.py > $R/tests-tiled.log 2>&1
  echo "tests rc $?" >> $R/tests-tiled.log ) &
( export CUDA_VISIBLE_DEVICES=1
  for L in tiled rows; do
    NAME=bench-kernels-decode-$L-$(date +%F)-h200
    TRITON_PRINT_AUTOTUNING=1 timeout 200 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] tenants=[1] \
        batched_impls=[] bitdelta_style=false sign_layout=$L report_name=$NAME > $R/bench-$L.log 2>&1
    echo "bench rc $?" >> $R/bench-$L.log
    cp reports/$NAME* $R/ 2>/dev/null
  done ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -n 2 $R/tests-tiled.log; for L in tiled rows; do grep -E "M=    1|T=  1|target|best config" $R/bench-$L.log | tail -n 14; done
