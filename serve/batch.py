"""Rows of different variants in one forward pass: the variant slots, and each row's variant.

A decode step of continuous batching runs every running sequence at once, each with its own
variant (or the base) and its own position. For the linears that is one
``deltafleet.kernels.bitdelta_linear_batched`` call per layer (the base weight read once, each variant's
signs once: ``1 + T/16`` of a dense read for T variants, BitDelta §4); it needs every variant's
signs of a layer stacked in one tensor. :class:`DeltaSlots` holds those stacks: ``n_slots``
variant slots on the serving device (the "GPU slots" of vLLM's multi-LoRA, here sized in
variants), filled from a variant's host copy by :meth:`DeltaSlots.put`, which returns a
:class:`~deltafleet.serve.delta.VariantDelta` whose tensors are views into its slot, so the single-variant
path (prefill) reads the same memory and no variant is held twice on the device.

:class:`BatchDeltas` is what the layers receive in place of one ``VariantDelta``: the slots and
the slot of each row (−1: the base), and for an engine step with prefill chunks the runs of rows of
one variant, which the one-variant kernel multiplies whole.
"""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from deltafleet.kernels import (add_sign_products, bitdelta_linear, bitdelta_linear_batched, bitdelta_linear_grouped,
                                bitdelta_linear_segments, bitdelta_linears_grouped, packed_width, segments_supported,
                                tile_signs, tiled_shape, unpack_signs, untile_signs)
from deltafleet.kernels.reference import segment_tiles
from deltafleet.serve.delta import VariantDelta, hf_name
from deltafleet.serve.transfer import upload


SIGN_LAYOUTS = ("rows", "tiled")
# batches of this many rows or more are multiplied grouped by variant on a GPU (the base product once,
# each variant's sign tiles once per block of its rows); below, the per-row kernels of
# bitdelta_linear_batched, tuned for decode batches of a few rows (docs/kernels.md, "Grouped mixed
# batches")
GROUPED_MIN_ROWS = 9


def with_decode_run(runs: list[tuple[int, int, int]], n_decode: int) -> list[tuple[int, int, int]]:
    """The runs of a step's tiles (``bitdelta_linear_segments``): its ``n_decode`` leading decode rows
    as one run of the base (their variants' sign products are added after, grouped), then the prompt
    chunks' ``runs`` (``(first, stop, slot)``), a base run right after the decode rows joined to theirs."""
    if not n_decode:
        return list(runs)
    if runs and runs[0][0] == n_decode and runs[0][2] < 0:
        return [(0, runs[0][1], -1)] + list(runs[1:])
    return [(0, n_decode, -1)] + list(runs)


def check_sign_layout(sign_layout: str, key: str = "sign_layout") -> None:
    """Raise ValueError, naming ``key``, unless ``sign_layout`` is one of :data:`SIGN_LAYOUTS`."""
    if sign_layout not in SIGN_LAYOUTS:
        raise ValueError(f"{key} must be one of {SIGN_LAYOUTS}, got {sign_layout!r}")


def _sign_shapes(model, sign_layout: str) -> dict[str, tuple[tuple[int, int], tuple[int, ...], bool]]:
    """Per weight matrix of ``model`` with a delta (a tied pair once): ``name -> (rows shape
    [N, ceil(K/8)], the shape one slot holds its signs in, whether that is tiled)``. An embedding's
    signs are gathered by token, so they stay rows (also when a tied lm_head shares them)."""
    check_sign_layout(sign_layout)
    kinds = {mod: getattr(mod, "delta_kind", None) for mod in model.modules()}  # "linear" / "embedding"
    gathered = {f"{mod.name}.weight" for mod, kind in kinds.items() if kind == "embedding"}
    out = {}
    for mod, kind in kinds.items():
        name = f"{mod.name}.weight" if kind is not None else None
        if name is not None and name not in out:
            n, k = mod.weight.shape
            tiled = sign_layout == "tiled" and name not in gathered
            out[name] = ((n, packed_width(k)), tiled_shape(n, k) if tiled else (n, packed_width(k)), tiled)
    return out


def _in_features(model) -> dict[str, int]:
    """K of every weight matrix of ``model`` with a delta (HF name)."""
    return {f"{m.name}.weight": m.weight.shape[1] for m in model.modules() if getattr(m, "delta_kind", None)}


class DeltaSlots:
    """``n_slots`` variant slots, per parameter of ``model``: packed signs ``[S, N, ceil(K/8)]``
    uint8 and scales ``[S, N]`` float32 of every weight matrix (a matrix-granularity α is stored
    repeated over N), and every 1-D parameter (norm weights, biases) ``[S + 1, D]`` with the base's
    value in row ``S`` and in the slots of variants that do not change it.

    With ``sign_layout="tiled"`` the linears' signs are held in ``deltafleet.kernels.tile_signs``' layout,
    ``[S, ceil(N/64), ceil(K/128), 64, 16]`` (each 64-row × 128-weight tile one contiguous KiB), which
    every kernel reads, and the mixed-variant kernels read faster: one contiguous KiB per K step
    instead of 64 pieces a sign row apart (docs/kernels.md, "Sign layouts"); the embedding's stay
    rows (they are gathered by token).

    With ``col_scales`` every weight matrix also gets column scales β ``[S, K]`` float32 (ones for a
    variant without them): the slots then take variants of granularity rowcol (format version 2), and
    every mixed product reads ``x ⊙ β_slot`` (``bitdelta_linear_batched``'s ``betas``). Without, such
    a variant is refused: the products a CUDA graph recorded would not read its β.

    Args:
        model: the resident :class:`~deltafleet.serve.model.Transformer` (its device and dtype are used).
        n_slots: how many variants fit at once.
        sign_layout: ``"tiled"`` (default: ``deltafleet.kernels.tile_signs``' layout, which the kernels read
            fastest) or ``"rows"`` (the artifact's layout).
        col_scales: hold column scales (above).

    Raises: ValueError for ``n_slots < 1`` or an unknown ``sign_layout``; from :meth:`put`,
    RuntimeError when every slot is taken and ValueError for a variant that stores a weight matrix in
    full (a resized vocabulary), which rows cannot share.
    """

    def __init__(self, model, n_slots: int, sign_layout: str = "tiled", col_scales: bool = False):
        if n_slots < 1:
            raise ValueError(f"n_slots must be ≥ 1, got {n_slots}")
        shapes = _sign_shapes(model, sign_layout)
        self.n_slots = n_slots
        self.sign_layout = sign_layout
        dev = model.device
        self.signs: dict[str, Tensor] = {}
        self.alphas: dict[str, Tensor] = {}
        self.betas: dict[str, Tensor] = {}  # empty unless col_scales
        self.tiled = {name for name, (_, _, tiled) in shapes.items() if tiled}  # held tiled
        self.rows_shape = {name: rows for name, (rows, _, _) in shapes.items()}  # [N, ceil(K/8)] as rows
        in_features = _in_features(model)
        # Hopper's int8 kernel for grouped rows (kernels/gluon_grouped.py) reads tiled signs with K a
        # multiple of 128; the small blocks of grouped_block_m / decode_block_m are for it. Else the
        # Triton kernel runs, in 16-row tiles: blocks of 16 (grouping).
        self.small_blocks = sign_layout == "tiled" and all(in_features[n] % 128 == 0 for n in self.tiled)
        for name, ((n, _), held, _) in shapes.items():
            self.signs[name] = torch.zeros(n_slots, *held, dtype=torch.uint8, device=dev)
            self.alphas[name] = torch.zeros(n_slots, n, dtype=torch.float32, device=dev)
            if col_scales:
                self.betas[name] = torch.ones(n_slots, in_features[name], dtype=torch.float32, device=dev)
        self.full: dict[str, Tensor] = {}
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                t = p.detach().unsqueeze(0).repeat(n_slots + 1, 1)
                self.full[hf_name(pname)] = t
        self._free = list(range(n_slots - 1, -1, -1))
        self._lock = threading.Lock()  # variants are loaded from several request threads at once
        self.slot_bytes = self.bytes_per_slot(model, sign_layout, col_scales)

    def grouping(self, m: int, device, block_m: int | None = None, prefill: bool = False) -> tuple[int, int | None]:
        """``(block_m, long_m)`` for ``group_rows`` of an M-row batch over these slots: ``block_m`` as
        given, else ``grouped_block_m`` of M (``prefill``: a step with prompt chunks), and
        ``grouped_long_m`` of M; 16 rows (the Triton kernel's tile) where Hopper's kernel cannot read
        the slots (:attr:`small_blocks`)."""
        from deltafleet.kernels.triton_grouped import BLOCK_M, grouped_block_m, grouped_long_m

        if not self.small_blocks:
            block_m = BLOCK_M
        elif block_m is None:
            block_m = grouped_block_m(m, device, prefill)
        return block_m, grouped_long_m(m, device)

    @staticmethod
    def bytes_per_slot(model, sign_layout: str = "tiled", col_scales: bool = False) -> int:
        """What one slot of :class:`DeltaSlots` over ``model`` takes, without allocating it (tiled
        signs are padded to whole 64 × 16-byte tiles)."""
        k = _in_features(model)
        total = sum(math.prod(held) + 4 * rows[0] + (4 * k[name] if col_scales else 0)
                    for name, (rows, held, _) in _sign_shapes(model, sign_layout).items())
        return total + sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def next_free(self) -> int:
        """The slot :meth:`put` takes next (RuntimeError if none)."""
        if not self._free:
            raise RuntimeError(f"all {self.n_slots} variant slots are taken")
        return self._free[-1]

    def put(self, delta, slot: int | None = None):
        """Copy a variant (a :class:`~deltafleet.serve.delta.VariantDelta`, any device) into a free slot (``slot``,
        or the next free one); return a ``VariantDelta`` of views into the slot, with ``.slot`` set.
        Signs may come as rows (an artifact) or tiled (a host-tier copy of a slot's views), whatever
        the slots' layout; a copy that fails gives the slot back.

        Raises: ValueError for a variant storing a matrix in full, a delta for a weight the model
        lacks, or signs of another shape than the matrix's; RuntimeError when no slot is free (or
        ``slot`` is taken)."""
        bad = [k for k, v in delta.full.items() if v.dim() != 1 or k not in self.full]
        if bad:
            raise ValueError(f"variant {delta.name!r} stores {bad[0]!r} in full (shape "
                             f"{tuple(delta.full[bad[0]].shape)}), which a batch of mixed variants cannot share")
        unknown = [k for k in delta.signs if k not in self.signs]
        if unknown:
            raise ValueError(f"variant {delta.name!r}: delta for {unknown[0]!r}, which is not a weight of the model")
        betas = getattr(delta, "betas", {})
        if betas and not self.betas:
            raise ValueError(f"variant {delta.name!r} has column scales (granularity rowcol), which these slots do "
                             "not hold: restart the server with the variant in its artifacts folder")
        with self._lock:
            if slot is None:
                i = self.next_free()
            elif slot in self._free:
                i = slot
            else:
                raise RuntimeError(f"variant slot {slot} is taken")
            self._free.remove(i)
        try:
            self._copy_in(delta, i)
        except BaseException:
            with self._lock:
                self._free.append(i)
            raise
        view = object.__new__(VariantDelta)
        view.name = delta.name
        view.signs = {k: self.signs[k][i] for k in delta.signs}
        view.alphas = {k: self.alphas[k][i] for k in delta.signs}
        view.betas = {k: self.betas[k][i] for k in getattr(delta, "betas", {})}
        view.full = {k: self.full[k][i] for k in delta.full}
        view.slot = i
        return view

    def _copy_in(self, delta, i: int) -> None:
        for name, s in self.signs.items():
            a = self.alphas[name]
            if name in delta.signs:
                s[i].copy_(self._as_held(delta.name, name, delta.signs[name], s.device))
                a[i].copy_(delta.alphas[name].float().expand(a.shape[1]))
            else:
                s[i].zero_()
                a[i].zero_()  # α = 0: W + 0·s = W
            if self.betas:
                b = self.betas[name]
                beta = getattr(delta, "betas", {}).get(name)
                if beta is not None and tuple(beta.shape) != (b.shape[1],):
                    raise ValueError(f"variant {delta.name!r}: {name}.beta has shape {tuple(beta.shape)}, "
                                     f"expected [{b.shape[1]}]")
                if beta is None:
                    b[i].fill_(1.0)  # β = 1: the signs as row α scales them
                else:
                    b[i].copy_(beta)
        for name, t in self.full.items():
            t[i].copy_(delta.full[name] if name in delta.full else t[self.n_slots])

    def _as_held(self, variant: str, name: str, sign: Tensor, device) -> Tensor:
        """``sign`` (uint8 rows ``[N, ceil(K/8)]`` or ``tile_signs``' 4-D tiles of them) checked
        against parameter ``name`` and converted to the layout these slots hold it in.

        Raises: ValueError naming the variant and the parameter for another dtype or shape."""
        n, kb = self.rows_shape[name]
        tiles = tiled_shape(n, 8 * kb)
        if sign.dtype != torch.uint8:
            raise ValueError(f"variant {variant!r}: signs of {name!r} are {sign.dtype}, not packed uint8")
        if tuple(sign.shape) == (n, kb):  # rows (an artifact)
            return tile_signs(sign.to(device)) if name in self.tiled else sign
        if tuple(sign.shape) == tiles:  # tiled (a host-tier copy of a tiled slot)
            return sign if name in self.tiled else untile_signs(sign.to(device), n, 8 * kb)
        raise ValueError(f"variant {variant!r}: signs of {name!r} have shape {tuple(sign.shape)}; the matrix "
                         f"takes rows {(n, kb)} or tiles {tiles}")

    def free(self, view) -> None:
        """Give a slot back (its contents are overwritten by the next :meth:`put`)."""
        i = getattr(view, "slot", None)
        with self._lock:
            if i is None or not 0 <= i < self.n_slots or i in self._free:
                raise ValueError(f"not a taken slot of these slots: {i}")
            self._free.append(i)


class BatchDeltas:
    """The variant of each row of a batch: ``slots`` int32 ``[B]``, −1 for the base (the layers'
    ``delta`` argument when rows differ; see serve/model.py).

    On a GPU, decode batches of :data:`GROUPED_MIN_ROWS` rows or more are multiplied grouped by
    variant (``deltafleet.kernels.bitdelta_linear_grouped``: the base product of every row once, then
    each variant's signs over its own rows); the grouping depends on the slots only, so it is
    computed on the device once per batch, at the first layer, and reused by every other."""

    def __init__(self, table: DeltaSlots, slots: Tensor, runs: list[tuple[int, int, int]] | None = None,
                 block_m: int | None = None, segments: tuple[Tensor, Tensor] | None = None):
        self.table = table
        self.slots = slots.to(torch.int32)
        self._rows = torch.where(self.slots < 0, table.n_slots, self.slots).long()  # row S: the base
        self.runs = runs
        # every row by one kernel over its tiles (_linear_segments): (tiles int32 [T, 3] on the device, the
        # slots of the D leading rows, the decode rows, whose variants' sign products are added after)
        self.segments = segments
        self._tiles = None  # with runs: their tile table on the device, made at the first linear that takes it
        # grouped rows' block size (None: grouped_block_m of the row count; 16 without small blocks)
        self.block_m = block_m
        self._groups = None

    @staticmethod
    def grouped(x2: Tensor, sign_products: bool = False) -> bool:
        """Whether rows ``x2`` are multiplied grouped by variant (see :data:`GROUPED_MIN_ROWS`); with
        ``sign_products`` (the decode rows of a step by tiles, whose sign products alone are added
        after, by the grouped kernels only) at any row count."""
        return ((sign_products or x2.shape[0] >= GROUPED_MIN_ROWS) and x2.is_cuda
                and x2.dtype in (torch.bfloat16, torch.float16))

    def use_groups(self, groups) -> None:
        """Multiply grouped by ``groups``: ``triton_grouped.group_rows`` of these slots (with
        :attr:`segments`, of the leading rows' slots), computed by the caller (a piecewise graph's
        first segment, for all the others)."""
        slots = self.slots if self.segments is None else self.segments[1]
        self._groups = ((slots.data_ptr(), slots.shape[0]), groups)

    def _groups_of(self, slots: Tensor):
        """``group_rows`` of ``slots``, made at the first layer and reused by the others."""
        key = (slots.data_ptr(), slots.shape[0])
        if self._groups is None or self._groups[0] != key:
            from deltafleet.kernels.triton_grouped import group_rows

            bm, long_m = self.table.grouping(slots.shape[0], slots.device, self.block_m)
            self._groups = (key, group_rows(slots, self.table.n_slots, bm, long_m))
        return self._groups[1]

    def _batched(self, x2: Tensor, weight: Tensor, name: str, slots: Tensor) -> Tensor:
        """Rows ``x2 [M, K]`` by ``weight`` plus each row's variant (slots ``[M]``), grouped where it runs."""
        signs, alphas, betas = self.table.signs[name], self.table.alphas[name], self.table.betas.get(name)
        if self.grouped(x2) or (betas is not None and x2.is_cuda):  # column scales: the grouped path at any M
            return bitdelta_linear_grouped(x2, weight, signs, alphas, slots, groups=self._groups_of(slots), betas=betas)
        return bitdelta_linear_batched(x2, weight, signs, alphas, slots, betas=betas)

    def linears(self, mods, x: Tensor, fused: tuple[Tensor, Tensor | None, list[int]]) -> list[Tensor] | None:
        """``[mod(x) for mod in mods]`` for linears that read the same ``x [B, 1, K]`` and whose base
        weights are stacked in ``fused`` (serve/model.py's ``fuse_rows``: q, k, v; gate, up), as
        :meth:`linear` gives them, by one base GEMM and shared activation planes
        (``bitdelta_linears_grouped``); with :attr:`segments`, by tiles each, the decode rows' sign
        products sharing their planes. None where that path does not run (a step with ``runs``,
        rows too few to group, column scales): call :meth:`linear` per module then."""
        weight, _, sizes = fused
        names = [f"{m.name}.weight" for m in mods]
        x2 = x.reshape(-1, x.shape[-1])
        if self.segments is not None:  # a flat step (T = 1)
            planes: dict = {}  # the decode rows' activation planes, made by the first matrix's sign products
            return [self._linear_segments(m, x, self.segments, planes) for m in mods]
        if (self.runs or x.shape[1] != 1 or not self.grouped(x2)
                or any(n in self.table.betas for n in names)):
            return None
        y = bitdelta_linears_grouped(x2, weight, sizes, [self.table.signs[n] for n in names],
                                     [self.table.alphas[n] for n in names], self.slots,
                                     groups=self._groups_of(self.slots))
        out = []
        for m, yi in zip(mods, y.split(sizes, 1)):
            bias = self.table.full.get(f"{m.name}.bias")
            out.append((yi if bias is None else yi + bias[self._rows])[:, None])
        return out

    def select(self, rows: Tensor) -> BatchDeltas:
        """The variants of rows ``rows`` of this batch (no runs: the rows are few, read them batched)."""
        return BatchDeltas(self.table, self.slots[rows])

    def linear(self, mod, x: Tensor) -> Tensor:
        """``mod`` (a DeltaLinear) on ``x [B, T, K]``, row b with its own variant (T = 1 at decode).

        With ``runs`` (a flat engine step, T = 1: ``(first, stop, slot)`` for every stretch of rows of
        one variant after the first ``runs[0][0]`` rows, the prefill chunks) the leading rows are
        multiplied batched and each run by the one-variant kernel, which reads the base weight and the
        variant's signs once for the whole run whatever its length (a long prompt is compute bound)."""
        if self.segments is not None:
            return self._linear_segments(mod, x, self.segments)
        if self.runs:
            return self._linear_runs(mod, x)
        b, t, k = x.shape
        name = f"{mod.name}.weight"
        x2 = x.reshape(b * t, k)
        slots = self.slots.repeat_interleave(t) if t > 1 else self.slots
        y = self._batched(x2, mod.weight, name, slots)
        bias = self.table.full.get(f"{mod.name}.bias")
        if bias is not None:
            rows = self._rows.repeat_interleave(t) if t > 1 else self._rows
            y = y + bias[rows]
        return y.view(b, t, -1)

    def _linear_segments(self, mod, x: Tensor, segments: tuple[Tensor, Tensor], planes: dict | None = None) -> Tensor:
        """A flat step (T = 1) whose rows are the tiles ``segments[0]``, by ``bitdelta_linear_segments``
        (one kernel, W read about once): the decode rows in tiles of the base, each prompt chunk in its
        variant's, the padding in zero tiles. Then the sign products of the D leading rows' variants
        (their slots ``segments[1]``: the decode rows, −1 past them) are added, grouped by variant.
        No row is multiplied by W twice, and W is read once: a decode batch of its own would read W
        again, and its GEMM would run over all D rows, however few the step's decode rows. ``planes``:
        kept by a caller that multiplies several matrices over the same ``x`` (:meth:`linears`)."""
        name = f"{mod.name}.weight"
        tiles, lead = segments
        x2 = x[:, 0]
        signs, alphas = self.table.signs[name], self.table.alphas[name]
        y = x2.new_empty(x2.shape[0], mod.weight.shape[0])
        bitdelta_linear_segments(x2, mod.weight, signs, alphas, tiles, y)
        d = lead.shape[0]
        if d:
            add_sign_products(x2[:d], signs, alphas, lead, y[:d],
                              self._groups_of(lead) if self.grouped(x2[:d], sign_products=True) else None, planes)
        bias = self.table.full.get(f"{mod.name}.bias")
        return (y if bias is None else y + bias[self._rows])[:, None]

    def _linear_runs(self, mod, x: Tensor) -> Tensor:
        name, bname = f"{mod.name}.weight", f"{mod.name}.bias"
        x2 = x[:, 0]
        signs, alphas, bias = self.table.signs[name], self.table.alphas[name], self.table.full.get(bname)
        lead = self.runs[0][0]
        if name not in self.table.betas and segments_supported(x2, mod.weight, signs):  # the runs as one kernel
            if self._tiles is None:  # one table a step, whichever matrices the kernel takes
                self._tiles = upload(segment_tiles(with_decode_run(self.runs, lead)), torch.int32, x.device)
            return self._linear_segments(mod, x, (self._tiles, self.slots[:lead]))
        parts = []
        if lead:
            y = self._batched(x2[:lead], mod.weight, name, self.slots[:lead])
            parts.append(y if bias is None else y + bias[self._rows[:lead]])
        for first, stop, slot in self.runs:
            row_bias = None if bias is None else bias[slot if slot >= 0 else self.table.n_slots]
            if slot < 0:
                parts.append(F.linear(x2[first:stop], mod.weight, row_bias))
            else:
                betas = self.table.betas.get(name)
                parts.append(bitdelta_linear(x2[first:stop], mod.weight, signs[slot], alphas[slot], row_bias,
                                             None if betas is None else betas[slot]))
        return torch.cat(parts)[:, None]

    def embedding(self, mod, tokens: Tensor) -> Tensor:
        """Token embedding of ``tokens [B, T]``: ``E[tok] + α_v[tok]·(2·bits_v[tok] − 1)`` per row."""
        name = f"{mod.name}.weight"
        x = F.embedding(tokens, mod.weight)
        signs, alphas = self.table.signs[name], self.table.alphas[name]
        slot = self.slots.clamp(min=0).long()[:, None].expand_as(tokens)
        sign_rows = signs[slot, tokens]                                   # [B, T, KB]
        scale = alphas[slot, tokens] * (self.slots >= 0).float()[:, None]  # [B, T]; base rows: 0
        pm1 = unpack_signs(sign_rows, mod.weight.shape[1], torch.float32)
        betas = self.table.betas.get(name)
        if betas is not None:  # column scales: one per embedding feature
            pm1 = pm1 * betas[slot]
        return (x.float() + scale.unsqueeze(-1) * pm1).to(x.dtype)

    def norm_weight(self, mod) -> Tensor:
        """``[B, 1, D]``: each row's norm weight (the variant's if it stores one, else the base's)."""
        return self.table.full[f"{mod.name}.weight"][self._rows].unsqueeze(1)
