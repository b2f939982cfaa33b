"""Public, dispatching partial interleaved RoPE: ``apply_rope`` (autograd, in place or out of place).

Same math as :func:`dsv4_primitives.rope.reference.apply_rope_ref` (see its docstring): the last ``cfg.rope_dim``
channels of every head are rotated pairwise by ``pos * theta_i`` (``-pos`` when ``inverse=True``); the leading
``D - r`` channels stay bit-identical. ``cos``/``sin`` come from the cached fp32 tables of
:func:`dsv4_primitives.rope.frequencies.rope_cos_sin` (indexed by ``|pos|``; ``sin`` flips sign for negative
positions), math runs in fp32 and the result is stored in ``x.dtype``.

Autograd: the backward of a rotation is the inverse rotation of the incoming gradient, so nothing of ``x`` is
saved. ``inplace=False`` never writes to ``x`` (safe on tensors another op saved for its backward, e.g. the
attention output O kept by a fused attention backward). ``inplace=True`` writes into ``x`` and marks it dirty:
autograd then refuses a leaf that requires grad and raises at backward if another op saved ``x``, exactly as for
any in-place PyTorch op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.rope.frequencies import RopeConfig, rope_cos_sin
from dsv4_primitives.rope.kernel import rope_rotate_kernel


def _rotate_torch(
    x3: torch.Tensor,
    y3: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nope: int,
    inverse: bool,
) -> None:
    """Eager implementation of the kernel contract: write the rotation of ``x3`` into ``y3`` (may alias)."""
    apos = pos.abs()
    c = cos[apos][:, None, :]  # [N, 1, r/2]
    sign = torch.where(pos < 0, -1.0, 1.0).to(torch.float32)
    if inverse:
        sign = -sign
    s = (sin[apos] * sign[:, None])[:, None, :]
    rope = x3[..., nope:].float()  # [N, H, r]
    a, b = rope[..., 0::2], rope[..., 1::2]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    if y3.data_ptr() != x3.data_ptr() and nope:
        y3[..., :nope].copy_(x3[..., :nope])
    y3[..., nope:].copy_(out)


@dataclass(frozen=True)
class RopeKernelConfig:
    """Launch geometry of :func:`dsv4_primitives.rope.kernel.rope_rotate_kernel`.

    Attributes:
        bytes_per_program: bytes of ``x`` one program reads (whole rows out of place, only the rope slices in
            place); rows (position, head) per program = this / bytes per row, rounded down to a power of two.
        min_programs: while fewer programs than this would be launched, the rows per program are halved (down to
            one row) so small inputs still spread over the SMs.
        num_warps: warps per program.
    """

    bytes_per_program: int = 16384
    min_programs: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.bytes_per_program < 1 or self.min_programs < 1 or self.num_warps < 1:
            raise ValueError(f"RopeKernelConfig fields must be positive, got {self}")


KERNEL_CONFIG = RopeKernelConfig()  # CUDA: 16 KiB per program (8 x 16-byte loads per thread at 4 warps)
INTERPRET_CONFIG = RopeKernelConfig(bytes_per_program=1 << 18, min_programs=1, num_warps=1)  # few, big


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


SHARED_HEADS_MIN = (
    16  # with at least this many heads a program takes [positions, heads] tiles sharing cos/sin
)


def _tile(
    n: int, h: int, row_bytes: int, block_half: int, elt: int, cfg: RopeKernelConfig, cuda: bool
) -> tuple[int, int]:
    """``(BLOCK_P, BLOCK_H)``: a ``[positions, heads]`` tile of at most ``cfg.bytes_per_program`` bytes.

    ``h >= SHARED_HEADS_MIN``: up to all heads of a position in one program (one ``cos``/``sin`` load per
    position); fewer heads (the shared kv head, small test shapes): one head per program, ``BLOCK_P`` positions.
    On CUDA ``BLOCK_P`` is also capped so that Triton 3.6 keeps the ``[BLOCK_P, 1, r/2]`` table tile in the
    rotated tile's register layout (no layout conversion through shared memory, no spills), a rule read off the
    sm_90 compile of the whole (dtype, BLOCK_P, BLOCK_H, warps) matrix: with heads in the tile it must have fewer
    elements than the program has threads; with one head, at most two per thread for 32-bit ``x``.
    """
    rows = _pow2_floor(cfg.bytes_per_program // row_bytes)
    while rows > 1 and _cdiv(n * h, rows) < cfg.min_programs:
        rows //= 2
    block_h = min(_pow2_ceil(h), rows) if h >= SHARED_HEADS_MIN else 1
    block_p = max(1, rows // block_h)
    if cuda:
        threads = 32 * cfg.num_warps
        if block_h > 1:
            block_p = min(block_p, max(1, threads // (2 * block_half)))
        elif elt >= 4:
            block_p = min(block_p, max(1, 2 * threads // block_half))
    return min(block_p, _pow2_ceil(n)), block_h


def launch_params(
    n: int, h: int, d: int, rope: int, elt: int, copy_nope: bool, cuda: bool
) -> tuple[tuple[int, int], dict, int]:
    """``(grid, constexprs, num_warps)`` of the kernel for a ``[n, h, d]`` input of ``elt``-byte elements."""
    nope = d - rope
    cfg = KERNEL_CONFIG if cuda else INTERPRET_CONFIG
    block_rope = _pow2_ceil(rope)
    row_bytes = (d if copy_nope else rope) * elt
    block_p, block_h = _tile(n, h, row_bytes, block_rope // 2, elt, cfg, cuda)
    consts = {
        "NOPE": nope,
        "ROPE": rope,
        "BLOCK_P": block_p,
        "BLOCK_H": block_h,
        "BLOCK_ROPE": block_rope,
        "BLOCK_NOPE": _pow2_ceil(nope) if copy_nope else 1,
        "COPY_NOPE": copy_nope,
    }
    return (_cdiv(n, block_p), _cdiv(h, block_h)), consts, cfg.num_warps


def _launch_triton(
    x3: torch.Tensor,
    y3: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nope: int,
    inverse: bool,
) -> None:
    """Rotate ``x3 [N, H, D]`` into ``y3`` (``y3`` aliasing ``x3``: in place, rope channels only; else one pass)."""
    n, h, d = x3.shape
    rope = 2 * cos.shape[-1]
    assert d == nope + rope and x3.stride(2) == 1 and y3.stride(2) == 1
    copy_nope = nope > 0 and y3.data_ptr() != x3.data_ptr()
    grid, consts, num_warps = launch_params(n, h, d, rope, x3.element_size(), copy_nope, x3.is_cuda)
    rope_rotate_kernel[grid](
        x3,
        y3,
        pos,
        cos,
        sin,
        n,
        h,
        x3.stride(0),
        x3.stride(1),
        y3.stride(0),
        y3.stride(1),
        **consts,
        INVERSE=bool(inverse),
        num_warps=num_warps,
    )


def _rotate(
    x: torch.Tensor,
    n_pos: int,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nope: int,
    inverse: bool,
    inplace: bool,
    backend: str,
) -> torch.Tensor:
    """Rotate ``x`` (``[*P, *H, D]`` with ``prod(P) = n_pos``) into a new tensor, or into ``x`` when ``inplace``."""
    d = x.shape[-1]
    heads = x.numel() // max(n_pos * d, 1) if n_pos else 0
    impl = _launch_triton if backend == "triton" else _rotate_torch
    if x.numel() == 0:
        return x if inplace else x.clone()
    try:
        x3 = x.view(n_pos, heads, d)
        ok = x3.stride(2) == 1
    except RuntimeError:
        ok = False
    if not ok:  # not viewable as [N, H, D] with unit channel stride: go through a contiguous copy
        xc = x.contiguous()
        yc = _rotate(xc, n_pos, pos, cos, sin, nope, inverse, True, backend)
        if inplace:
            x.copy_(yc)
            return x
        return yc
    if inplace:
        impl(x3, x3, pos, cos, sin, nope, inverse)
        return x
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    impl(x3, y.view(n_pos, heads, d), pos, cos, sin, nope, inverse)  # out of place: one fused pass
    return y


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pos, cos, sin, n_pos, nope, inverse, inplace, backend):
        y = _rotate(x, n_pos, pos, cos, sin, nope, inverse, inplace, backend)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(pos, cos, sin)
        ctx.meta = (n_pos, nope, inverse, backend)
        return y

    @staticmethod
    def backward(ctx, gy):
        pos, cos, sin = ctx.saved_tensors
        n_pos, nope, inverse, backend = ctx.meta
        gx = _rotate(gy, n_pos, pos, cos, sin, nope, not inverse, False, backend)
        return gx, None, None, None, None, None, None, None, None


def _check_inputs(x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig) -> None:
    if not isinstance(cfg, RopeConfig):
        raise ValueError(f"cfg must be a RopeConfig, got {type(cfg).__name__}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"apply_rope needs a floating-point x, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < cfg.rope_dim:
        raise ValueError(
            f"x must have a last dim >= rope_dim={cfg.rope_dim} ([nope | rope] layout), got shape {tuple(x.shape)}"
        )
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.is_complex():
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    p = positions.dim()
    if p >= x.dim() or tuple(x.shape[:p]) != tuple(positions.shape):
        raise ValueError(
            f"positions.shape {tuple(positions.shape)} must be a prefix of x.shape[:-1] {tuple(x.shape[:-1])} "
            "(e.g. [S, B] for SBHD x [S, B, H, D], [T] for THD x [T, H, D])"
        )
    if positions.device != x.device:
        raise ValueError(f"positions are on {positions.device} but x is on {x.device}; move them to x.device")


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cfg: RopeConfig,
    inverse: bool = False,
    inplace: bool = False,
    backend: str = "auto",
    max_position: int | None = None,
) -> torch.Tensor:
    """Rotate the last ``cfg.rope_dim`` channels of every head of ``x`` (differentiable).

    Args:
        x: ``[*P, *H, D]`` (bf16/fp16/fp32), ``*P = positions.shape`` (``[S, B]`` SBHD, ``[T]`` THD), ``*H`` any
            head dims (``[H]`` for q, none or ``[1]`` for the shared kv head), ``D >= cfg.rope_dim``.
        positions: integer ``*P`` positions: :func:`positions_sbhd`, :func:`positions_from_cu_seqlens` (THD,
            document-relative) or explicit ``position_ids`` (contiguous CP). Negative values are allowed.
        cfg: rotary configuration (plain base or YaRN, no mscale).
        inverse: rotate by ``-pos`` (attention-output de-rotation at the query position).
        inplace: write into ``x`` and return it (``x`` must not be a leaf requiring grad nor saved by another op).
        backend: ``"auto"`` (Triton for CUDA tensors, eager PyTorch otherwise; the environment variables
            ``DSV4_PRIMITIVES_BACKEND`` / ``DSV4_BACKEND`` override it, see :mod:`dsv4_primitives.dispatch`),
            ``"triton"`` or ``"reference"`` (eager).
        max_position: an upper bound of ``|positions|`` to size the cached table without a device sync (CUDA
            graphs); computed from ``positions`` when ``None``.
    Returns:
        ``x`` rotated, same shape and dtype (``x`` itself when ``inplace``).
    """
    _check_inputs(x, positions, cfg)
    resolved = resolve_backend(backend, x, op="dsv4_primitives.apply_rope")
    backend = "triton" if resolved == "triton" else "torch"
    n_pos = math.prod(positions.shape)
    pos = positions.reshape(-1).to(torch.int64).contiguous()  # [N]
    if max_position is None:
        max_position = int(pos.abs().max()) if n_pos else 0
    elif n_pos == 0 or max_position < 0:
        max_position = max(int(max_position), 0)
    cos, sin = rope_cos_sin(cfg, int(max_position) + 1, x.device)  # [L, r/2] fp32
    nope = x.shape[-1] - cfg.rope_dim
    return _RopeFunction.apply(x, pos, cos, sin, n_pos, nope, bool(inverse), bool(inplace), backend)
