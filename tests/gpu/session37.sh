#!/usr/bin/env bash
# For the next device session, right after session36.sh (2×H200, about 3 minutes): the GPU cases not yet
# run on a GPU — every stream-K case of the tenant test (DELTAFLEET_PLANES_TEST_ONLY=stream_k: at every
# row count, with the 16-row bits + PDL + stream-K cases over each 128-step configuration added after
# session35; half the shapes on each GPU) — the small tests (refusals, _fastest, ws_slots) and the bit-plane
# kernel's chunk / warp probe (tests/gpu/bitplanes_probe.py) on GPU0 once its tests are done.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 DELTAFLEET_TRITON_DEVICE=cuda
for g in 0 1; do
  sel=$([ $g = 0 ] && echo "planes_tenants and bfloat16" || echo "planes_tenants and not bfloat16")
  ( CUDA_VISIBLE_DEVICES=$g DELTAFLEET_PLANES_TEST_ONLY=stream_k timeout 200 python3 -m pytest -q -rf -n 7 \
        -p no:cacheprovider tests/test_kernels_triton.py -k "$sel" > $R/tests-$g.log 2>&1
    echo "tests rc $?" >> $R/tests-$g.log
    if [ $g = 0 ]; then
      timeout 90 python3 tests/gpu/bitplanes_probe.py $R/bitplanes-probe.json > $R/bitplanes-probe.log 2>&1
      echo "probe rc $?" >> $R/bitplanes-probe.log
    else
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
          -k "bitplanes or fastest or ws_slots or refuse" > $R/tests-small.log 2>&1
      echo "small tests rc $?" >> $R/tests-small.log
    fi ) &
done
wait
for f in $R/tests-0.log $R/tests-1.log $R/tests-small.log; do grep -E "passed|failed|FAILED|Error|rc " $f | head -8; done
python3 - $R/bitplanes-probe.json <<'PY' || tail -5 $R/bitplanes-probe.log
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(f'M={r["M"]:2d} K={r["K"]:5d} chunk={r["chunk"]:4d} warps={r["warps"]} {r["us"]:6.2f} us same={r["same"]}')
PY
