#!/usr/bin/env bash
# Branch bits (2×H200, about 7 minutes): is the int8 tenant kernel with the sign part on the binary
# tensor cores (bits=True: mma.sync b1 AND+POPC, no sign expansion) correct, and faster at T = 8 / 16?
# GPU0: the probe at T = 16 and 8 on tiled signs: int8 (tiled, tiled + base_spread) against bits
#       (and bits + base_spread), K splits 1/2/4/8.
# GPU1: the int8 kernel's GPU tests (with the bits cases) and the bit-plane test, then ncu (full set)
#       of one T = 16 call on the 70B `o` shape: bits + base_spread at the default (128, 4, 4, 96, 2).
set -u
R=/tmp/r; mkdir -p $R
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0
  PROBE_ONLY_TILED=1 PROBE_TILED=1 PROBE_BASE_SPREAD=1 PROBE_BITS=1 timeout 330 python3 tests/gpu/planes_probe.py \
      $R/probe-bits.json 16 8 > $R/probe-bits.log 2>&1
  echo "probe rc $?" >> $R/probe-bits.log ) &
( export CUDA_VISIBLE_DEVICES=1 DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1
  timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_triton.py -k "planes_tenants or bitplanes" \
      > $R/tests-bits.log 2>&1
  echo "tests rc $?" >> $R/tests-bits.log
  NCU="ncu --profile-from-start off --clock-control none --set full --print-details all"
  PLANES_TILED=1 PLANES_BS=1 PLANES_BITS=1 PLANES_CFG=128,4,4,96,2,1 timeout 100 $NCU python3 tests/gpu/profile_kernels.py \
      planesws-T16 > $R/ncu-bits.txt 2>&1 ) &
wait
tar czf $OUT/r.tgz -C /tmp r
tail -n 25 $R/tests-bits.log | grep -E "passed|failed|Error|assert|rc " | head -20
grep -E "^T=" $R/probe-bits.log | cut -c1-1500; tail -n 2 $R/probe-bits.log | cut -c1-300
awk '/_planes_ws_kernel/{f=1} f' $R/ncu-bits.txt | grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy" | head -4
