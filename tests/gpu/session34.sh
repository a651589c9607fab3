#!/usr/bin/env bash
# Session 2026-11-30 (eighth), after session33 (T = 16 at 2.206×, target 2.20×): the same T = 16 benchmark
# with (128, 8, 4, 128, 2) added to the 16-row configurations (the fastest stream-K one on qkv in
# session30's probe) and the dispatcher's pick per layer written to the log and the report.
NAME=bench-kernels-streamk-T16-picks-rounds-$(date +%F)-h200 exec bash "$(dirname "$0")/session33.sh"
