#!/usr/bin/env bash
# Prepared for the next device session (2×H200, about 7 minutes), on branch persist: is the
# warp-specialised tenant kernel launched persistent (one program per resident slot walking the
# work units, the loaders filling the ring for the next unit during the consumers' epilogue) correct,
# and faster at 16 variants than one program per unit (2.288× dense on main, target 2.20×; qkv at
# 2.50× from 160 feature blocks on 132 multiprocessors)?
# GPU0: the probe at T = 16 on tiled signs: int8 (for reference), bits, bits + spread, bits persistent and stream-K (with and without
#       PDL), bits at 256-weight K steps (tile_signs(…, 256): if that wins, the serving layout's
#       128-weight tiles can be read two per step), K splits 1/2/4/8; and the binary kernel's copies
#       and barriers alone (PROBE_COPIES: no products) — how close the memory side itself gets to 2.20×.
# GPU1: the int8 / binary kernels' GPU tests (with the persistent cases) and the bit-plane tests, then
#       the CUDA-graph serving check (untimed picks are the binary path from four rows up on this branch).
# Then, if persistent wins: let the dispatcher keep timing it (it already does on this branch), merge,
# and run tests/gpu/session29.sh (the benchmark) again.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0
  PROBE_ONLY_TILED=1 PROBE_TILED=1 PROBE_BITS=1 PROBE_PERSIST=1 PROBE_BITS_BK256=1 PROBE_COPIES=1 timeout 420 \
      python3 tests/gpu/planes_probe.py $R/probe-persist.json 16 > $R/probe-persist.log 2>&1
  echo "probe rc $?" >> $R/probe-persist.log ) &
( export CUDA_VISIBLE_DEVICES=1 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py \
      -k "planes_tenants or bitplanes or ws_slots or refuses" > $R/tests.log 2>&1
  echo "tests rc $?" >> $R/tests.log
  # serving with CUDA graphs: untimed (capture) picks now take the binary path from four rows up
  unset DELTAFLEET_TRITON_QUICK_TUNE
  timeout 120 python3 tests/gpu/check_serve_graphs.py $R/serve-graphs.json > $R/serve-graphs.log 2>&1
  echo "graphs rc $?" >> $R/serve-graphs.log
  # if time is left: ncu of one T = 16 call on `o`, binary path split 1, one program per unit and persistent
  NCU="ncu --profile-from-start off --clock-control none --set full --print-details all"
  for ps in 0 1; do
    if [ $SECONDS -lt 440 ]; then
      PLANES_TILED=1 PLANES_BITS=1 PLANES_PERSIST=$ps PLANES_CFG=128,4,4,96,2,1 timeout 70 $NCU python3 \
          tests/gpu/profile_kernels.py planesws-T16 > $R/ncu-bits-ps$ps.txt 2>&1
    fi
  done ) &
wait
tail -n 30 $R/tests.log | grep -E "passed|failed|FAILED|Error|rc " | head -20
tail -n 3 $R/serve-graphs.log
for f in $R/ncu-bits-ps*.txt; do echo "== $f"; sed -n '/_planes_ws_kernel/,$p' $f | grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy" | head -4; done
grep -E "^T=" $R/probe-persist.log | cut -c1-2500; tail -n 1 $R/probe-persist.log
