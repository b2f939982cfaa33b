"""Launch configurations of the mHC kernels (block sizes, splits, warps), in one place.

Two kernel sets, chosen per call by the environment variable ``MHC_KERNELS``:

``tuned`` (default)  split-K coefficient forward (partials + finishing kernel); coefficient backward chosen per
                     mode (``autograd.streams_bwd_wins``): a separate high-occupancy ``dpre`` pass + stream-aligned
                     ``dX``/``dfn`` column chunks for the layer op up to T = 4096, the 0.1.0 fused pass for
                     coefficient-only calls, the HyperHead and longer sequences; D-split ``post`` backward. Grids
                     sized from the device's SM count.
``legacy``           the 0.1.0 launches (one fused coefficient kernel per 64-token block, etc.), kept selectable
                     for side-by-side benchmarks (``benchmarks/bench_mhc_kernels.py``).

Per-kernel overrides for tuning runs (comma-separated integers, GPU only): ``MHC_COEFF_FWD_CFG`` (legacy fused
kernel: ``BT,BK,BD,warps,stages``), ``MHC_COEFF_SPLITK_CFG`` (``BT,BK,SPLIT,warps,stages``; ``SPLIT=0`` = auto),
``MHC_COEFF_BWD_CFG`` (``BT,BK,warps,stages`` of the dX/dfn kernel), ``MHC_POST_BWD_CFG`` (``BT,BD,DSPLIT,warps``;
``DSPLIT=0`` = auto). Under the Triton interpreter fixed small configs are used (``interp_*`` below) and
``MHC_INTERP_MIN_SPLIT_K`` (a K width, default 64) sets the K range per program of the split-K kernel, so CPU
tests exercise ``SPLIT > 1``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

ENV_KERNELS = "MHC_KERNELS"
KERNEL_SETS = ("tuned", "legacy")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def kernel_set() -> str:
    """``tuned`` (default) or ``legacy`` (``MHC_KERNELS``)."""
    raw = os.environ.get(ENV_KERNELS, "tuned").strip().lower() or "tuned"
    if raw not in KERNEL_SETS:
        raise ValueError(f"{ENV_KERNELS}={raw!r} is not a kernel set; use one of {', '.join(KERNEL_SETS)}")
    return raw


def env_cfg(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """GPU launch config, overridable for tuning runs: ``MHC_<NAME>_CFG="a,b,c,..."``."""
    raw = os.environ.get(f"MHC_{name}_CFG")
    if not raw:
        return default
    try:
        vals = tuple(int(v) for v in raw.split(","))
    except ValueError:
        vals = ()
    if len(vals) != len(default):
        raise ValueError(f"MHC_{name}_CFG={raw!r}: expected {len(default)} comma-separated integers")
    return vals


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200; 8 stands in on CPU)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_k(k: int, bk: int, split: int) -> tuple[int, int]:
    """``(k_per_split, n_split)``: K range per program (a multiple of ``bk``) and the programs along K.

    ``split`` is the wish; the result never has an empty K range (``n_split <= cdiv(k, bk)``)."""
    chunks = triton.cdiv(k, bk)
    split = max(1, min(int(split), chunks))
    per = triton.cdiv(chunks, split)
    return per * bk, triton.cdiv(chunks, per)


def coeff_splitk_cfg(t: int, k: int, device: torch.device, esize: int = 2) -> tuple[int, int, int, int, int]:
    """``(BT, BK, SPLIT, warps, stages)`` of the split-K partial kernel.

    GPU: 64-token blocks (one wgmma M tile at 4 warps; the fn tile ``[BK, 32]`` fp32 is re-read once per block:
    0.75x the bf16 stream bytes / 0.375x fp32, served from L2), 8 KB of streams per K-chunk (``BK = 64`` bf16,
    32 fp32), and SPLIT so that the grid has about 8 programs per SM (several resident per SM hide the load
    latency; a tail wave costs little), but every program keeps at least 8 K-chunks for the software pipeline.
    T = 4096, K = 16384, bf16, 132 SMs: 64 x 16 programs of 1024 columns each (fp32: 64 x 17 of 992).
    """
    if interpreting():
        bk = 32 if k > 32 else pow2(k)
        per = max(bk, int(os.environ.get("MHC_INTERP_MIN_SPLIT_K", "64")))
        return 16, bk, triton.cdiv(k, per), 1, 1
    # sm_90 compile: bf16 [64, 64] x 3 stages = 72 registers, 45 KB smem (5 programs/SM); fp32 [64, 64] needs 172
    # registers (tf32x3 splits in registers: 2 programs/SM), fp32 [64, 32] x 4 stages 96 registers, 45 KB (5/SM)
    default = (64, 32, 0, 4, 4) if esize >= 4 else (64, 64, 0, 4, 3)
    bt, bk, split, warps, stages = env_cfg("COEFF_SPLITK", default)
    if split <= 0:
        blocks = triton.cdiv(t, bt)
        split = triton.cdiv(8 * num_sms(device), blocks)
        split = max(1, min(split, triton.cdiv(k, bk) // 8))
    return bt, bk, split, warps, stages


def coeff_finish_cfg(d: int, apply: bool) -> tuple[int, int]:
    """``(BT, BD)`` of the finishing kernel; with ``APPLY`` its grid also tiles D for the collapse."""
    if interpreting():
        return 16, min(pow2(d), 512)
    # [8, 4, 128] stream tiles (the post kernels' measured 91-95% of HBM shape); 32 rows when only Sinkhorn
    return (8, 128) if apply else (32, 128)


def coeff_bwd_streams_cfg(
    t: int, n: int, d: int, device: torch.device
) -> tuple[int, int, int, int, int, int]:
    """``(BT, BK, warps, stages, rows_per_split, n_split)`` of the stream-aligned dX/dfn kernel.

    GPU: ``[64, 64]`` tiles at 4 warps, 3 stages (both dots on warpgroup MMAs, no spills, ~250 registers: 2
    programs per SM, each with two tiles in flight through cp.async); token ranges so that the grid has about 8
    programs per SM and every program keeps at least 4 token blocks.
    """
    if interpreting():
        bt, bk, warps, stages = 16, min(pow2(d), 32), 1, 1
        rows = bt
    else:
        bt, bk, warps, stages = env_cfg("COEFF_BWD_STREAMS", (64, 64, 4, 3))
        cols = n * triton.cdiv(d, bk)
        split = max(1, min(triton.cdiv(t, 4 * bt), triton.cdiv(8 * num_sms(device), cols)))
        rows = triton.cdiv(triton.cdiv(t, split), bt) * bt
    return bt, bk, warps, stages, rows, triton.cdiv(t, rows)


def post_bwd_cfg(t: int, d: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BT, BD, DSPLIT, warps)`` of the post backward (``DSPLIT`` D ranges per token block, partial
    ``dpost``/``dcomb`` summed on the host).

    Both kernel sets use the 0.1.0 shape ``[8 tokens, 4 streams, 128]`` with whole rows per program (measured 91%
    of HBM at T = 16384 with bf16 streams); ``MHC_POST_BWD_CFG="BT,BD,DSPLIT,warps"`` (``DSPLIT=0``: enough D
    ranges for ~8 programs per SM) tries the alternatives (``bench_mhc_kernels.py --sweep``).
    """
    if interpreting():  # two D ranges whenever D > 16: CPU tests exercise the partial sums
        return 16, min(pow2(d), 16), 2, 4
    if kernel_set() == "legacy":
        return 8, 128, 1, 4
    bt, bd, dsplit, warps = env_cfg("POST_BWD", (8, 128, 1, 4))
    if dsplit <= 0:
        dsplit = max(1, min(triton.cdiv(8 * num_sms(device), triton.cdiv(t, bt)), triton.cdiv(d, bd)))
    return bt, bd, dsplit, warps
