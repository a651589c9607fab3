#!/usr/bin/env bash
# Device session (2×H200), second of the day: GPU0 the CUDA-graph decode check and the 7B serving
# benchmark; GPU1 the Hopper mixed-tenant kernel's tests, the tenants benchmark on the 70B layer set
# and ncu profiles; CPU: the 32-layer 7B-shaped merge memory. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
DEADLINE=$(( $(date +%s) + ${BUDGET:-540} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
( nice -n 5 timeout $(( $(left) - 15 )) python3 merge/bench.py machine=h200x2-host-32cpu > $R/merge.log 2>&1; echo "merge rc $?" >> $R/merge.log ) &
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 python3 tests/gpu/check_serve_graphs.py $R/serve-graphs.json > $R/serve-graphs.log 2>&1; echo "graphs rc $?" >> $R/serve-graphs.log
  timeout $(( $(left) - 15 )) python3 serve/bench.py machine=h200 > $R/serve7b.log 2>&1; echo "serve rc $?" >> $R/serve7b.log
  cp -r outputs/bench-serve/*/server.log $R/serve7b-server.log 2>/dev/null
) &
(
  export CUDA_VISIBLE_DEVICES=1
  DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_kernels_triton.py -k "gluon_tenants or batched" > $R/pytest-gluon-tenants.log 2>&1; echo "pytest rc $?" >> $R/pytest-gluon-tenants.log
  timeout 200 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] tenants=[2,4,8,16] rep_ms=30 bitdelta_style=false \
    batched_impls=[lut,gluon] report_name=bench-kernels-tenants-run2 > $R/bench-tenants.log 2>&1
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for c in gluon-T2 gluon-T16; do
    timeout 60 $NCU --profile-from-start off --clock-control none --set full python3 tests/gpu/profile_kernels.py $c > $R/ncu-$c.txt 2>&1
  done
) &
wait
cp reports/*run2* reports/bench-serve-* reports/bench-merge-*32L* $R/ 2>/dev/null
tar czf $OUT/r.tgz -C /tmp r
ls -la $R
