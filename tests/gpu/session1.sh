#!/usr/bin/env bash
# Device session (2×H200): GPU0 serving benchmark (7B family), GPU1 kernel profiles + tenants bench +
# GPU kernel tests, CPU: 32-layer 7B-shaped merge memory. Results tarred into $OUT/r.tgz.
set -u
R=/tmp/r; mkdir -p $R
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
nvidia-smi > $R/nvidia-smi.txt 2>&1
DEADLINE=$(( $(date +%s) + ${BUDGET:-540} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
( nice -n 5 timeout $(( $(left) - 20 )) python3 merge/bench.py machine=h200x2-host-32cpu > $R/merge.log 2>&1; echo "merge rc $?" >> $R/merge.log ) &
( CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 20 )) python3 serve/bench.py machine=h200 > $R/serve7b.log 2>&1; echo "serve rc $?" >> $R/serve7b.log ) &
(
  export CUDA_VISIBLE_DEVICES=1
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for c in ${CASES:-dense-M16 decode-M1 fma-T1 fma-T2 lut-T2 lut-T16 prefill-M2048 dense-M2048}; do
    timeout 90 $NCU --profile-from-start off --clock-control none --set full python3 tests/gpu/profile_kernels.py $c > $R/ncu-$c.txt 2>&1
  done
  timeout 150 python3 kernels/bench.py machine=h200 shapes=[llama2-70b] ms=[1] tenants=[1,2,16] rep_ms=30 bitdelta_style=false report_name=bench-kernels-tenants-run1 > $R/bench-tenants.log 2>&1
  DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 timeout $(( $(left) - 25 )) python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_kernels_triton.py > $R/pytest-kernels.log 2>&1; echo "pytest rc $?" >> $R/pytest-kernels.log
) &
wait
cp reports/*$(date +%Y-%m-%d)* $R/ 2>/dev/null
tar czf $OUT/r.tgz -C /tmp r
ls -la $R
