#!/usr/bin/env bash
# Session 2026-11-30 (ninth), after session36's benchmark met every target: the whole GPU test set of the
# two kernel test files on main's head, in one run (2×H200). GPU1: the mixed-tenant planes test with every
# launch (no DELTAFLEET_PLANES_TEST_ONLY; 14 cases, one per worker). GPU0: everything else in both files,
# then the CUDA-graph serving check (the untimed 4- and 8-row splits changed with ws_split(bits=True)).
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 DELTAFLEET_TRITON_DEVICE=cuda
( CUDA_VISIBLE_DEVICES=1 timeout 540 python3 -m pytest -q -rf -n 14 -p no:cacheprovider \
      tests/test_kernels_triton.py -k planes_tenants > $R/tests-tenants.log 2>&1
  echo "tests rc $?" >> $R/tests-tenants.log ) &
( CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m pytest -q -rf -n 10 -p no:cacheprovider \
      tests/test_kernels_triton.py tests/test_kernels_tiled.py -k "not planes_tenants" > $R/tests-rest.log 2>&1
  echo "tests rc $?" >> $R/tests-rest.log
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 tests/gpu/check_serve_graphs.py $R/serve-graphs.json > $R/serve-graphs.log 2>&1
  echo "graphs rc $?" >> $R/serve-graphs.log ) &
wait
for f in $R/tests-rest.log $R/tests-tenants.log $R/serve-graphs.log; do echo "== $f"; grep -E "passed|failed|FAILED|Error|rc |ok|diff" $f | tail -12; done
