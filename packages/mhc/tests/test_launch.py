"""Launch configurations and kernel sets (``mhc/ops/launch.py``): split-K forward with several K splits, the
stream-aligned backward, the legacy (0.1.0) launches, against the reference (outputs and every gradient).

CPU (interpreter): fp32 streams, truth = float64 reference, yardstick = fp32 reference; the split-K range per
program is forced small with ``MHC_INTERP_MIN_SPLIT_K`` so SPLIT > 1 with a ragged last range. GPU (``gpu``):
the flash-smoke shapes with fp32 streams (the model's default) and bf16 streams, tuned vs reference and vs legacy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_cases import _compare, _params, _run, _triplet

from mhc import hyper_head, hyper_head_ref, mhc_coefficients, mhc_coefficients_ref, mhc_pre, mhc_pre_ref
from mhc.ops.launch import coeff_splitk_cfg, env_cfg, kernel_set, split_k

# (T, N, D): T = 1, T not a multiple of the 16-token block, K = N·D not a multiple of BK = 32 or of the K range
SPLIT_CASES = [(1, 4, 24), (37, 4, 20), (17, 3, 36)]


@pytest.mark.parametrize("min_k", [32, 64])
@pytest.mark.parametrize(("t", "n", "d"), SPLIT_CASES)
def test_pre_split_k(t, n, d, min_k, monkeypatch):
    monkeypatch.setenv("MHC_INTERP_MIN_SPLIT_K", str(min_k))
    k = n * d
    _, bk, split, _, _ = coeff_splitk_cfg(t, k, torch.device("cpu"))
    assert split_k(k, bk, split)[1] > 1  # the case really runs several K ranges
    kern, truth, yard = _triplet(t, n, d, torch.float32, "cpu", seed=3)
    kw = dict(sinkhorn_iters=4)
    out, grads = _run(lambda *a: mhc_pre(*a, backend="triton", **kw), kern)
    ref, ref_g = _run(lambda *a: mhc_pre_ref(*a, **kw), truth)
    low, low_g = _run(lambda *a: mhc_pre_ref(*a, upcast=False, **kw), yard)
    _compare(["x_in", "post", "comb"], out, ref, low)
    _compare(["dx", "dfn", "dscale", "dbase"], grads, ref_g, low_g)


@pytest.mark.parametrize(("t", "n", "d"), SPLIT_CASES[:2])
def test_head_and_coefficients_split_k(t, n, d, monkeypatch):
    monkeypatch.setenv("MHC_INTERP_MIN_SPLIT_K", "32")
    kern, truth, yard = _triplet(t, n, d, torch.float32, "cpu", head=True, seed=5)
    out, grads = _run(lambda *a: hyper_head(*a, backend="triton"), kern)
    ref, ref_g = _run(lambda *a: hyper_head_ref(*a), truth)
    low, low_g = _run(lambda *a: hyper_head_ref(*a, upcast=False), yard)
    _compare(["h"], out, ref, low)
    _compare(["dx", "dfn", "dscale", "dbase"], grads, ref_g, low_g)
    kern, truth, yard = _triplet(t, n, d, torch.float32, "cpu", seed=7)
    kw = dict(sinkhorn_iters=3)
    out, grads = _run(lambda *a: mhc_coefficients(*a, backend="triton", **kw), kern)
    ref, ref_g = _run(lambda *a: mhc_coefficients_ref(*a, **kw), truth)
    low, low_g = _run(lambda *a: mhc_coefficients_ref(*a, upcast=False, **kw), yard)
    _compare(["pre", "post", "comb"], out, ref, low)
    _compare(["dx", "dfn", "dscale", "dbase"], grads, ref_g, low_g)


def test_legacy_matches_tuned(monkeypatch):
    t, n, d = 19, 4, 24
    kern, truth, yard = _triplet(t, n, d, torch.float32, "cpu", seed=9)
    kw = dict(sinkhorn_iters=5)
    monkeypatch.setenv("MHC_KERNELS", "legacy")
    old, old_g = _run(lambda *a: mhc_pre(*a, backend="triton", **kw), kern)
    ref, ref_g = _run(lambda *a: mhc_pre_ref(*a, **kw), truth)
    low, low_g = _run(lambda *a: mhc_pre_ref(*a, upcast=False, **kw), yard)
    _compare(["x_in", "post", "comb"], old, ref, low)
    _compare(["dx", "dfn", "dscale", "dbase"], old_g, ref_g, low_g)
    monkeypatch.setenv("MHC_KERNELS", "tuned")
    new, new_g = _run(lambda *a: mhc_pre(*a, backend="triton", **kw), kern)
    for a, b in zip(list(new) + new_g, list(old) + old_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_split_k_ranges():
    for k in (1, 31, 32, 33, 96, 16384):
        for bk in (16, 32, 64):
            for want in (1, 2, 3, 7, 16, 10_000):
                per, n_split = split_k(k, bk, want)
                assert per % bk == 0 and 1 <= n_split <= want
                assert (n_split - 1) * per < k <= n_split * per  # no empty range, K covered


def test_bad_env(monkeypatch):
    monkeypatch.setenv("MHC_KERNELS", "fastest")
    with pytest.raises(ValueError, match="MHC_KERNELS"):
        kernel_set()
    monkeypatch.setenv("MHC_COEFF_SPLITK_CFG", "64,64")
    with pytest.raises(ValueError, match="MHC_COEFF_SPLITK_CFG"):
        env_cfg("COEFF_SPLITK", (64, 64, 0, 4, 3))
    monkeypatch.setenv("MHC_COEFF_SPLITK_CFG", "64,a,0,4,3")
    with pytest.raises(ValueError, match="MHC_COEFF_SPLITK_CFG"):
        env_cfg("COEFF_SPLITK", (64, 64, 0, 4, 3))


def _gpu_inputs(t, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g, dtype=torch.float64)
    fn, scale, base = _params(n, d, seed + 1)
    dev = "cuda"
    kern = [x.to(dtype).to(dev), fn.float().to(dev), scale.float().to(dev), base.float().to(dev)]
    if dtype == torch.float32:
        truth = [v.double() for v in kern]
        yard = kern
    else:
        truth = [kern[0].float(), kern[1], kern[2], kern[3]]
        yard = [kern[0], fn.to(dtype).to(dev), scale.to(dtype).to(dev), base.to(dtype).to(dev)]
    return kern, truth, yard


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "n", "d"), [(4096, 4, 4096), (1, 4, 4096), (4111, 4, 1000)])
def test_gpu_pre_tuned_and_legacy(t, n, d, dtype, monkeypatch):
    kern, truth, yard = _gpu_inputs(t, n, d, dtype)
    kw = dict(sinkhorn_iters=20)
    ref, ref_g = _run(lambda *a: mhc_pre_ref(*a, **kw), truth)
    low, low_g = _run(lambda *a: mhc_pre_ref(*a, upcast=False, **kw), yard)
    for kernels in ("tuned", "legacy"):
        monkeypatch.setenv("MHC_KERNELS", kernels)
        out, grads = _run(lambda *a: mhc_pre(*a, backend="triton", **kw), kern)
        _compare([f"{kernels} x_in", "post", "comb"], out, ref, low)
        _compare([f"{kernels} dx", "dfn", "dscale", "dbase"], grads, ref_g, low_g)
