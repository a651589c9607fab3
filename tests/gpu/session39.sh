#!/usr/bin/env bash
# Session 2026-11-30 (ninth): session38's ten failures were a test-code error (f40fcff's split-1-for-stream-K
# edit also landed in the Hopper FMA tenant test, whose configurations are tuples). Fixed; that test again.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 DELTAFLEET_TRITON_DEVICE=cuda
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -rf -n 10 -p no:cacheprovider \
    tests/test_kernels_triton.py -k gluon_tenants > $R/tests-gluon-tenants.log 2>&1
echo "tests rc $?" >> $R/tests-gluon-tenants.log
grep -E "passed|failed|FAILED|Error|rc " $R/tests-gluon-tenants.log | tail -12
