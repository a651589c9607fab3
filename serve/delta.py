"""One variant as the model reads it: a BitDelta artifact's packed signs, scales and the few tensors
it stores in full, looked up by Hugging Face parameter name (BitDelta, arXiv:2402.10193, Eq. 2:
``W_ft ≈ W_base + α·sign(Δ)``).

A leaf module (it needs only the kernels' sign helpers): the model, the variant slots, the delta
cache and tensor parallelism all import it.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch
from torch import Tensor

from deltafleet.compress.bitdelta import VOCAB_MATRIX_SUFFIXES, resizes_vocabulary
from deltafleet.kernels import packed_width


def artifact_stamp(folder) -> tuple | None:
    """The ``(name, size, mtime, inode)`` of every file in an artifact's folder, or None once its
    manifest (``bitdelta.json``) is gone: it changes when the artifact is re-exported (a new folder
    renamed in) or a file is changed in place, so two reads with one stamp read one version."""
    try:
        with os.scandir(folder) as entries:
            files = tuple(sorted((e.name, st.st_size, st.st_mtime_ns, st.st_ino)
                                 for e in entries if e.is_file() for st in (e.stat(),)))
    except OSError:
        return None
    return files if any(f[0] == "bitdelta.json" for f in files) else None


def hf_name(name: str) -> str:
    """The Hugging Face name of a :class:`~deltafleet.serve.model.Transformer` parameter (its modules
    drop the ``model.`` prefix that every parameter but the head carries in a checkpoint)."""
    return name if name.startswith("lm_head.") else f"model.{name}"


class _ArtifactLike(Protocol):
    signs: dict[str, Tensor]
    alphas: dict[str, Tensor]
    full: dict[str, Tensor]
    betas: dict[str, Tensor]

    @property
    def variant(self) -> str: ...


class VariantDelta:
    """One variant's deltas, looked up by Hugging Face parameter name during ``forward``.

    Holds only what the artifact holds — packed signs (uint8 ``[N, ceil(K/8)]``), scales (fp32
    ``[]`` or ``[N]``), column scales β (fp32 ``[K]``, granularity rowcol only) and the few tensors
    stored in full — moved to the model's device; floating full tensors are cast to the model's dtype.
    """

    def __init__(self, artifact: _ArtifactLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.name = artifact.variant
        self.signs = {k: v.to(device) for k, v in artifact.signs.items()}
        self.alphas = {k: v.to(device, torch.float32) for k, v in artifact.alphas.items()}
        self.betas = {k: v.to(device, torch.float32) for k, v in getattr(artifact, "betas", {}).items()}
        self.full = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in artifact.full.items()}

    def to(self, device: str | torch.device, pin: bool = False) -> VariantDelta:
        """A copy on ``device`` (the tiers of serve/cache.py); ``pin``: into page-locked host memory,
        from which a later copy to the GPU runs asynchronously at full PCIe speed."""
        out = object.__new__(VariantDelta)
        out.name = self.name

        def move(t: Tensor) -> Tensor:
            t = t.to(device, non_blocking=True, copy=True)  # never an alias (slots are reused)
            return t.pin_memory() if pin and not t.is_pinned() else t

        out.signs = {k: move(v) for k, v in self.signs.items()}
        out.alphas = {k: move(v) for k, v in self.alphas.items()}
        out.betas = {k: move(v) for k, v in self.betas.items()}
        out.full = {k: move(v) for k, v in self.full.items()}
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)  # the copies are complete before a kernel reads them
        return out

    def sign_alpha(self, param: str) -> tuple[Tensor, Tensor] | None:
        """``(sign, alpha)`` of a sign-compressed parameter, or None if it has none."""
        sign = self.signs.get(param)
        return None if sign is None else (sign, self.alphas[param])

    def beta(self, param: str) -> Tensor | None:
        """The column scales β ``[K]`` of a sign-compressed parameter (granularity rowcol), or None."""
        return self.betas.get(param)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.signs, self.alphas, self.betas, self.full)
                   for t in d.values())

    def check_scales(self, dtype: torch.dtype) -> None:
        """Check every α, and every floating tensor stored in full, against the dtype the model is
        served in: the kernels round α·sign, and the weight plus it, to that dtype, where an α beyond its
        largest finite value is ±inf and every output it reaches is NaN or inf (in float32, whose range α
        shares, nothing is refused); a full tensor is cast to it (``__init__``), where a value beyond it is
        inf already. Non-finite α and full tensors are refused where the artifact is read
        (``compress.bitdelta.load_artifact``); a large α inside the range is left as it is, having no
        principled bound. β (rowcol) is float16 in an artifact, inside the range of every dtype served.

        Raises:
            ValueError: naming the first α out of range, its largest magnitude and the dtype, or the
                first full tensor that is not finite in the dtype served.
        """
        top = torch.finfo(dtype).max
        served = str(dtype).removeprefix("torch.")
        for name, alpha in self.alphas.items():
            peak = float(alpha.abs().max()) if alpha.numel() else 0.0
            if peak > top:
                raise ValueError(f"variant {self.name!r}: {name}.alpha holds {peak:.4g}, beyond what "
                                 f"{served} (the dtype served) holds ({top:.4g} at most): it would be inf there")
        for name, t in self.full.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"variant {self.name!r}: {name} (stored in full) is not finite in {served} (the "
                                 f"dtype served, {top:.4g} at most): a value beyond that range, or NaN or inf")

    def check(self, shapes: dict[str, torch.Size]) -> None:
        """Check every stored tensor against the model's parameter shapes (HF names).

        Raises:
            ValueError: on a parameter the model lacks, a sign/alpha/full tensor of the wrong
                shape (e.g. a resized vocabulary), or a sign without its alpha.
        """
        for name, sign in self.signs.items():
            shape = shapes.get(name)
            if shape is None or len(shape) != 2:
                raise ValueError(f"variant {self.name!r}: delta for {name!r}, which is not a weight matrix of the base")
            n, k = shape
            if tuple(sign.shape) != (n, packed_width(k)) or sign.dtype != torch.uint8:
                raise ValueError(f"variant {self.name!r}: {name}.sign is {sign.dtype} {tuple(sign.shape)}, "
                                 f"expected uint8 ({n}, {packed_width(k)})")
            alpha = self.alphas.get(name)
            if alpha is None or tuple(alpha.shape) not in ((), (n,)):
                raise ValueError(f"variant {self.name!r}: {name}.alpha missing or not of shape [] or [{n}]")
            beta = self.betas.get(name)
            if beta is not None and tuple(beta.shape) != (k,):
                raise ValueError(f"variant {self.name!r}: {name}.beta has shape {tuple(beta.shape)}, expected [{k}]")
        for name in self.betas:
            if name not in self.signs:
                raise ValueError(f"variant {self.name!r}: {name}.beta without {name}.sign")
        for name, t in self.full.items():
            if name not in shapes:
                raise ValueError(f"variant {self.name!r}: full tensor {name!r} is not a parameter of the base")
            if t.shape != shapes[name]:
                vocab = {s[0] for n, s in shapes.items() if n.endswith(VOCAB_MATRIX_SUFFIXES) and len(s) == 2}
                resized = resizes_vocabulary(name, tuple(shapes[name]), tuple(t.shape), vocab)
                why = ("resized vocabularies are not served" if resized
                       else "not a tensor of the base's shapes: is the artifact this base's?")
                raise ValueError(f"variant {self.name!r}: {name} has shape {tuple(t.shape)}, the base "
                                 f"{tuple(shapes[name])} ({why})")

