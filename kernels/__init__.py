"""``deltafleet.kernels``: the fused 1-bit delta linear (docs/kernels.md).

The dispatchers live in ``kernels/linear.py``, the plain-torch reference and the sign layouts in
``kernels/reference.py``; both are re-exported here.

This folder sits at the top of the checkout, so wherever the checkout's root is on ``sys.path``
(``python -m …`` or ``python -c`` run there) it is also importable as a top-level ``kernels``. That
name belongs to Hugging Face's ``kernels`` distribution, which transformers (≥ 5.25 requires it)
imports when it loads a model. Imported under that name, this file steps aside: it loads the
installed distribution in its place, or, where none is installed, stays an empty module, which
transformers reads as "no usable kernels".
"""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _path = [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _path)
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module  # the import statement returns what sys.modules holds
        _spec.loader.exec_module(_module)
else:
    from deltafleet.kernels.linear import (add_sign_products, bitdelta_linear, bitdelta_linear_batched,
                                           bitdelta_linear_grouped, bitdelta_linear_segments, bitdelta_linears_grouped,
                                           segments_supported)
    from deltafleet.kernels.reference import (
        bitdelta_linear as bitdelta_linear_reference,
        bitdelta_linear_batched as bitdelta_linear_batched_reference,
        pack_signs,
        packed_width,
        reconstruct,
        tile_signs,
        tiled_shape,
        unpack_bits,
        unpack_signs,
        untile_signs,
    )

    __all__ = [
        "add_sign_products",
        "bitdelta_linear",
        "bitdelta_linear_reference",
        "bitdelta_linear_batched",
        "bitdelta_linear_batched_reference",
        "bitdelta_linear_grouped",
        "bitdelta_linears_grouped",
        "bitdelta_linear_segments",
        "segments_supported",
        "pack_signs",
        "packed_width",
        "reconstruct",
        "unpack_bits",
        "unpack_signs",
        "tile_signs",
        "tiled_shape",
        "untile_signs",
    ]
