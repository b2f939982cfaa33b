"""The tolerance rule shared by every kernel test.

A fast path is compared with the fp32 reference; the yardstick is the same reference evaluated in the fast
path's dtype (what plain PyTorch in that dtype gets). The fast path passes when

    max|out - ref_fp32| <= 2 * max|ref_same_dtype - ref_fp32| + atol

This is flash-attention's rule: it adapts to the conditioning of each case instead of a hand-tuned rtol.
"""

import torch

DEFAULT_ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, computed in float64; NaN anywhere counts as infinite error."""
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs()
    if torch.isnan(d).any():
        return float("inf")
    return d.max().item()


def assert_close_to_ref(
    name: str,
    out: torch.Tensor,
    ref_fp32: torch.Tensor,
    ref_same_dtype: torch.Tensor | None = None,
    atol: float | None = None,
    factor: float = 2.0,
) -> None:
    """Assert ``out`` is within ``factor`` x the same-dtype PyTorch error of the fp32 reference, plus ``atol``.

    Args:
        name: label used in the failure message (e.g. ``"dq"``).
        out: the fast path's result (any dtype).
        ref_fp32: the reference evaluated in fp32 (or fp64).
        ref_same_dtype: the reference evaluated in ``out.dtype``; ``None`` means the same dtype is fp32 already
            and only ``atol`` applies.
        atol: absolute slack; defaults to :data:`DEFAULT_ATOL` for ``out.dtype`` scaled by ``max|ref|`` (min 1).
        factor: multiplier on the yardstick error (2 by project rule).
    """
    if atol is None:
        scale = max(1.0, ref_fp32.detach().abs().max().item()) if ref_fp32.numel() else 1.0
        atol = DEFAULT_ATOL.get(out.dtype, 1e-5) * scale
    err = max_abs_err(out, ref_fp32)
    base = 0.0 if ref_same_dtype is None else max_abs_err(ref_same_dtype, ref_fp32)
    bound = factor * base + atol
    if not err <= bound:
        raise AssertionError(
            f"{name}: max|out-ref| = {err:.3e} exceeds {factor}x same-dtype error {base:.3e} + atol {atol:.1e} "
            f"(bound {bound:.3e}); dtype={out.dtype}, shape={tuple(out.shape)}"
        )
