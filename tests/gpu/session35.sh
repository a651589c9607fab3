#!/usr/bin/env bash
# Session 2026-11-30 (eighth), last minutes: the GPU tests of the persistent and stream-K launches only
# (DELTAFLEET_PLANES_TEST_ONLY; session30 and session32 ran out of time in the full set), half the cases
# on each GPU. Argument: the launches to test (default persistent,stream_k; the second run used bits).
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_PLANES_TEST_ONLY=${1:-persistent,stream_k}
for g in 0 1; do
  sel=$([ $g = 0 ] && echo "planes_tenants and bfloat16" || echo "planes_tenants and not bfloat16")
  ( CUDA_VISIBLE_DEVICES=$g timeout 200 python3 -m pytest -q -rf -n 7 -p no:cacheprovider \
        tests/test_kernels_triton.py -k "$sel" > $R/tests-$g.log 2>&1; echo "tests rc $?" >> $R/tests-$g.log ) &
done
wait
for g in 0 1; do grep -E "passed|failed|FAILED|Error|rc " $R/tests-$g.log | head -12; done
