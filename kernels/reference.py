"""Plain-torch reference of the BitDelta kernel contract (docs/kernels.md, "Contract").

BitDelta (Liu et al., arXiv:2402.10193, §3.1, Eq. 1–2) approximates a fine-tuned weight as
``W_ft ≈ W_base + α · sign(Δ)`` with ``Δ = W_ft − W_base``. The sign matrix is stored packed,
eight signs per byte, least significant bit first along the input dimension (artifact format v1,
docs/artifact.md): bit ``j`` of byte ``b`` in row ``r`` is 1 when ``Δ[r, 8b + j] > 0`` (meaning
``+α``) and 0 when ``Δ[r, 8b + j] ≤ 0`` (meaning ``−α``); pad bits past ``K`` are 0.

These functions define the semantics the fused Triton kernels must match. They compute in
float32 and unpack the signs of one matrix at a time, transiently: a per-variant dense copy of
the weight is never kept.
"""
from __future__ import annotations

import torch

_BIT_WEIGHTS = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)  # [8]: 1, 2, 4, ..., 128
_BIT_WEIGHTS_ON: dict = {}  # device -> _BIT_WEIGHTS there (no host-to-device copy per call, e.g. in a CUDA graph)


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS_ON.get(device)
    if w is None:
        w = _BIT_WEIGHTS_ON[device] = _BIT_WEIGHTS.to(device)
    return w


def packed_width(k: int) -> int:
    """Bytes per row of a packed sign matrix for ``k`` input features: ``ceil(k / 8)``."""
    if k < 1:
        raise ValueError(f"in_features must be ≥ 1, got {k}")
    return (k + 7) // 8


def pack_signs(delta: torch.Tensor) -> torch.Tensor:
    """Pack the signs of a delta matrix into bits.

    Args:
        delta: ``[N, K]`` tensor of any floating dtype (the task vector Δ = W_ft − W_base).

    Returns:
        ``[N, ceil(K/8)]`` uint8: bit ``j`` (LSB first) of byte ``b`` is ``Δ[:, 8b+j] > 0``;
        pad bits are 0.

    Raises:
        ValueError: if ``delta`` is not 2-D or not floating point.
    """
    if delta.dim() != 2:
        raise ValueError(f"pack_signs expects a 2-D delta [N, K], got shape {tuple(delta.shape)}")
    if not delta.is_floating_point():
        raise ValueError(f"pack_signs expects a floating delta, got {delta.dtype}")
    n, k = delta.shape
    kp = packed_width(k)
    bits = (delta > 0).to(torch.uint8)
    if kp * 8 != k:
        bits = torch.nn.functional.pad(bits, (0, kp * 8 - k))
    bits = bits.view(n, kp, 8)
    weights = _bit_weights(bits.device)
    return (bits * weights).sum(dim=-1, dtype=torch.uint8)  # ≤ 255: no overflow


def unpack_bits(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Unpack ``[..., N, ceil(K/8)]`` uint8 into ``[..., N, K]`` uint8 bits (0 or 1).

    Raises:
        ValueError: if ``packed`` is not uint8 or its last dimension is not ``ceil(k/8)``.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed signs must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_width(k):
        raise ValueError(
            f"packed signs have {packed.shape[-1]} bytes per row, expected ceil({k}/8) = {packed_width(k)}"
        )
    weights = _bit_weights(packed.device)
    bits = (packed.unsqueeze(-1) & weights) != 0  # [..., N, kp, 8]
    return bits.flatten(-2)[..., :k].to(torch.uint8)


def unpack_signs(packed: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack packed sign bits to a ``[..., N, K]`` tensor of ±1 in ``dtype`` (``2·bit − 1``)."""
    return unpack_bits(packed, k).to(dtype) * 2 - 1


SIGN_TILE_ROWS = 64   # output rows of one sign tile in the tiled layout
SIGN_TILE_BYTES = 16  # packed bytes (128 weights of K) per row of one sign tile


def tiled_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """Shape of one matrix's signs in the tiled layout (:func:`tile_signs`) for ``[N, K]``:
    ``(ceil(N/64), ceil(ceil(K/8)/16), 64, 16)``."""
    kb = packed_width(k)
    return (-(-n // SIGN_TILE_ROWS), -(-kb // SIGN_TILE_BYTES), SIGN_TILE_ROWS, SIGN_TILE_BYTES)


def tile_signs(signs: torch.Tensor) -> torch.Tensor:
    """Packed signs in the tiled layout: ``[..., N, KB]`` → ``[..., ceil(N/64), ceil(KB/16), 64, 16]``,
    so that the 64 rows × 16 bytes (128 weights of K) that a kernel reads per K step are one
    contiguous KiB (tile ``(f, j)`` holds rows ``64f …`` and bytes ``16j …``; padding is zero): one
    copy per K step instead of 64 pieces of 16 bytes a sign row apart. Every kernel reads both
    layouts; the server's variant slots are tiled (docs/kernels.md, "Sign layouts").

    Args:
        signs: uint8 ``[..., N, KB]`` (one matrix ``[N, KB]`` or a slot stack ``[S, N, KB]``).

    Returns:
        A new contiguous uint8 tensor on ``signs``' device.

    Raises:
        ValueError: if ``signs`` is not uint8 or has fewer than two dimensions.
    """
    if signs.dtype != torch.uint8 or signs.dim() < 2:
        raise ValueError(f"signs must be uint8 [..., N, KB], got {signs.dtype} {tuple(signs.shape)}")
    *lead, n, kb = signs.shape
    nt, kt = -(-n // SIGN_TILE_ROWS), -(-kb // SIGN_TILE_BYTES)
    padded = signs.new_zeros(*lead, nt * SIGN_TILE_ROWS, kt * SIGN_TILE_BYTES)
    padded[..., :n, :kb] = signs
    t = padded.reshape(*lead, nt, SIGN_TILE_ROWS, kt, SIGN_TILE_BYTES)
    return t.transpose(-3, -2).contiguous()


def untile_signs(tiled: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of :func:`tile_signs` for ``[N, K]`` matrices: ``[..., NT, KT, 64, 16]`` →
    ``[..., N, ceil(K/8)]`` (a new contiguous tensor).

    Raises:
        ValueError: if the trailing shape is not :func:`tiled_shape` ``(n, k)``.
    """
    want = tiled_shape(n, k)
    if tiled.dim() < 4 or tuple(tiled.shape[-4:]) != want:
        raise ValueError(f"tiled signs must end in {list(want)} for [{n}, {k}], got {tuple(tiled.shape)}")
    *lead, nt, kt, r, b = tiled.shape
    rows = tiled.transpose(-3, -2).reshape(*lead, nt * r, kt * b)
    return rows[..., :n, :packed_width(k)].contiguous()


def check_tensors(**named: torch.Tensor | None) -> None:
    """The arguments of a BitDelta linear (``x`` among them) before any is read: every one a
    ``torch.Tensor`` (only ``bias`` and the column scales ``beta(s)`` may be ``None``), ``x`` floating
    point with a feature dimension, ``weight`` and the signs (``sign`` or ``signs``) on ``x``'s
    device, and no argument on the ``meta`` device unless
    ``x`` is (a meta tensor has no data: a CPU product with one returns uninitialised memory, and a
    meta argument sends a custom op to its fake implementation). ``alpha(s)``, ``bias`` and ``slot``
    may otherwise be elsewhere: the Triton wrappers move them to ``x``'s device. A kernel handed a
    pointer into another device's memory faults and leaves the CUDA context unusable, hence the
    check before any launch.

    Raises:
        ValueError: naming the first argument that is missing or not a tensor (a Python float α,
            say), an integer or bool ``x`` (whose products would be truncated to its dtype), a 0-D
            ``x``, or an argument on the wrong device.
    """
    x = named["x"]
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have a feature dimension ([..., K]), got a 0-D tensor")
    for name, t in named.items():
        if name == "x" or (t is None and name in ("bias", "beta", "betas")):
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name in ("weight", "sign", "signs") and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: x, weight and the signs "
                             f"must be on one device")
        if t.device.type == "meta" and x.device.type != "meta":
            raise ValueError(f"{name} is on the meta device (no data) but x is on {x.device}")


def _check_alpha(alpha: torch.Tensor, n: int, what: str = "alpha") -> None:
    if alpha.dim() == 0 or (alpha.dim() == 1 and alpha.shape[0] == n):
        return
    raise ValueError(f"{what} must have shape [] or [{n}], got {tuple(alpha.shape)}")


def _check_beta(beta: torch.Tensor | None, k: int, lead: tuple[int, ...] = ()) -> None:
    if beta is not None and tuple(beta.shape) != (*lead, k):
        raise ValueError(f"beta{'s' if lead else ''} must have shape {[*lead, k]}, got {tuple(beta.shape)}")


def reconstruct(weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                beta: torch.Tensor | None = None) -> torch.Tensor:
    """``W_base + α · (2·bits − 1)`` (with ``beta``: ``W_base + α_r · β_c · (2·bits − 1)``) as a
    float32 ``[N, K]`` tensor (tests, export to HF format).

    Args:
        weight: ``[N, K]`` base weight, any floating dtype.
        sign: ``[N, ceil(K/8)]`` uint8 packed signs.
        alpha: ``[]`` (one scale per matrix) or ``[N]`` (one per output row), any floating dtype.
        beta: optional ``[K]`` column scales (format version 2, granularity rowcol).
    """
    n, k = weight.shape
    if sign.shape[0] != n:
        raise ValueError(f"sign has {sign.shape[0]} rows, weight has {n}")
    _check_alpha(alpha, n)
    _check_beta(beta, k)
    a = alpha.float().reshape(-1, 1) if alpha.dim() == 1 else alpha.float()
    s = unpack_signs(sign, k, torch.float32)
    return weight.float() + a * (s if beta is None else s * beta.float())


# rows of a tile of bitdelta_linear_segments at most (its Hopper kernel's token tile)
SEGMENT_ROWS = 128
# the slot of a tile that bitdelta_linear_segments writes zeros to (a CUDA graph's padding rows)
ZERO_SLOT = -2


def segment_tiles(runs: list[tuple[int, int, int]], rows: int = SEGMENT_ROWS) -> list[tuple[int, int, int]]:
    """The tiles of :func:`deltafleet.kernels.bitdelta_linear_segments`: ``(first row, stop, slot)`` of at
    most ``rows`` rows each, covering ``runs`` (``(first, stop, slot)``: a stretch of rows of one
    variant, slot −1 the base) in order."""
    return [(a, min(a + rows, stop), slot) for first, stop, slot in runs for a in range(first, stop, rows)]


def max_segment_tiles(m: int, n_runs: int, rows: int = SEGMENT_ROWS) -> int:
    """An upper bound on :func:`segment_tiles`' count for ``n_runs`` runs over ``m`` rows in all: each
    run of ``r`` rows makes ``ceil(r / rows) ≤ r / rows + 1`` tiles."""
    return -(-m // rows) + n_runs


def bitdelta_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    sign: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference ``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` (BitDelta Eq. 2 applied to a linear);
    with column scales ``beta``, ``y = x · Wᵀ + α ⊙ ((x ⊙ β) · (2·bits − 1)ᵀ)``.

    Args:
        x: ``[M, K]`` (or ``[..., K]``) activations, fp32/bf16/fp16.
        weight: ``[N, K]`` base weight.
        sign: ``[N, ceil(K/8)]`` uint8 packed signs of the delta, or the same in the tiled layout
            (:func:`tile_signs`, ``[ceil(N/64), ceil(K/128), 64, 16]``).
        alpha: float32 ``[]`` or ``[N]`` scale(s).
        bias: optional ``[N]``.
        beta: optional ``[K]`` column scales (granularity rowcol).

    Returns:
        ``[M, N]`` (or ``[..., N]``) in ``x.dtype``; computed in float32.

    Raises:
        ValueError: on mismatched shapes (x, weight, sign, alpha or bias), an argument that is not a
            tensor, or an x that is not floating point.
    """
    return linear_with(unpacked_product, x, weight, sign, alpha, bias, beta)


def linear_with(product, x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                bias: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`bitdelta_linear` (its checks, float32 arithmetic, the bias) with the sign product by
    ``product(xs, packed_rows, k)``, as :func:`unpacked_product` (kernels/cpu.py passes its byte tables)."""
    sign = check_linear_args(x, weight, sign, alpha, bias, beta)
    n, k = weight.shape
    xf = x.reshape(-1, k).float()
    xs = xf if beta is None else xf * beta.float()
    y = xf @ weight.float().t() + product(xs, sign, k) * alpha.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                      bias: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> torch.Tensor:
    """The contract of :func:`bitdelta_linear`'s arguments; returns ``sign`` as rows ``[N, ceil(K/8)]``
    (untiled if it came tiled).

    Raises:
        ValueError: as :func:`bitdelta_linear`.
    """
    check_tensors(x=x, weight=weight, sign=sign, alpha=alpha, bias=bias, beta=beta)
    n, k = check_weight_and_bias(weight, bias)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    if sign.dtype != torch.uint8:
        raise ValueError(f"packed signs must be uint8, got {sign.dtype}")
    if sign.dim() == 4:  # the tiled layout (tile_signs)
        sign = untile_signs(sign, n, k)
    if sign.shape != (n, packed_width(k)):
        raise ValueError(f"sign must have shape [{n}, {packed_width(k)}], got {tuple(sign.shape)}")
    _check_alpha(alpha, n)
    _check_beta(beta, k)
    return sign


def check_weight_and_bias(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
    """``(N, K)`` of a ``[N, K]`` weight (K ≥ 1), after checking that ``bias`` (if any) is ``[N]``.

    Raises:
        ValueError: naming the argument whose shape does not fit.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k < 1:
        raise ValueError(f"weight has {k} input features; K must be ≥ 1")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return n, k


def check_stacked(weight: torch.Tensor, sizes, signs, alphas) -> None:
    """The stacking contract of ``bitdelta_linears_grouped``: one N in ``sizes``, one signs and one
    alphas tensor per matrix, the N adding up to the stacked weight's rows.

    Raises:
        ValueError: naming the sizes, the weight's rows and the lists' lengths.
    """
    if not len(sizes) == len(signs) == len(alphas) or sum(sizes) != weight.shape[0]:
        raise ValueError(f"sizes {list(sizes)} must add up to the weight's {weight.shape[0]} rows, one per "
                         f"signs ({len(signs)}) and alphas ({len(alphas)})")


def check_batched_args(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                       slot: torch.Tensor, check_slot_values: bool = True, betas: torch.Tensor | None = None) -> None:
    """The shape contract of ``bitdelta_linear_batched`` (every implementation checks it, after
    :func:`check_tensors` of all its arguments).

    ``check_slot_values=False`` skips the range check of the slot values, which for a slot tensor
    on a GPU would wait for the device (the Triton kernel then treats a slot outside ``[0, S)`` as
    base only instead).

    Raises:
        ValueError: naming the argument whose shape does not fit, signs that are not uint8 (whether
            or not a row reads them), a slot tensor that is not of an integer dtype, or a slot
            outside ``[−1, S)``.
    """
    if signs.dtype != torch.uint8:
        raise ValueError(f"signs must be uint8, got {signs.dtype}")
    n, k = check_weight_and_bias(weight, None)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if signs.dim() not in (3, 5):
        raise ValueError(f"signs must be [S, {n}, {packed_width(k)}] or tiled (5-D), got {tuple(signs.shape)}")
    s = signs.shape[0]
    if signs.dim() == 5:  # the tiled layout (tile_signs)
        if tuple(signs.shape[1:]) != tiled_shape(n, k):
            raise ValueError(f"tiled signs must be [S, {', '.join(map(str, tiled_shape(n, k)))}], "
                             f"got {tuple(signs.shape)}")
    elif signs.shape[1:] != (n, packed_width(k)):
        raise ValueError(f"signs must be [S, {n}, {packed_width(k)}], got {tuple(signs.shape)}")
    if alphas.shape not in ((s,), (s, n)):
        raise ValueError(f"alphas must be [{s}] or [{s}, {n}], got {tuple(alphas.shape)}")
    _check_beta(betas, k, (s,))
    if slot.shape != (x.shape[0],):
        raise ValueError(f"slot must be [{x.shape[0]}], got {tuple(slot.shape)}")
    if slot.dtype.is_floating_point or slot.dtype.is_complex or slot.dtype == torch.bool:
        raise ValueError(f"slot must be an integer tensor, got {slot.dtype}")
    if check_slot_values and slot.numel() and (int(slot.min()) < -1 or int(slot.max()) >= s):
        raise ValueError(f"slot indices must lie in [-1, {s}), got [{int(slot.min())}, {int(slot.max())}]")


def unpacked_product(x: torch.Tensor, packed: torch.Tensor, k: int) -> torch.Tensor:
    """``x · (2·bits − 1)ᵀ`` for float32 rows ``x`` ``[M, K]`` and packed sign rows ``[N, ceil(K/8)]``,
    by unpacking the signs (float32)."""
    return x @ unpack_signs(packed, k, torch.float32).t()


def add_sign_products(x: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor, slot: torch.Tensor,
                      y: torch.Tensor, betas: torch.Tensor | None = None, product=unpacked_product) -> torch.Tensor:
    """Reference of the variants' part of :func:`bitdelta_linear_batched`, in place: ``y[m] += α_s ⊙
    (x[m] · S_sᵀ)`` (``x[m] ⊙ β_s`` with column scales) for every row with ``s = slot[m] ≥ 0``, in
    float32, rounded once into ``y``'s dtype (base rows keep their values exactly). Arguments as
    :func:`bitdelta_linear_batched`'s, ``y`` ``[M, N]``; returns ``y``. Trusts its inputs. Only the
    slots in ``slot`` are read (untiled one by one); ``product(xs, packed_rows, k)`` multiplies a
    slot's rows by its signs (kernels/cpu.py passes its byte tables)."""
    n, k = y.shape[1], x.shape[1]
    xf, acc = x.float(), y.float()  # acc is y itself when y is float32
    for t in slot.unique().tolist():
        if t < 0:
            continue
        rows = (slot == t).nonzero(as_tuple=True)[0]
        xs = xf[rows] if betas is None else xf[rows] * betas[t].float()
        packed = untile_signs(signs[t], n, k) if signs.dim() == 5 else signs[t]
        acc[rows] += product(xs, packed, k) * alphas[t].float()
    if acc is not y:
        y.copy_(acc)
    return y


def bitdelta_linear_batched(
    x: torch.Tensor,
    weight: torch.Tensor,
    signs: torch.Tensor,
    alphas: torch.Tensor,
    slot: torch.Tensor,
    bias: torch.Tensor | None = None,
    betas: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of the mixed-tenant linear: each row of ``x`` uses its own slot's delta.

    ``y[m] = x[m] · Wᵀ + α_s ⊙ (x[m] · S_sᵀ)`` with ``s = slot[m]``; ``slot[m] = −1`` means base
    only. The base product ``x · Wᵀ`` is shared by the whole batch. With column scales ``betas``
    the sign product reads ``x[m] ⊙ β_s``.

    Args:
        x: ``[M, K]`` activations.
        weight: ``[N, K]`` base weight.
        signs: ``[S, N, ceil(K/8)]`` uint8, one packed sign matrix per slot, or the same in the
            tiled layout (:func:`tile_signs`, ``[S, ceil(N/64), ceil(K/128), 64, 16]``).
        alphas: float32 ``[S]`` (matrix granularity) or ``[S, N]`` (row granularity).
        slot: ``[M]`` int32/int64 slot index per row, −1 for base only.
        bias: optional ``[N]``.
        betas: optional float32 ``[S, K]`` column scales (granularity rowcol; 1 for slots without).

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        ValueError: on mismatched shapes (including bias), a non-integer slot tensor or a slot index
            outside ``[−1, S)``.
    """
    return batched_with(add_sign_products, x, weight, signs, alphas, slot, bias, betas)


def batched_with(add, x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                 slot: torch.Tensor, bias: torch.Tensor | None = None, betas: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`bitdelta_linear_batched` (its checks, the base product in float32, the bias) with the
    variants' part added by ``add``, a function of :func:`add_sign_products`' signature and contract."""
    check_tensors(x=x, weight=weight, signs=signs, alphas=alphas, slot=slot, bias=bias, betas=betas)
    check_weight_and_bias(weight, bias)
    check_batched_args(x, weight, signs, alphas, slot, betas=betas)
    xf = x.float()
    y = add(xf, signs, alphas, slot, xf @ weight.float().t(), betas)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
