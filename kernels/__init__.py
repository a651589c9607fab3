"""Fused 1-bit delta linear: the contract of ARCHITECTURE.md ("Kernel").

``bitdelta_linear`` and ``bitdelta_linear_batched`` dispatch to the fastest implementation for
the device: today the plain-torch reference everywhere (Triton kernels land with issue 5).
"""
from kernels.reference import (
    bitdelta_linear,
    bitdelta_linear_batched,
    pack_signs,
    packed_width,
    reconstruct,
    unpack_bits,
    unpack_signs,
)

__all__ = [
    "bitdelta_linear",
    "bitdelta_linear_batched",
    "pack_signs",
    "packed_width",
    "reconstruct",
    "unpack_bits",
    "unpack_signs",
]
