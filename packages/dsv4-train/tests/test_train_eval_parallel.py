"""Evaluation under DP2, PP2, PP2 x VPP2 and CP2 (gloo, 2 processes, one world for every case) against the
single-process evaluation of the same data and weights: mock data (``--data mock:...``, the evaluation's separate mock
stream), ``[B, S]`` micro-batches of 1, the initial weights evaluated, 2 training steps, then the evaluation after the
last step. With PP the evaluation runs megatron's pipelined forward-only schedule (mHC streams between the stages),
with VPP the interleaved one (2 chunks per rank, the folded streams, the wrap-around from rank 1's first chunk to
rank 0's second); the per-token loss sums are all-reduced over the last stage's DP replicas. Under CP each rank
evaluates its 32 contiguous rows of every 64-token sequence (one THD pack of one document, as in training; the MTP
mask rolled across the rank edge) and the per-token sums are all-reduced over the CP ranks; ``cp2-packed`` (fp32)
evaluates packed THD batches (each CP rank its 32 rows of every 64-row pack, documents crossing the rank edge)
against the single-process packed evaluation.

fp32: the evaluation losses agree to 2e-5 (fp32 sums in another order after two optimizer steps, as in the parallel
matrix; the evaluation itself adds the fp64 sums of the per-micro-batch losses in another order; under CP the
attention's gathers and halo rows sum in another order too).
bf16: the evaluation of the initial weights changes no forward arithmetic under DP, PP or VPP (the streams cross
the stages in fp32), so it agrees to fp64 summation order (1e-12). After two steps the weights differ by the layouts'
fp32 gradient summation order, which flips the bf16 rounding of a few weights; the bound is the parallel matrix's
``2·δ`` with ``δ`` the largest deviation of the single-process bf16 evaluation from fp32 (measured here): a parallel
bf16 run rounds the same quantities, so its deviation from fp32 is of the same size. CP changes the forward
arithmetic itself (each rank's rows, the gathered compressed entries: the same bf16 roundings in another order), so
under CP both evaluations are held to ``2·δ``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from eval_runs import evaluate_layouts
from warm_workers import run_warm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_BASE = dict(
    data=["mock:docs=64,min=16,max=64,mean=40"],
    seq_len=64,
    global_batch_size=4,
    micro_batch_size=1,
    warmup_steps=1,
    steps=2,
    eval_interval=2,
    eval_iters=2,
)
LAYOUTS = {
    "dp2": dict(),
    "pp2": dict(pp=2),
    "pp2xvpp2": dict(pp=2, vpp=2),
    "cp2": dict(cp=2),
    "cp2-packed": dict(cp=2, packed=True),
}
# layouts whose forward arithmetic differs from the single process (module docstring)
_FORWARD_CHANGES = {"cp2"}
DTYPES = ("fp32", "bf16")
# (layout, dtype) cells; packed CP in fp32 only (bf16 CP is the [B, S] cell: the same CP arithmetic)
CELLS = [(name, dt) for name in LAYOUTS for dt in DTYPES if not (name == "cp2-packed" and dt == "bf16")]
SINGLE = (*DTYPES, "fp32-packed")  # the single-process runs


def _config(key: str, **kw) -> dict:
    """TrainConfig kwargs of single-process run ``key`` (``dtype`` or ``dtype-packed``) plus ``kw``."""
    base = dict(_BASE, bf16=key.startswith("bf16"))
    if key.endswith("-packed"):
        del base["micro_batch_size"]  # a THD micro-batch is one pack
        base["packed"] = True
    return base | kw


def _ref_key(layout: str, dtype: str) -> str:
    return f"{dtype}-packed" if LAYOUTS[layout].get("packed") else dtype


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_single")
    runs = [(key, _config(key, out=str(out / key))) for key in SINGLE]
    (single,) = run_warm(evaluate_layouts, 1, runs, True, timeout=900)
    out2 = tmp_path_factory.mktemp("eval_world2")
    runs = [
        (
            f"{name}-{dt}",
            _config(
                _ref_key(name, dt),
                out=str(out2 / f"{name}-{dt}"),
                init_from=str(out / _ref_key(name, dt) / "checkpoints" / "iter_0000000"),
            )
            | LAYOUTS[name],
        )
        for name, dt in CELLS
    ]
    per_rank = run_warm(evaluate_layouts, 2, runs, timeout=1500)
    return single, per_rank


@pytest.mark.parametrize(("layout", "dtype"), CELLS, ids=[f"{n}-{d}" for n, d in CELLS])
def test_parallel_evaluation_matches_single_process(results, layout, dtype):
    single, per_rank = results
    ref = single[_ref_key(layout, dtype)]
    got = [r[f"{layout}-{dtype}"] for r in per_rank]
    assert got[0] == got[1], "every rank reports the reduced evaluation"
    got = got[0]
    assert [g["step"] for g in got] == [r["step"] for r in ref] == [0, 2]
    assert [g["eval_tokens"] for g in got] == [r["eval_tokens"] for r in ref]
    keys = ("eval_lm_loss", "eval_mtp_loss")
    if dtype == "fp32":
        for g, r in zip(got, ref, strict=True):
            for k in keys:
                assert g[k] == pytest.approx(r[k], rel=2e-5), (layout, g["step"], k, g[k], r[k])
        return
    fp32 = single["fp32"]
    delta = max(abs(b[k] - f[k]) for b, f in zip(ref, fp32, strict=True) for k in keys)
    bound_steps = range(2)
    if layout not in _FORWARD_CHANGES:
        for k in keys:  # the initial weights: the same forward arithmetic, fp64 sums in another order
            assert got[0][k] == pytest.approx(ref[0][k], rel=1e-12), (layout, k)
        bound_steps = range(1, 2)
    for i in bound_steps:
        for k in keys:
            g, r = got[i][k], ref[i][k]
            assert abs(g - r) <= 2 * delta, (layout, got[i]["step"], k, g, r, delta)
