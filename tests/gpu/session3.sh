#!/usr/bin/env bash
# Device session (2×H200), third of the day: the 70B-shaped family of 14 variants, TP=2 over both
# GPUs; then GPU0 the 7B serving benchmark and GPU1 the CUDA-graph decode check, with the kernels'
# default tiles (no autotuning in the servers). Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
DEADLINE=$(( $(date +%s) + ${BUDGET:-520} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
timeout ${T70:-300} python3 serve/bench.py --config-name bench_serve_70b machine=h200x2 > $R/serve70b.log 2>&1; echo "serve70b rc $?" >> $R/serve70b.log
pkill -f serve/run.py; sleep 3
cp outputs/bench-serve-70b/*/server.log $R/serve70b-server.log 2>/dev/null
nvidia-smi > $R/nvidia-smi-after70b.txt 2>&1
( CUDA_VISIBLE_DEVICES=1 timeout 150 python3 tests/gpu/check_serve_graphs.py $R/serve-graphs.json > $R/serve-graphs.log 2>&1; echo "graphs rc $?" >> $R/serve-graphs.log ) &
( CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 10 )) python3 serve/bench.py machine=h200 > $R/serve7b.log 2>&1; echo "serve rc $?" >> $R/serve7b.log
  cp outputs/bench-serve/*/server.log $R/serve7b-server.log 2>/dev/null ) &
wait
cp reports/bench-serve-* $R/ 2>/dev/null
tar czf $OUT/r.tgz -C /tmp r
ls -la $R
