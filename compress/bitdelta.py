"""BitDelta export and the artifact reader (docs/artifact.md: the format, versions 1 and 2).

BitDelta (Liu et al., arXiv:2402.10193, §3.1) compresses a fine-tune against its base one weight
matrix at a time: with the task vector ``Δ = W_ft − W_base`` it keeps only ``sign(Δ)`` (one bit
per weight, packed eight to a byte) and one scale α (Eq. 1), so that ``W_ft ≈ W_base + α·sign(Δ)``
(Eq. 2). The α minimising the L2 error of that approximation is ``mean|Δ|`` (§3.1); with
``granularity="row"`` each output row gets its own ``α_r = mean_j |Δ_rj|``. ``granularity="rowcol"``
(format version 2) scales the signs from both sides, ``W_ft ≈ W_base + diag(α)·sign(Δ)·diag(β)``,
with a float16 α per output row and a float16 β per input column (OneBit's sign-value-independent
decomposition, arXiv:2402.11295, applied to the delta): the export starts from the row solution
(α_r = mean_j |Δ_rj|, β = 1) and scale distillation (compress/distill.py) fits both. Everything that is
not a same-shape 2-D matrix (norms, biases, resized embeddings, new parameters) is stored in full,
and parameters identical to the base are left out.

The export streams both checkpoints block of rows by block of rows (``deltafleet.checkpoint``: plain file
reads, no memory map), so its memory is one float32 block of Δ, the packed signs of the current
output shard and that shard's serialisation — a few hundred MB to ~2 GB whatever the model size
(``make bench-compress`` measures it on a 7B-shaped pair). The artifact is written to a temporary folder next to
the destination and renamed into place, so an interrupted export leaves nothing half-written.

Layout of an artifact folder (format version 1)::

    bitdelta.json          manifest: format, format_version, variant, base, granularity, files,
                           stats, provenance
    delta.safetensors      P.sign (uint8 [d_out, ceil(d_in/8)]), P.alpha (float32 [] or [d_out];
                           float16 [d_out] for rowcol), P.beta (rowcol only: float16 [d_in]),
                           P (full tensor, original dtype)

or shards ``delta-0000i-of-0000N.safetensors`` with ``delta.safetensors.index.json`` (Hugging Face
index shape ``{"metadata": {...}, "weight_map": {tensor: file}}``), which the reader accepts.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import stat
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from deltafleet.atomic import check_replaceable, fsync_path, not_recorded_output, staged_dir, unlisted_files
from deltafleet.checkpoint import (CHECKPOINT_INDEX_NAME, CHECKPOINT_NAME, SIDECAR_FILES, Checkpoint, CheckpointError,
                                   check_same_architecture, read_json, row_block, ties_head)
from deltafleet.kernels import pack_signs, packed_width, reconstruct

FORMAT = "bitdelta"
FORMAT_VERSION = 1  # what matrix and row artifacts are written as; rowcol needs version 2
FORMAT_VERSIONS = (1, 2)  # what the reader reads
MANIFEST_NAME = "bitdelta.json"
DELTA_NAME = "delta.safetensors"
DELTA_INDEX_NAME = "delta.safetensors.index.json"
SIGN_SUFFIX = ".sign"
ALPHA_SUFFIX = ".alpha"
BETA_SUFFIX = ".beta"
GRANULARITIES = ("matrix", "row", "rowcol")
DEFAULT_MAX_SHARD_BYTES = 1_000_000_000
log = logging.getLogger(__name__)
VOCAB_MATRIX_SUFFIXES = ("embed_tokens.weight", "lm_head.weight")  # Llama, Mistral, Qwen2 names

_FP16_TINY = float(torch.finfo(torch.float16).tiny)  # below: subnormal, fewer significant bits
_FINGERPRINT_SCHEME = b"deltafleet-fingerprint-v1\0"
_SAMPLE_ROWS = 8  # rows hashed per >=2-D tensor
_SMALL_1D = 1 << 16  # 1-D tensors up to this many elements are hashed whole
_SAMPLE_CHUNK = 4096  # elements per sampled chunk of a larger 1-D tensor
_HASH_BLOCK = 1 << 20


class ArtifactError(CheckpointError):
    """A BitDelta artifact (or the checkpoints it is built from) is missing, malformed or corrupt.

    A subclass of :class:`deltafleet.checkpoint.CheckpointError`, which the checkpoint reader raises
    for a truncated or malformed safetensors file: catching ``CheckpointError`` catches both."""


class FingerprintMismatchError(ArtifactError):
    """The artifact was exported against another base than the one it is being applied to."""


# --------------------------------------------------------------------------------------------
# Checkpoint streaming and fingerprint
# --------------------------------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _evenly_spaced(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def fingerprint(checkpoint_dir: str | Path) -> str:
    """Cheap, content-sampling fingerprint of a Hugging Face safetensors checkpoint.

    Streams tensor by tensor (sorted by name, so re-sharding the same weights does not change it)
    and hashes each tensor's name, dtype, shape and a content sample read with ``get_slice``: up
    to 8 evenly spaced rows of a tensor with ≥2 dimensions (viewed as ``[prod(shape[:-1]),
    shape[-1]]``, so a stacked MoE weight costs 8 rows, not 8 experts), a 0-D or 1-D tensor of
    ≤65,536 elements whole, and 8 evenly spaced chunks of 4,096 elements of a longer 1-D tensor.
    For a 70B base that reads a few hundred MB at most, never the whole model.

    Args:
        checkpoint_dir: folder with ``model.safetensors`` or ``model.safetensors.index.json`` +
            shards.

    Returns:
        ``"sha256:<64 hex digits>"``. It changes if any tensor's name, dtype or shape changes, or
        if its sampled content does (a change confined to unsampled rows goes unnoticed).

    Raises:
        FileNotFoundError: if the folder holds no safetensors checkpoint.
        ArtifactError: if the index is malformed or names a missing shard.
    """
    h = hashlib.sha256(_FINGERPRINT_SCHEME)
    ckpt = Checkpoint(checkpoint_dir)
    for name in ckpt.names():
        info = ckpt.info(name)
        shape = list(info.shape)
        h.update(json.dumps([name, info.dtype_name, shape]).encode() + b"\0")
        numel = info.numel
        if numel == 0:
            continue
        if len(shape) >= 2:  # rows of the tensor viewed as [prod(shape[:-1]), shape[-1]]
            rows = _evenly_spaced(numel // shape[-1], _SAMPLE_ROWS)
            samples = [ckpt.get_rows(name, r, r + 1) for r in rows]
        elif len(shape) == 0 or numel <= _SMALL_1D:
            samples = [ckpt.get(name)]
        else:
            starts = _evenly_spaced(numel - _SAMPLE_CHUNK + 1, _SAMPLE_ROWS)
            samples = [ckpt.get_flat(name, s, s + _SAMPLE_CHUNK) for s in starts]
        for sample in samples:
            h.update(_tensor_bytes(sample))
    return "sha256:" + h.hexdigest()


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _deltafleet_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("deltafleet")
    except metadata.PackageNotFoundError:  # running from a source tree without an install
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            import tomllib

            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except Exception:  # noqa: BLE001 — provenance is best effort, never fatal
            return "unknown"


def is_vocab_matrix(name: str) -> bool:
    """Whether parameter ``name`` is indexed by token id (input embeddings or the LM head).

    Their rows move very unevenly in a fine-tune (a domain uses a small part of the vocabulary,
    and rows of unseen tokens barely change), so one α per matrix inflates the many small row
    deltas and shrinks the few large ones. They always get one α per row (row granularity).
    """
    return name.endswith(VOCAB_MATRIX_SUFFIXES)


_READ_AHEAD = 4  # blocks of rows in flight (each read from both checkpoints)


def _blocks(ft: Checkpoint, names: list[str], block_elements: int) -> list[tuple[str, int, int]]:
    """``(P, r0, r1)`` for every block of rows of the matrices ``names``, in order."""
    out = []
    for name in names:
        info = ft.info(name)
        d_out, d_in = info.shape
        step = row_block(info, block_elements)
        out += [(name, r0, min(d_out, r0 + step)) for r0 in range(0, d_out, step)]
    return out


FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, n))


def format_version(granularity: str) -> int:
    """The format version an artifact of ``granularity`` is written as: 2 for ``rowcol`` (its
    ``P.beta`` and float16 scales are what version 2 adds), else 1, which every reader reads."""
    return 2 if granularity == "rowcol" else 1


def _compress_matrix(
    name: str, shape: tuple[int, int], per_row: bool, blocks: Iterator[tuple[int, int, torch.Tensor, torch.Tensor]],
    two_sided: bool = False,
) -> dict[str, torch.Tensor] | None:
    """Signs and α (and, ``two_sided``, β) of one same-shape 2-D matrix from its blocks of rows;
    None if Δ is all zero.

    ``blocks`` yields ``(r0, r1, W_ft[r0:r1], W_base[r0:r1])`` covering the rows in order. Only
    one block of float32 Δ is alive at a time, next to the packed signs of the whole matrix (1/16
    of its bf16 bytes) and one |Δ| sum per row (float32 over the row, float64 across rows).
    """
    d_out, d_in = shape
    sign = torch.empty(d_out, packed_width(d_in), dtype=torch.uint8)
    abs_sum = torch.zeros(d_out, dtype=torch.float64)
    for r0, r1, w_ft, w_base in blocks:
        delta = w_ft.float().sub_(w_base)  # Δ in float32 whatever the checkpoint dtype
        del w_ft, w_base
        sign[r0:r1] = pack_signs(delta)
        abs_sum[r0:r1] = delta.abs_().sum(dim=1)
        del delta
    finite = torch.isfinite(abs_sum)
    if not bool(finite.all()):  # α would be NaN or inf: an artifact that every loader refuses
        row = int((~finite).nonzero()[0])
        raise ValueError(f"{name}: the fine-tune or the base holds NaN or inf (row {row} of Δ = W_ft − W_base): "
                         "nothing was exported")
    if not bool(abs_sum.any()):  # |Δ| sums to 0 only where every Δ is 0 (or the matrix is empty)
        return None
    # Eq. 1, §3.1: α = mean|Δ| over the matrix, or over each row for row granularity
    alpha = abs_sum / d_in if per_row or two_sided else abs_sum.sum() / (d_out * d_in)
    if two_sided:  # the row solution, β = 1: distillation fits both sides (module docstring)
        big = alpha > torch.finfo(torch.float16).max
        if bool(big.any()):  # would be inf in float16: an artifact that every loader refuses
            raise ValueError(f"{name}: row {int(big.nonzero()[0])} has mean |Δ| {float(alpha[big][0]):.4g}, beyond "
                             "float16's range of granularity rowcol's scales: export it with granularity row "
                             "(float32 scales); nothing was exported")
        small = int((alpha[alpha > 0] < _FP16_TINY).sum())
        if small:
            log.warning("%s: %d row scale(s) below %.2g lose precision in float16 (granularity rowcol); "
                        "granularity row keeps them in float32", name, small, _FP16_TINY)
        return {name + SIGN_SUFFIX: sign, name + ALPHA_SUFFIX: alpha.to(torch.float16).contiguous(),
                name + BETA_SUFFIX: torch.ones(d_in, dtype=torch.float16)}
    return {name + SIGN_SUFFIX: sign, name + ALPHA_SUFFIX: alpha.to(torch.float32).contiguous()}


VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_variant_name(variant: str) -> None:
    """Raise ValueError unless ``variant`` can name an artifact folder and a model id: 1–64 letters,
    digits, ``.``, ``_`` or ``-``, not starting with ``.``, ``_`` or ``-`` (no path separators: the
    artifact is ``<artifacts_dir>/<variant>``, where the server finds it)."""
    if not isinstance(variant, str) or not VARIANT_NAME.fullmatch(variant):
        raise ValueError(f"variant must be a name of 1 to 64 letters, digits, '.', '_' or '-' that starts with a "
                         f"letter or digit, got {variant!r}")


def _base_vocab_sizes(base_dir: Path) -> set[int]:
    """The base's ``vocab_size`` from its ``config.json`` (and a nested ``text_config``), if any."""
    try:
        config = json.loads((base_dir / "config.json").read_text())
    except (OSError, ValueError):
        return set()
    found = {config.get("vocab_size"), (config.get("text_config") or {}).get("vocab_size")}
    return {v for v in found if isinstance(v, int)}


def resizes_vocabulary(name: str, base_shape: tuple[int, ...], shape: tuple[int, ...], vocab: set[int]) -> bool:
    """Whether ``shape`` differs from the base's ``base_shape`` of parameter ``name`` as a resized
    vocabulary does: in one dimension, which is a vocabulary matrix's rows (:func:`is_vocab_matrix`)
    or the base's ``vocab_size`` (one of ``vocab``: another family's embedding name, an LM head's bias)."""
    if len(base_shape) != len(shape):
        return False
    dims = [i for i in range(len(shape)) if base_shape[i] != shape[i]]
    return len(dims) == 1 and ((is_vocab_matrix(name) and dims == [0]) or base_shape[dims[0]] in vocab)


def _check_shapes(base: Checkpoint, ft: Checkpoint, base_dir: Path, finetuned_dir: Path) -> None:
    """Raise ArtifactError for a parameter of both checkpoints whose shape differs, unless it is indexed
    by token and the vocabulary was resized (:func:`resizes_vocabulary`). Any other change means the
    fine-tune is of another architecture, which no base + delta can serve."""
    vocab = _base_vocab_sizes(base_dir)
    for name in ft.names():
        if name not in base:
            continue
        b, f = tuple(base.info(name).shape), tuple(ft.info(name).shape)
        if b == f or resizes_vocabulary(name, b, f, vocab):
            continue
        raise ArtifactError(
            f"{name}: shape {list(f)} in {finetuned_dir} differs from the base's {list(b)} in {base_dir}; "
            "only a parameter indexed by token may change shape, along the vocabulary (a resized vocabulary): "
            "is this a fine-tune of that base?")


def _compress_tensors(
    base: Checkpoint, ft: Checkpoint, granularity: str, block_elements: int = 1 << 24
) -> Iterator[tuple[str, int, dict[str, torch.Tensor], str | None]]:
    """Yield ``(P, numel, stored tensors, kind)`` per fine-tuned parameter; kind None: omitted.

    Same-shape matrices are read in blocks of rows of at most ``block_elements`` elements by a
    small thread pool that keeps ``_READ_AHEAD`` blocks (of both checkpoints) in flight ahead of
    the computation, across matrix boundaries: file reads release the GIL, so reading and
    computing overlap.
    """
    names = ft.names()

    def matrix(name: str) -> bool:
        fi = ft.info(name)
        # an empty matrix ([N, 0] or [0, N]) has no signs to pack, and an integer or bool one is no
        # weight (an index table, a mask): left to the other tensors' rule, stored whole if changed
        return name in base and len(fi.shape) == 2 and all(fi.shape) and base.info(name).shape == fi.shape \
            and fi.dtype.is_floating_point and base.info(name).dtype.is_floating_point

    plan = _blocks(ft, [n for n in names if matrix(n)], block_elements)
    with ThreadPoolExecutor(max_workers=2 * _READ_AHEAD) as pool:
        inflight: list = []  # the next min(_READ_AHEAD, remaining) blocks of the plan, in order
        upcoming = iter(plan)

        def fill() -> None:
            for p, r0, r1 in itertools.islice(upcoming, _READ_AHEAD - len(inflight)):
                inflight.append((p, r0, r1, pool.submit(ft.get_rows, p, r0, r1),
                                 pool.submit(base.get_rows, p, r0, r1)))

        def blocks_of(name: str) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
            while inflight and inflight[0][0] == name:
                _, r0, r1, f_ft, f_base = inflight.pop(0)
                fill()
                yield r0, r1, f_ft.result(), f_base.result()

        fill()
        for name in names:
            fi = ft.info(name)
            if matrix(name):
                per_row = granularity == "row" or is_vocab_matrix(name)
                stored = _compress_matrix(name, fi.shape, per_row, blocks_of(name), granularity == "rowcol")
                yield (name, fi.numel, {}, None) if stored is None else (name, fi.numel, stored, "compressed")
                continue
            w_ft = ft.get(name)
            bi = base.info(name) if name in base else None
            if bi is not None and bi.shape == fi.shape and bi.dtype == fi.dtype and torch.equal(base.get(name), w_ft):
                yield name, fi.numel, {}, None
            else:
                yield name, fi.numel, {name: w_ft}, "full"


def _generation_settings(folder: Path) -> dict:
    """What an engine reads beside the weights to generate: the end-of-sequence ids and the chat template."""
    gen, config, tok = (read_json(folder / f) or {} for f in ("generation_config.json", "config.json",
                                                              "tokenizer_config.json"))
    eos = next((d["eos_token_id"] for d in (gen, config) if "eos_token_id" in d), None)
    eos = sorted(set(eos)) if isinstance(eos, list) else [eos] if eos is not None else None  # 2 and [2] alike
    template = tok.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(errors="replace")
    return {"eos_token_id": eos, "chat template": template}


def _warn_dropped_generation_settings(base_dir: Path, finetuned_dir: Path) -> None:
    """An artifact holds weights only: the server and ``format=hf`` take the base's config, generation
    config and tokenizer. Warn where the fine-tune's end-of-sequence ids or chat template differ from
    the base's (an instruct fine-tune of a pretrained base), since they would be lost."""
    base, ft = _generation_settings(base_dir), _generation_settings(finetuned_dir)
    differ = [k for k in base if ft[k] is not None and ft[k] != base[k]]
    if differ:
        said = [f"{k} {ft[k]} against {base[k]}" if k == "eos_token_id" else k for k in differ]
        warnings.warn(f"{finetuned_dir} has another {' and '.join(said)} than the base {base_dir}; the artifact "
                      "keeps the weights only, and the server and format=hf use the base's", stacklevel=4)


def compress(
    base_dir: str | Path,
    finetuned_dir: str | Path,
    out_dir: str | Path,
    *,
    variant: str,
    granularity: Literal["matrix", "row"] = "matrix",
    provenance: dict | None = None,
    base_name_or_path: str | None = None,
    max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
    show_progress: bool = False,
    overwrite: bool = False,
) -> dict:
    """Export a fine-tuned checkpoint as a BitDelta artifact against its base (format version 1;
    version 2 for ``granularity="rowcol"``).

    For every parameter ``P`` of the fine-tuned checkpoint (streamed one tensor at a time):

    - 2-D and the same shape as in the base: ``Δ = W_ft − W_base`` in float32, stored as
      ``P.sign`` (uint8 ``[d_out, ceil(d_in/8)]``, bit j LSB-first of byte b = ``Δ[r, 8b+j] > 0``)
      and ``P.alpha`` (float32; ``[]`` with α = mean|Δ| for ``granularity="matrix"``, BitDelta
      arXiv:2402.10193 §3.1 Eq. 1–2; ``[d_out]`` with α_r = mean_j |Δ_rj| for ``"row"``).
      Vocabulary matrices (``embed_tokens``, ``lm_head``: :func:`is_vocab_matrix`) always get
      row α, whatever the granularity. ``"rowcol"``: float16 α ``[d_out]`` (α_r = mean_j |Δ_rj|)
      and ``P.beta`` float16 ``[d_in]`` of ones, for every matrix (the vocabulary's too).
      Omitted if Δ is exactly zero everywhere.
    - anything else (1-D, 0-D, a vocabulary matrix with rows added, not in the base): stored in
      full as ``P`` in its original dtype, unless it is exactly equal to the base (same dtype, shape
      and values). Any other change of shape is refused (ArtifactError).

    The artifact is built in ``.<name>.tmp-<host>.<pid>.<random>`` next to ``out_dir``, fsynced and
    renamed into place; an existing ``out_dir`` is replaced only once the new artifact is complete.
    On any error the temporary folder is removed and an existing artifact is left as it was (one
    left by a killed process goes at the next export to the same folder).

    Args:
        base_dir: Hugging Face safetensors checkpoint of the base (fp32, fp16 or bf16).
        finetuned_dir: the fine-tuned checkpoint, same parameter names as the base (a tied
            ``lm_head`` simply has no tensor of its own in either).
        out_dir: artifact folder to create or replace (``artifacts/<variant>/``).
        variant: variant name recorded in the manifest (e.g. ``"coder"``).
        granularity: ``"matrix"`` (one α per matrix, the paper's choice), ``"row"`` or
            ``"rowcol"`` (α per row and β per column, to be fitted by scale distillation).
        provenance: extra provenance merged over the defaults ``run_id`` (a fresh UUID),
            ``config`` (None), ``created`` (ISO 8601 UTC, now), ``finetuned`` (path and
            fingerprint), ``deltafleet_version``.
        base_name_or_path: recorded as ``base.name_or_path``; defaults to ``str(base_dir)``.
        max_shard_bytes: cut the output into ``delta-0000i-of-0000N.safetensors`` shards of at
            most this many tensor bytes (a single larger tensor gets a shard of its own), with a
            Hugging Face-style ``delta.safetensors.index.json``; ``None``: one ``delta.safetensors``
            whatever its size. Only one shard is held in memory (twice over while safetensors
            serialises it), so this bounds the export's memory: the default, 1 GB, keeps a 7B
            export under 4 GB resident and is one file for any model under ~8B parameters.
        show_progress: a tqdm progress bar over the fine-tuned checkpoint's tensors.
        overwrite: replace ``out_dir`` whatever it holds. Without it, an ``out_dir`` holding anything
            but an earlier artifact is refused (ValueError), as is one overlapping an input.

    Returns:
        The manifest written to ``out_dir/bitdelta.json``. ``stats.bytes`` counts the delta
        files (safetensors headers included, manifest excluded); ``stats.bits_per_parameter`` is
        ``8 · bytes / parameters`` over all parameters of the fine-tuned model.

    Raises:
        ValueError: on an unknown ``granularity``, a ``variant`` that is no name
            (:func:`check_variant_name`), a fine-tune of another architecture than the base's
            (``config.json``: :func:`deltafleet.checkpoint.check_same_architecture`), a ``max_shard_bytes``
            that is not a positive integer, or an ``out_dir`` it must not replace (above).
        FileNotFoundError: if either folder holds no safetensors checkpoint.
        ArtifactError: if the base has parameters the fine-tuned checkpoint lacks, one of a shape
            the base's does not allow (:func:`_check_shapes`), or a stored tensor name would
            collide with another.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    check_variant_name(variant)
    _check_max_shard_bytes(max_shard_bytes)
    base_dir, finetuned_dir, out_dir = Path(base_dir), Path(finetuned_dir), Path(out_dir).absolute()
    check_replaceable(out_dir, [base_dir, finetuned_dir], lambda f: not_artifact(f, variant), job="export",
                      overwrite=overwrite)
    check_same_architecture([base_dir, finetuned_dir])  # not a fine-tune of this base: its extra tensors stored whole

    base_fp = fingerprint(base_dir)
    ft_fp = fingerprint(finetuned_dir)
    with staged_dir(out_dir) as tmp:
        shards = _Shards(tmp, max_shard_bytes, mode=0o644)  # safetensors creates 0600 files
        parameters = compressed = full = 0

        base, ft = Checkpoint(base_dir), Checkpoint(finetuned_dir)
        for ck, folder in ((base, base_dir), (ft, finetuned_dir)):
            eight = next((n for n in ck.names() if ck.info(n).dtype in FLOAT8), None)
            if eight is not None:  # nothing to serve it with: the kernels multiply bf16 / fp16 weights
                raise ValueError(f"{eight}: {folder} holds {ck.info(eight).dtype_name} weights; the BitDelta "
                                 "export takes float32, float16 or bfloat16 checkpoints (convert it first): "
                                 "nothing was exported")
        if "lm_head.weight" in base and ties_head(base_dir):
            # transformers ties the head of a base whose config says so, ignoring a stored one, and so
            # does the server: the export compares against the head the base runs with (none of its own)
            del base.tensors["lm_head.weight"]
        missing = sorted(set(base.tensors) - set(ft.tensors))
        if missing:
            raise ArtifactError(
                f"{finetuned_dir} lacks {len(missing)} parameter(s) of the base "
                f"{base_dir}: {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}"
            )
        if "lm_head.weight" in ft and "lm_head.weight" not in base \
                and ties_head(finetuned_dir):
            # transformers ties the head of a model whose config says so, and ignores a stored one: so
            # does the export (stored in full, it would untie a head that is the embedding)
            del ft.tensors["lm_head.weight"]
        _check_shapes(base, ft, base_dir, finetuned_dir)
        _warn_dropped_generation_settings(base_dir, finetuned_dir)
        names = ft.names()
        progress = tqdm(total=len(names), desc=f"bitdelta {variant}", unit="tensor",
                        disable=not show_progress)
        for name, n, stored, kind in _compress_tensors(base, ft, granularity):
            progress.update(1)
            parameters += n
            compressed += n if kind == "compressed" else 0
            full += n if kind == "full" else 0
            if kind == "full" and name.endswith(SIGN_SUFFIX):
                raise ArtifactError(
                    f"parameter {name!r} would be stored in full under a name ending in "
                    f"{SIGN_SUFFIX!r}, which the format reserves for packed signs"
                )
            if kind == "full" and any(t.is_floating_point() and not bool(torch.isfinite(t).all())
                                      for t in stored.values()):  # as a compressed matrix's Δ is checked
                raise ValueError(f"{name}: the fine-tune holds NaN or inf in this tensor, which would be stored in "
                                 "full: nothing was exported")
            for key in stored:
                if key in shards.part_of:
                    raise ArtifactError(f"stored tensor name {key!r} is produced twice")
            shards.add(stored)
        progress.close()

        names_out = shards.finish(DELTA_NAME, "delta")
        if len(names_out) > 1:  # Hugging Face-style shards and index
            shards.write_index(tmp / DELTA_INDEX_NAME, names_out, sum((tmp / f).stat().st_size for f in names_out))
            names_out.append(DELTA_INDEX_NAME)
        files = {f: _sha256_file(tmp / f) for f in names_out}
        nbytes = sum((tmp / f).stat().st_size for f in files)

        prov: dict[str, Any] = {
            "run_id": uuid.uuid4().hex,
            "config": None,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "finetuned": {"name_or_path": str(finetuned_dir), "fingerprint": ft_fp,
                          **_merged_from(finetuned_dir, ft_fp)},
            "deltafleet_version": _deltafleet_version(),
        }
        prov.update(provenance or {})
        manifest = {
            "format": FORMAT,
            "format_version": format_version(granularity),
            "variant": variant,
            "base": {
                "name_or_path": base_name_or_path if base_name_or_path is not None else str(base_dir),
                "fingerprint": base_fp,
            },
            "granularity": granularity,
            "files": files,
            "stats": {
                "parameters": parameters,
                "compressed_parameters": compressed,
                "full_parameters": full,
                "bytes": nbytes,
                "bits_per_parameter": 8 * nbytes / parameters if parameters else 0.0,
            },
            "provenance": prov,
        }
        write_manifest(tmp, manifest)
    if compressed == 0 and full == 0:  # not an error (a variant may change nothing), but rarely meant
        log.warning("%s: the fine-tune equals the base (every Δ is zero): the artifact serves the base itself "
                    "(is %s the fine-tune?)", variant, finetuned_dir)
    return manifest


class _Shards:
    """Tensors gathered into shards of at most ``max_shard_bytes`` tensor bytes (None: one shard; a
    group larger than that gets a shard of its own), each written to ``folder`` (safetensors
    ``save_file``, then ``mode``, then fsync) as soon as the next group would not fit, so that one
    shard at most is held in memory; :meth:`finish` names them."""

    def __init__(self, folder: Path, max_shard_bytes: int | None, mode: int | None = None):
        self.folder, self.limit, self.mode = folder, max_shard_bytes, mode
        self.shard: dict[str, torch.Tensor] = {}  # the shard being filled
        self.shard_bytes = self.tensor_bytes = 0
        self.parts: list[Path] = []
        self.part_of: dict[str, int] = {}  # tensor name -> its shard's number

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put ``tensors`` into one shard, the current one if they fit in it."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.limit is not None and self.shard and self.shard_bytes + size > self.limit:
            self._flush()
        for key, t in tensors.items():
            self.shard[key], self.part_of[key] = t, len(self.parts)
        self.shard_bytes += size
        self.tensor_bytes += size

    def _flush(self) -> None:
        part = self.folder / f"part-{len(self.parts):05d}.safetensors"
        # one metadata key only: safetensors writes its metadata map in hash order, so two keys would
        # make the file bytes (and an artifact manifest's sha256) vary between processes
        save_file(self.shard, part, metadata={"format": "pt"})
        if self.mode is not None:
            part.chmod(self.mode)
        fsync_path(part)
        self.parts.append(part)
        self.shard, self.shard_bytes = {}, 0

    def finish(self, single: str, prefix: str) -> list[str]:
        """Write the last shard and name the shards: ``single`` for one, else Hugging Face's
        ``<prefix>-0000i-of-0000N.safetensors``; their names, in order."""
        if self.shard or not self.parts:
            self._flush()
        n = len(self.parts)
        names = [single] if n == 1 else [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for part, name in zip(self.parts, names):
            os.replace(part, self.folder / name)
        return names

    def write_index(self, path: Path, names: list[str], total_size: int) -> None:
        """Hugging Face's index of the shards ``names`` (:meth:`finish`'s): ``total_size`` and each
        tensor's file."""
        index = {"metadata": {"total_size": total_size},
                 "weight_map": {k: names[i] for k, i in sorted(self.part_of.items())}}
        path.write_text(json.dumps(index, indent=2) + "\n")


def _check_max_shard_bytes(max_shard_bytes: Any) -> None:
    """Refuse a shard size that is no positive ``int`` (``bool`` included) and not None: ValueError."""
    if max_shard_bytes is not None and (type(max_shard_bytes) is not int or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes must be a positive integer (bytes) or None, got {max_shard_bytes!r}")


def _merged_from(finetuned_dir: str | Path, weights: str) -> dict:
    """``{"merge": {method, params, base, models}}`` where the fine-tune is a merge's output (its
    ``merge.json``, written by ``merge/run.py``) and still holds the weights that merge wrote (its
    fingerprint is ``weights``: a folder written over since is no longer the merge), so that the
    artifact says how it was made; else {}."""
    from deltafleet.merge.stream import WRITTEN_BY

    record = read_json(Path(finetuned_dir) / "merge.json")
    if record is None or record.get("written_by") != WRITTEN_BY or record.get("fingerprint") != weights:
        return {}
    return {"merge": {k: record.get(k) for k in ("method", "params", "base", "models")}}


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write ``folder/bitdelta.json`` (indented JSON, trailing newline) and fsync it; the caller's
    staged folder makes it atomic."""
    with open(folder / MANIFEST_NAME, "w") as f:
        json.dump(manifest, f, indent=2, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


@dataclass
class Artifact:
    """A loaded, validated BitDelta artifact.

    Attributes:
        path: the artifact folder.
        manifest: the parsed ``bitdelta.json``.
        signs: ``P`` → uint8 ``[d_out, ceil(d_in/8)]`` packed signs (keys without ``.sign``).
        alphas: ``P`` → float32 ``[]`` (matrix granularity) or ``[d_out]`` (row granularity), or
            float16 ``[d_out]`` (rowcol).
        betas: ``P`` → float16 ``[d_in]`` column scales (rowcol only; empty otherwise).
        full: ``P`` → parameters stored uncompressed, in their original dtype.
    """

    path: Path
    manifest: dict
    signs: dict[str, torch.Tensor] = field(default_factory=dict)
    alphas: dict[str, torch.Tensor] = field(default_factory=dict)
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    betas: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def variant(self) -> str:
        return self.manifest["variant"]

    @property
    def granularity(self) -> str:
        return self.manifest["granularity"]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors held (signs + scales + full tensors)."""
        return sum(
            t.numel() * t.element_size()
            for d in (self.signs, self.alphas, self.betas, self.full)
            for t in d.values()
        )


def _inside(path: Path, name: str) -> Path:
    """``path / name``, a file of the artifact folder ``path``, where it is one: a symbolic link that
    leads outside the folder (resolved all the way, the folder's own links included) is refused, so
    an artifact never reads what its folder does not hold (another artifact's files, anything else on
    the machine). A link within the folder is followed.

    Raises:
        ArtifactError: naming the file.
    """
    file = path / name
    try:
        outside = not file.resolve().is_relative_to(path.resolve())
    except (OSError, RuntimeError):  # a loop of links (RuntimeError before Python 3.13)
        raise ArtifactError(f"{path}: file {name} is a loop of symbolic links") from None
    if outside:
        raise ArtifactError(f"{path}: file {name} is a symbolic link leading outside the artifact folder; "
                            "an artifact holds its own files (copy the file in)")
    return file


# what a path that is no regular file is (stat's test → its name), for the manifest's refusal
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def manifest_json(folder: str | Path) -> Any:
    """The JSON value of ``folder``'s manifest (``bitdelta.json``; a link to one is followed), or None
    where there is none: every reader of a manifest reads it through this. Only a regular file is
    read: it is opened without blocking and checked on the open file, so a named pipe (whose read
    would block for ever), a directory or a device named like the manifest is refused for what it
    is, and nothing put in its place between the check and the read is read.

    Raises:
        ArtifactError: ``<folder>/bitdelta.json`` is no regular file (naming what it is), cannot be
            opened, or is not JSON text in UTF-8 (also JSON nested past the parser's depth).
    """
    file = Path(folder) / MANIFEST_NAME
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ArtifactError(f"{file}: cannot open the manifest ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a file")
        raise ArtifactError(f"{file}: the manifest is {kind}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (nested past the parser's depth)
        raise ArtifactError(f"{file}: cannot parse the manifest ({e})") from e


def _read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST_NAME
    manifest = manifest_json(path)
    if manifest is None:
        raise ArtifactError(f"{path}: no {MANIFEST_NAME}; not a BitDelta artifact folder")
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{manifest_path}: the manifest must be a JSON object")
    if manifest.get("format") != FORMAT:
        raise ArtifactError(
            f"{manifest_path}: format is {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    version = manifest.get("format_version")
    if type(version) is not int or version not in FORMAT_VERSIONS:
        raise ArtifactError(
            f"{manifest_path}: format_version {version!r} is not supported "
            f"(this reader reads versions {', '.join(map(str, FORMAT_VERSIONS))})"
        )
    for key in ("variant", "base", "granularity", "files"):
        if key not in manifest:
            raise ArtifactError(f"{manifest_path}: missing required key {key!r}")
    if not isinstance(manifest["variant"], str) or not manifest["variant"]:
        raise ArtifactError(f"{manifest_path}: variant must be a non-empty string, got {manifest['variant']!r}")
    if manifest["granularity"] not in GRANULARITIES:
        raise ArtifactError(
            f"{manifest_path}: granularity {manifest['granularity']!r} is not one of {GRANULARITIES}"
        )
    if version < format_version(manifest["granularity"]):
        raise ArtifactError(f"{manifest_path}: granularity {manifest['granularity']!r} needs format_version "
                            f"{format_version(manifest['granularity'])}, the manifest says {version}")
    base = manifest["base"]
    if not isinstance(base, dict) or not isinstance(base.get("fingerprint"), str):
        raise ArtifactError(f"{manifest_path}: base.fingerprint is missing")
    files = manifest["files"]
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{manifest_path}: files must be a non-empty object name → sha256")
    for name, digest in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ArtifactError(f"{manifest_path}: file name {name!r} must be a plain file name")
        if not isinstance(digest, str):
            raise ArtifactError(f"{manifest_path}: sha256 of {name} must be a hex string")
    return manifest


def _tensor_files(path: Path, files: dict) -> dict[str, list[str] | None]:
    """Safetensors files to read → the tensor names each must hold (None: whatever it holds)."""
    if DELTA_INDEX_NAME in files:
        try:
            weight_map = json.loads((path / DELTA_INDEX_NAME).read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise ArtifactError(f"{path / DELTA_INDEX_NAME}: not a safetensors index ({e})") from e
        if not isinstance(weight_map, dict):
            raise ArtifactError(f"{path / DELTA_INDEX_NAME}: weight_map must be an object")
        shards: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str):
                raise ArtifactError(f"{path / DELTA_INDEX_NAME}: the file of {tensor!r} must be a file name, "
                                    f"got {shard!r}")
            shards.setdefault(shard, []).append(tensor)
        for shard in shards:
            if shard not in files:
                raise ArtifactError(
                    f"{path}: shard {shard!r} of {DELTA_INDEX_NAME} is not in the manifest's files"
                )
        # the manifest and the index must agree: a listed tensor file the index leaves out would be
        # skipped, its matrices served as the base's
        unmapped = sorted(f for f in files if f.endswith(".safetensors") and f not in shards)
        if unmapped:
            raise ArtifactError(f"{path}: {', '.join(unmapped)} in the manifest's files but no tensor of "
                                f"{DELTA_INDEX_NAME} maps to it")
        return shards
    if DELTA_NAME not in files:
        raise ArtifactError(f"{path}: the manifest lists neither {DELTA_NAME} nor {DELTA_INDEX_NAME}")
    return {DELTA_NAME: None}


def load_artifact(
    path: str | Path,
    *,
    base_fingerprint: str | None = None,
    force: bool = False,
    device: str | torch.device = "cpu",
    verify_hashes: bool = True,
    values: bool = True,
) -> Artifact:
    """Read and validate a BitDelta artifact folder (format version 1 or 2).

    Checks, in order: ``bitdelta.json`` exists and parses; ``format == "bitdelta"``,
    ``format_version`` 1 or 2, and 2 for granularity rowcol; the base fingerprint (when
    ``base_fingerprint`` is given); every file in ``files`` exists and (``verify_hashes``) matches
    its sha256; every ``P.sign`` is uint8 ``[d_out, ceil(d_in/8)]`` with a finite, non-negative
    ``P.alpha``: float32 ``[]`` (granularity matrix) or ``[d_out]`` (granularity row), or float16
    ``[d_out]`` with a finite, non-negative float16 ``P.beta`` ``[d_in]`` (granularity rowcol); every
    floating tensor stored in full is finite, and none is also stored as signs. The manifest and
    every listed file must lie in the folder: a symbolic link leading outside it is refused. A tensor named
    ``X.alpha`` or ``X.beta`` with no ``X.sign`` is a parameter stored in full (:func:`materialize`
    refuses one whose ``X`` is a parameter: a scale that lost its signs).

    Args:
        path: the artifact folder (``artifacts/<variant>/``).
        base_fingerprint: fingerprint of the base it will be applied to (see :func:`fingerprint`).
        force: load even if ``base_fingerprint`` differs from the manifest's.
        device: where the tensors are placed.
        verify_hashes: hash every file (reads the whole artifact once more); turn off only for
            files already verified.
        values: read the tensors. False: read only the safetensors files' headers, and give every
            tensor as a meta tensor of its dtype and shape (``device`` is ignored): the checks above
            but the hashes and the values (scales, full tensors), at the cost of the manifest and the
            headers (the server's check of every artifact at start). A tensor of a dtype torch has no
            meta counterpart for here is read.

    Returns:
        The :class:`Artifact`.

    Raises:
        FingerprintMismatchError: the artifact was exported against another base (message names
            both fingerprints), unless ``force``.
        ArtifactError: anything else missing, malformed or corrupt (message names the file or
            tensor).
    """
    path = Path(path)
    _inside(path, MANIFEST_NAME)
    manifest = _read_manifest(path)
    expected = manifest["base"]["fingerprint"]
    if base_fingerprint is not None and base_fingerprint != expected and not force:
        raise FingerprintMismatchError(
            f"{path}: artifact {manifest['variant']!r} was exported against base fingerprint "
            f"{expected}, but the base given has fingerprint {base_fingerprint}; "
            "export it again against this base, or, in a job that takes it (serve, export format=hf), set "
            "force=true to apply it anyway"
        )
    files = manifest["files"]
    for name, digest in files.items():  # every file read below is one of these (the index, the shards)
        file = _inside(path, name)
        if not file.is_file():
            raise ArtifactError(f"{path}: file {name} listed in the manifest is missing")
        if verify_hashes and values and _sha256_file(file) != digest.lower():
            raise ArtifactError(
                f"{path}: file {name} does not match its sha256 in {MANIFEST_NAME} "
                "(corrupt or modified artifact)"
            )

    tensors: dict[str, torch.Tensor] = {}
    for file, expected_names in _tensor_files(path, files).items():
        try:
            with safe_open(path / file, framework="pt", device=str(device) if values else "cpu") as f:
                names = list(f.keys())
                if expected_names is not None and sorted(names) != sorted(expected_names):
                    raise ArtifactError(
                        f"{path}: shard {file} does not hold the tensors {DELTA_INDEX_NAME} maps to it"
                    )
                for name in names:
                    if name in tensors:
                        raise ArtifactError(f"{path}: tensor {name!r} appears in more than one file")
                    tensors[name] = f.get_tensor(name) if values else _header_tensor(f, name)
        except ArtifactError:
            raise
        except Exception as e:  # safetensors raises its own error types on a malformed file
            raise ArtifactError(f"{path}: cannot read {file} as safetensors ({e})") from e

    art = Artifact(path=path, manifest=manifest)
    row = manifest["granularity"] == "row"
    two_sided = manifest["granularity"] == "rowcol"
    scale_dtype = torch.float16 if two_sided else torch.float32
    for name, t in tensors.items():
        if name.endswith(SIGN_SUFFIX):
            p = name[: -len(SIGN_SUFFIX)]
            alpha = tensors.get(p + ALPHA_SUFFIX)
            if alpha is None:
                raise ArtifactError(f"{path}: {name} has no matching {p + ALPHA_SUFFIX}")
            if t.dtype != torch.uint8 or t.dim() != 2:
                raise ArtifactError(
                    f"{path}: {name} must be uint8 [d_out, ceil(d_in/8)], got {t.dtype} {list(t.shape)}"
                )
            want = [t.shape[0]] if row or two_sided or is_vocab_matrix(p) else []
            if alpha.dtype != scale_dtype or list(alpha.shape) != want:
                raise ArtifactError(
                    f"{path}: {p + ALPHA_SUFFIX} must be {str(scale_dtype).removeprefix('torch.')} {want} for "
                    f"granularity {manifest['granularity']!r} and {name} {list(t.shape)}, "
                    f"got {alpha.dtype} {list(alpha.shape)}"
                )
            _check_scale(path, p + ALPHA_SUFFIX, alpha)
            art.signs[p], art.alphas[p] = t, alpha
            beta = tensors.get(p + BETA_SUFFIX)
            if two_sided:
                if beta is None:
                    raise ArtifactError(f"{path}: {name} has no matching {p + BETA_SUFFIX} (granularity rowcol)")
                d_in_max = 8 * t.shape[1]
                if beta.dtype != torch.float16 or beta.dim() != 1 or not d_in_max - 8 < beta.shape[0] <= d_in_max:
                    raise ArtifactError(f"{path}: {p + BETA_SUFFIX} must be float16 [d_in] with ceil(d_in/8) = "
                                        f"{t.shape[1]}, got {beta.dtype} {list(beta.shape)}")
                _check_scale(path, p + BETA_SUFFIX, beta)
                art.betas[p] = beta
            elif beta is not None:
                raise ArtifactError(f"{path}: {p + BETA_SUFFIX} is only valid with granularity 'rowcol', "
                                    f"not {manifest['granularity']!r}")
        elif name.endswith((ALPHA_SUFFIX, BETA_SUFFIX)) and name.rsplit(".", 1)[0] + SIGN_SUFFIX in tensors:
            continue  # taken with its sign
        else:
            if name + SIGN_SUFFIX in tensors:  # which of the two is the variant cannot be told
                raise ArtifactError(f"{path}: {name} is stored both in full and as packed signs "
                                    f"({name + SIGN_SUFFIX})")
            _check_full(path, name, t)
            art.full[name] = t
    return art


# safetensors' dtype names → torch's (what the header of a file says; load_artifact(values=False))
_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool}


def _header_tensor(f, name: str) -> torch.Tensor:
    """Tensor ``name`` of the open safetensors file ``f`` as its header gives it: a meta tensor of its
    dtype and shape, nothing read (a dtype not in :data:`_HEADER_DTYPES` is read)."""
    s = f.get_slice(name)
    dtype = _HEADER_DTYPES.get(s.get_dtype())
    return f.get_tensor(name) if dtype is None else torch.empty(s.get_shape(), dtype=dtype, device="meta")


def _check_scale(path: Path, name: str, t: torch.Tensor) -> None:
    if t.is_meta:  # load_artifact(values=False): no values to check
        return
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ArtifactError(f"{path}: {name} has negative or non-finite values")


def _check_full(path: Path, name: str, t: torch.Tensor) -> None:
    """Refuse a floating tensor stored in full that holds NaN or inf (the export refuses to write one):
    served, every output it reaches would be NaN, with nothing to say which tensor made it so."""
    if t.is_meta or not t.is_floating_point():  # load_artifact(values=False): no values to check
        return
    if not bool(torch.isfinite(t).all()):
        raise ArtifactError(f"{path}: {name} (stored in full) has non-finite values (NaN or inf)")


def _cast(t: torch.Tensor, dtype: torch.dtype, what: str, why: str) -> torch.Tensor:
    """``t`` in ``dtype``, refused where a finite value of it is beyond that dtype's range (float16:
    65504 at most), where the cast would make it inf. A value below the dtype's smallest one rounds to
    zero, as any cast rounds.

    Raises:
        ArtifactError: ``what`` holds a value beyond ``dtype``'s range (``why``: whose dtype it is).
    """
    out = t.to(dtype)
    _refuse_beyond(_beyond(t, out), dtype, what, why)
    return out


def _beyond(t: torch.Tensor, out: torch.Tensor) -> float | None:
    """The largest ``|value|`` of ``t`` that is finite there and inf in ``out`` (``t`` cast), or None."""
    if out.is_floating_point() and t.is_floating_point():
        over = torch.isinf(out) & torch.isfinite(t)
        if bool(over.any()):
            return float(t[over].abs().max())
    return None


def _refuse_beyond(worst: float | None, dtype: torch.dtype, what: str, why: str) -> None:
    """:func:`_cast`'s refusal of a value ``worst`` beyond ``dtype``'s range (None: none is)."""
    if worst is not None:
        name = str(dtype).removeprefix("torch.")
        raise ArtifactError(f"{what} holds {worst:.4g}, beyond what {name} ({why}) "
                            f"holds ({torch.finfo(dtype).max:.6g} at most): it would be inf there")


def materialize(base_dir: str | Path, artifact: Artifact) -> dict[str, torch.Tensor]:
    """The approximate fine-tuned state dict: base + artifact, on the CPU, streamed from the base.

    Compressed parameters become ``W_base + α·(2·bits − 1)`` (BitDelta Eq. 2; rowcol:
    ``W_base + α_r·β_c·(2·bits − 1)``, via :func:`deltafleet.kernels.reconstruct`, computed in
    float32) cast to the base dtype, refused where a value is beyond its range (a float16 base:
    65504); parameters stored in full replace (or add to) the base's, in their own dtype; every
    other parameter is the base's. The whole model is held at once: :func:`materialized_tensors`
    gives the same tensors one at a time.

    Args:
        base_dir: the base checkpoint the artifact was exported against (not re-fingerprinted
            here; :func:`load_artifact` checks that).
        artifact: from :func:`load_artifact`.

    Returns:
        ``{P: tensor}`` with the fine-tuned checkpoint's names, shapes and (for compressed
        parameters) the base dtype; without a tied base's stored ``lm_head.weight`` (its head is
        its embedding, as the export took it), unless the artifact stores a head in full.

    Raises:
        ArtifactError: as :func:`materialized_tensors`.
    """
    return dict(materialized_tensors(base_dir, artifact))


def materialized_tensors(base_dir: str | Path, artifact: Artifact) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`materialize`'s ``(P, tensor)`` pairs one at a time: each base tensor is read (and
    reconstructed) only when the iterator reaches it, so the caller holds what it keeps of them.

    The artifact's structure is checked against the base (every check below but the range of a
    reconstructed weight) when this is called, before the first tensor is read; a weight beyond the
    base dtype's range is refused when it is reached. The base's parameters come first, in
    :meth:`deltafleet.checkpoint.Checkpoint.names` order (those stored in full, and a tied base's
    stored head, left out), then the tensors stored in full, each once.

    Raises:
        ArtifactError: if a compressed parameter is missing from the base or its sign/alpha
            shapes do not fit the base weight; if a tensor stored in full has a shape other than the
            base's for its name (but along a resized vocabulary, :func:`resizes_vocabulary`); or if one
            is a scale without its signs (``P.alpha`` or ``P.beta`` where ``P`` is a parameter of the
            base or of the artifact, or a vocabulary matrix: no parameter can be named so); or if a
            reconstructed weight holds a value beyond the base dtype's range (inf there). The checks
            the server makes (``serve.delta.VariantDelta.check``), but for what a checkpoint may hold and
            the server does not serve: a resized vocabulary and parameters the base lacks.
    """
    base_dir = Path(base_dir)
    base = Checkpoint(base_dir)
    unknown = sorted(p for p in artifact.signs if p not in base)
    if unknown:
        raise ArtifactError(
            f"{artifact.path}: compressed parameter(s) not in base {base_dir}: {', '.join(unknown[:5])}"
        )
    vocab = _base_vocab_sizes(base_dir)
    for name, t in artifact.full.items():
        if name in base:
            b, f = tuple(base.info(name).shape), tuple(t.shape)
            if b != f and not resizes_vocabulary(name, b, f, vocab):
                raise ArtifactError(
                    f"{artifact.path}: {name} is stored in full with shape {list(f)}, the base's is {list(b)} "
                    f"in {base_dir}: only a parameter indexed by token may change shape, along the vocabulary")
        elif name.endswith((ALPHA_SUFFIX, BETA_SUFFIX)):
            p = name.rsplit(".", 1)[0]
            if p in base or p in artifact.full or is_vocab_matrix(p):
                raise ArtifactError(f"{artifact.path}: {name} has no matching {p + SIGN_SUFFIX}: a scale without "
                                    "its signs (a damaged artifact)")
    for name, sign in artifact.signs.items():  # from the headers: a misfit is refused before any read
        shape, alpha = base.info(name).shape, artifact.alphas[name]
        beta = artifact.betas.get(name)
        if len(shape) != 2 or tuple(sign.shape) != (shape[0], packed_width(shape[1])) or (
            alpha.dim() == 1 and alpha.shape[0] != shape[0]
        ) or (beta is not None and beta.shape[0] != shape[1]):
            raise ArtifactError(
                f"{artifact.path}: {name}.sign {list(sign.shape)} / .alpha "
                f"{list(alpha.shape)} do not fit base weight {list(shape)}"
            )
    tied = "lm_head.weight" in base and ties_head(base_dir)
    return _materialized(base, artifact, tied)


_RECONSTRUCT_ELEMENTS = 1 << 20  # weights per block of rows that materialisation reconstructs at a time


def _materialized(base: Checkpoint, artifact: Artifact, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name in base.names():
        if name in artifact.full or (tied and name == "lm_head.weight"):
            continue  # a tied base's stored head is its embedding, which the export compared against
        w = _reconstructed(base, artifact, name) if name in artifact.signs else base.get(name)
        yield name, w
        del w  # (a suspended generator would hold it while the next tensor is read)
    for name, t in artifact.full.items():
        yield name, t.cpu()


def _reconstructed(base: Checkpoint, artifact: Artifact, name: str) -> torch.Tensor:
    """``W_base + α·sign`` of the compressed matrix ``name`` in the base's dtype, reconstructed (in
    float32) one block of rows at a time into the output, so that the float32 intermediates are a
    block's, not the matrix's; the values are those of one :func:`reconstruct` of the whole matrix
    (elementwise arithmetic). A value beyond the base dtype's range is refused (:func:`_cast`) once
    the whole matrix is seen, naming its largest."""
    info = base.info(name)
    sign, alpha = artifact.signs[name].cpu(), artifact.alphas[name].cpu()
    beta = artifact.betas[name].cpu() if name in artifact.betas else None
    out = torch.empty(info.shape, dtype=info.dtype)
    step, worst = row_block(info, _RECONSTRUCT_ELEMENTS), None
    for r0 in range(0, info.shape[0] if out.numel() else 0, step):  # (an empty matrix: nothing to read)
        r1 = min(info.shape[0], r0 + step)
        block = reconstruct(base.get_rows(name, r0, r1), sign[r0:r1], alpha[r0:r1] if alpha.dim() == 1 else alpha,
                            beta)
        cast = block.to(info.dtype)
        over = _beyond(block, cast)
        worst = over if worst is None or (over is not None and over > worst) else worst
        out[r0:r1] = cast
        del block, cast
    _refuse_beyond(worst, info.dtype, f"{artifact.path}: {name} (W_base + α·sign)", "the base's dtype")
    return out


def not_artifact(folder: Path, variant: str | None = None, job: str = "export") -> str | None:
    """Why ``folder`` is not (only) a BitDelta artifact (of ``variant``, if given), or None if it is: it
    must hold its manifest and no file but those the manifest lists (a file of the user's beside an
    artifact is not replaced), and another variant's artifact is not replaced by this one's. Without a
    manifest, the first few things the folder holds are named (``artifacts/`` itself: its variants);
    one that is no regular file or no JSON is named for what it is (:func:`manifest_json`)."""
    try:
        manifest = manifest_json(folder)
    except ArtifactError as e:  # no regular file (a named pipe would block the read for ever), no JSON
        return str(e)
    if manifest is None:
        held = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
        return f"no readable {MANIFEST_NAME}; it holds {', '.join(held[:4])}{', …' if len(held) > 4 else ''}"
    if variant is not None and isinstance(manifest, dict) and manifest.get("variant") != variant:
        return f"it is the artifact of variant {manifest.get('variant')!r}, not of {variant!r}"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return unlisted_files(folder, [MANIFEST_NAME, *(files if isinstance(files, dict) else ())], job)


HF_EXPORT_RECORD = "bitdelta-export.json"  # format=hf's signature: its folder may be replaced by a new export
HF_WRITTEN_BY = "deltafleet export format=hf"


def _not_hf_export(folder: Path, variant: str | None = None) -> str | None:
    """Why ``folder`` is not (only) an earlier :func:`export_hf` output (of ``variant``, where its record
    names one), or None if it is."""
    why = not_recorded_output(folder, HF_EXPORT_RECORD, HF_WRITTEN_BY, "export")
    if why is None and variant is not None:
        was = json.loads((folder / HF_EXPORT_RECORD).read_text()).get("variant")
        if was is not None and was != variant:
            return f"it is the checkpoint of variant {was!r}, not of {variant!r}"
    return why


def export_hf(base_dir: str | Path, artifact_dir: str | Path, out_dir: str | Path, *,
              force: bool = False, overwrite: bool = False,
              max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Materialise base + BitDelta artifact as a full Hugging Face checkpoint any engine can load.

    Writes ``W_base + α·sign(Δ)`` (BitDelta Eq. 2, :func:`materialized_tensors`) in the base dtype (a
    tensor stored in full in the base's dtype for its name, an LM head a tied base lacks in its
    embedding's, another one the base lacks in its own) with the base's ``config.json`` (fitted:
    :func:`_fit_config`), generation config and tokenizer files (:data:`SIDECAR_FILES`) beside it,
    atomically (temp folder + rename). The artifact is loaded with its base fingerprint enforced and
    its file hashes checked.

    The weights are streamed: each tensor is read from the base, reconstructed and cast when its turn
    comes, gathered into shards of at most ``max_shard_bytes`` tensor bytes (a tensor larger than that
    gets a shard of its own), and each shard is written (safetensors ``save_file``) and dropped as
    soon as it is full. One shard is ``model.safetensors``; more are
    ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` (Hugging Face's index:
    ``{"metadata": {"total_size": tensor bytes}, "weight_map": {tensor: file}}``), as transformers
    writes them. So the memory held is the artifact, one shard and the tensor being reconstructed,
    whatever the model's size: never the whole model (but with ``max_shard_bytes=None``).

    Args:
        base_dir: the base Hugging Face checkpoint.
        artifact_dir: ``artifacts/<variant>/``.
        out_dir: the checkpoint folder to create or replace.
        force: load the artifact even if it was exported against another base.
        overwrite: replace ``out_dir`` whatever it holds. Without it, an ``out_dir`` holding anything
            but an earlier export's checkpoint (``bitdelta-export.json`` lists its files) is refused,
            as is one overlapping an input.
        max_shard_bytes: the largest shard, in tensor bytes (the default is :func:`compress`'s);
            ``None``: one ``model.safetensors`` whatever its size, held whole in memory.

    Returns:
        ``out_dir``, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    Raises:
        FingerprintMismatchError: the artifact belongs to another base (and not ``force``).
        ArtifactError: a damaged or inconsistent artifact, or one that does not fit the base
            (:func:`materialized_tensors`, before anything is written), or a weight beyond the range
            of the dtype it is written in (a float16 base: 65504 at most; inf there), naming the
            tensor; the shards written so far are removed with the temporary folder, and ``out_dir``
            is left as it was (as on any other error, or a Ctrl-C).
        ValueError: a ``max_shard_bytes`` that is not a positive integer, or an ``out_dir`` it must not
            replace.
    """
    _check_max_shard_bytes(max_shard_bytes)
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    manifest = manifest_json(artifact_dir)  # the variant, to keep another variant's checkpoint
    variant = manifest.get("variant") if isinstance(manifest, dict) else None  # (load_artifact checks it below)
    check_replaceable(out_dir, [base_dir, artifact_dir], lambda f: _not_hf_export(f, variant), job="export",
                      key="hf_out_dir", overwrite=overwrite)
    artifact = load_artifact(artifact_dir, base_fingerprint=fingerprint(base_dir), force=force)
    tensors = materialized_tensors(base_dir, artifact)  # checks the artifact against the base; reads nothing yet
    base = Checkpoint(base_dir)
    vocab_names = [n for n in base.names() if is_vocab_matrix(n)]

    def written(name: str, t: torch.Tensor) -> torch.Tensor:
        # a tensor stored in full keeps the fine-tune's dtype in the artifact: here it takes the base's
        # dtype for that name (the head a tied base lacks, its embedding's; a tensor the base lacks keeps its own)
        if name in artifact.full:
            ref = name if name in base else vocab_names[0] if is_vocab_matrix(name) and vocab_names else None
            if ref is not None and t.is_floating_point() and base.info(ref).dtype.is_floating_point:
                t = _cast(t, base.info(ref).dtype, f"{artifact.path}: {name} (stored in full)",
                          "the base's dtype for it")
        return t.contiguous()

    with staged_dir(out_dir) as tmp:
        shards = _Shards(tmp, max_shard_bytes)
        shapes: dict[str, tuple[int, ...]] = {}
        for name, t in tensors:
            t = written(name, t)
            shards.add({name: t})
            shapes[name] = tuple(t.shape)
        files = shards.finish(CHECKPOINT_NAME, "model")
        if len(files) > 1:  # Hugging Face's shards and index (total_size: the tensors' bytes, as transformers')
            shards.write_index(tmp / CHECKPOINT_INDEX_NAME, files, shards.tensor_bytes)
        for name in SIDECAR_FILES:
            if (base_dir / name).is_file():
                shutil.copyfile(base_dir / name, tmp / name)
        _fit_config(tmp / "config.json", shapes)
        record = {"written_by": HF_WRITTEN_BY, "artifact": str(Path(artifact_dir).absolute()),
                  "variant": artifact.manifest.get("variant"),
                  "files": sorted([p.name for p in tmp.iterdir()] + [HF_EXPORT_RECORD])}
        (tmp / HF_EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir


def _fit_config(config_path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Fit the copied base ``config.json`` to the exported weights (``shapes``: every tensor's name →
    shape).

    - ``vocab_size``: the embedding's row count. A fine-tune with added tokens stores its resized
      embedding (and untied LM head) in full; the base config still names the base vocabulary,
      which transformers refuses to load against the larger matrices. (The tokenizer files copied
      are the base's: the artifact carries none.)
    - ``tie_word_embeddings``: false when the weights hold an ``lm_head`` of their own (a fine-tune
      that untied the head of a tied base, or a family whose default is tied): an engine that
      honours the flag would read the embedding instead.

    Both also inside a nested ``text_config`` that has them.
    """
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    changed = json.loads(json.dumps(config))
    nested = changed.get("text_config") if isinstance(changed.get("text_config"), dict) else None
    rows = {shape[0] for n, shape in shapes.items() if is_vocab_matrix(n) and len(shape) == 2}
    if len(rows) == 1:
        (vocab,) = rows
        having = [c for c in (changed, nested) if c is not None and "vocab_size" in c]
        for c in having or [changed]:
            c["vocab_size"] = vocab
    if any(n.endswith("lm_head.weight") for n in shapes):  # (transformers' default is tied for some families)
        changed["tie_word_embeddings"] = False
        if nested is not None and "tie_word_embeddings" in nested:
            nested["tie_word_embeddings"] = False
    if changed != config:
        config_path.write_text(json.dumps(changed, indent=2, sort_keys=True) + "\n")
