#!/usr/bin/env bash
# Device session (2×H200): the same runs as session12.sh (GPU tests of the Gluon prefill kernels and
# the prefill probe at M = 2048 on GPU0, ncu of the register-operand and SS kernels on GPU1), on the
# register-operand prefill kernel with W by TMA into shared memory and ldmatrix into registers
# (session12: W by 4-byte global loads straight into registers stalled on the L1, 1.60× at best).
exec bash "$(dirname "$0")/session12.sh"
