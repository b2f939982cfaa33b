"""The parallel matrix on CPU (gloo): every layout trains the tiny preset like the single process, fp32 and bf16.

Cells: DP2, PP2, PP2xVPP2 (interleaved schedule, 2 virtual stages per rank: 4 segments, the mHC streams folded for
the schedule's p2p shape, including the wrap-around from rank 1's first chunk to rank 0's second), PP2 on packed
THD batches, EP2 (2 processes) and DP2xEP2, PP2xEP2, DP2xPP2 (4 processes), each in fp32 and in bf16, against the
single-process run of the same global batch (4 sequences of 160 tokens, micro-batches of 1, 3 steps; the packed
cell against the single-process packed run: 4 packs of 160 rows). Every run starts from the same weights, two ways:
the DP2, PP2, PP2xVPP2 and EP2 cells build their model from ``--seed`` as users do (layout-independent
initialisation, ``hybrid_model.seeded_init``: their initial parameters are checked bitwise equal to the
single-process model's), the other cells read the single-process reference's initial model (step 0) with
``init_from`` (megatron resharding to their PP/EP layout). The comparison isolates the parallel path:
data sharding over DP, the mHC stream transport between pipeline stages (``n·d`` channels in the stream dtype), MTP
on the last stage with its embedding copy, hash layers on the first, expert dispatch over EP, gradient reduction,
the distributed optimizer and the metric reductions. 160 tokens give HCA (ratio 128) entries and sparse CSA top-k.

All layouts of one world size run one after the other in the same processes (see :mod:`parallel_runs`).

fp32: losses, metrics and the first step's reduced gradients of every parameter agree to 2e-5 (fp32 sums in
another order: DP/EP reductions, micro-batch accumulation, the grad norm over stages).

bf16, what is bitwise and why (the micro-batches are the same sequences in every layout):

* the first step's LM and MTP losses are bitwise equal in every cell without EP: DP and PP change no forward
  arithmetic (the streams cross stages in fp32, the stream dtype, so the boundary rounds nothing). With EP the
  experts' grouped GEMMs see another set of rows, which may round differently.
* gradients: each is computed in bf16 per micro-batch and accumulated (and DP-reduced) in fp32; a layout changes
  the fp32 summation order (a few fp32 roundings) and, for the word embedding, one bf16 rounding per micro-batch:
  on one stage the main-head and MTP contributions are summed by autograd in the parameter's dtype (bf16) before
  the fp32 accumulation, with PP they live on two stages and are summed in fp32 by the embedding-group all-reduce.
  Bound per tensor: ``max|g - g_ref| <= M·u·max|g_ref|`` with ``M = 4`` micro-batches and ``u = 2**-8`` the bf16
  unit roundoff (one bf16 rounding of at most ``max|g_ref|`` per micro-batch); EP's row-grouping differences stay
  at the same order (a rounding per GEMM output).
* losses of later steps: the step's parameter update is a function of the gradients (and of the grad norm through
  clipping), so the small differences above move the fp32 main params by fp32-rounding amounts, which flips the
  bf16 rounding of a few weights by one bf16 ulp. We bound the loss difference by bf16 rounding itself: the
  single-process bf16 run deviates from the fp32 run of the same weights by its accumulated bf16 rounding,
  ``δ = max_step |L_bf16 - L_fp32|`` (measured here, both single-process); a parallel bf16 run makes the same
  roundings of the same magnitudes (in another order), so its deviation from fp32 is of the same size and, by the
  triangle inequality, ``|L_par - L_ref| <= 2·δ``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_runs import METRIC_KEYS, merge_rank_grads, train_layouts
from warm_workers import run_warm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_BASE = dict(seq_len=160, global_batch_size=4, micro_batch_size=1, warmup_steps=1, lr=3e-3, steps=3)
_MICRO_BATCHES = 4  # global batch 4 / micro-batch 1: what one rank accumulates in the single-process run
_BF16_U = 2.0**-8  # bf16 unit roundoff (8 significant bits)

# cell: (world size, TrainConfig layout); DP is the rest of the world (EP splits the experts inside DP). A layout
# with packed=True trains on packed THD batches (4 packs of 160 token rows per step, one pack per micro-batch) and
# is compared with the single-process packed run. SEEDED cells build their model from the seed (no init_from).
CELLS = {
    "dp2": (2, dict()),
    "pp2": (2, dict(pp=2)),
    "pp2xvpp2": (2, dict(pp=2, vpp=2)),
    "pp2-packed": (2, dict(pp=2, packed=True)),
    "ep2": (2, dict(ep=2)),
    "dp2xep2": (4, dict(ep=2)),
    "pp2xep2": (4, dict(pp=2, ep=2)),
    "dp2xpp2": (4, dict(pp=2)),
}
SEEDED = frozenset({"dp2", "pp2", "pp2xvpp2", "ep2"})
DTYPES = ("fp32", "bf16")


def _ref_key(dtype: str, layout: dict) -> str:
    return f"{dtype}-packed" if layout.get("packed") else dtype


def _config(dtype: str, layout: dict, **kw) -> dict:
    base = dict(_BASE, bf16=dtype == "bf16")
    if layout.get("packed"):
        del base["micro_batch_size"]  # a THD micro-batch is one pack
    return base | layout | kw


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process fp32 and bf16 runs, unpacked and packed (each saves its initial weights for the parallel
    runs)."""
    out = tmp_path_factory.mktemp("single")
    runs = [
        (_ref_key(dt, lay), _config(dt, lay, out=str(out / _ref_key(dt, lay))))
        for lay in (dict(), dict(packed=True))
        for dt in DTYPES
    ]
    (results,) = run_warm(train_layouts, 1, runs, True, timeout=900)
    for key in results:
        results[key]["init"] = str(out / key / "checkpoints" / "iter_0000000")
        results[key]["grads"] = merge_rank_grads([results[key]["grads"]])
        results[key]["initial"] = merge_rank_grads([results[key]["initial"]])
    return results


@pytest.fixture(scope="module")
def parallel(reference, tmp_path_factory):
    """Every cell in both dtypes: one set of processes per world size, computed once for the module."""
    cache: dict[int, list[dict]] = {}

    def get(cell: str, dtype: str) -> list[dict]:
        world, _ = CELLS[cell]
        if world not in cache:
            out = tmp_path_factory.mktemp(f"world{world}")
            runs = [
                (
                    f"{name}-{dt}",
                    _config(
                        dt,
                        layout,
                        out=str(out / f"{name}-{dt}"),
                        **({} if name in SEEDED else {"init_from": reference[_ref_key(dt, layout)]["init"]}),
                    ),
                )
                for name, (w, layout) in CELLS.items()
                if w == world
                for dt in DTYPES
            ]
            cache[world] = run_warm(train_layouts, world, runs, timeout=1800)
        return [rank[f"{cell}-{dtype}"] for rank in cache[world]]

    return get


def _bf16_loss_bound(reference, packed: bool = False) -> float:
    """``2·δ``: twice the largest deviation of the single-process bf16 losses from fp32 (module docstring)."""
    suffix = "-packed" if packed else ""
    fp32, bf16 = reference["fp32" + suffix]["metrics"], reference["bf16" + suffix]["metrics"]
    return 2 * max(
        abs(b[key] - f[key]) for b, f in zip(bf16, fp32, strict=True) for key in ("lm_loss", "mtp_loss")
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", list(CELLS))
def test_cell_matches_single_process(reference, parallel, cell, dtype):
    layout = CELLS[cell][1]
    ref = reference[_ref_key(dtype, layout)]
    per_rank = parallel(cell, dtype)
    metrics = [r["metrics"] for r in per_rank]
    assert all(m == metrics[0] for m in metrics), "every metric is reduced over the ranks that computed it"
    got = metrics[0]
    assert len(got) == len(ref["metrics"]) == _BASE["steps"]
    grads = merge_rank_grads([r["grads"] for r in per_rank])
    assert set(grads) == set(ref["grads"])
    if dtype == "fp32":
        for step, (g, r) in enumerate(zip(got, ref["metrics"], strict=True), start=1):
            for key in METRIC_KEYS:
                assert r[key] is not None, key
                assert g[key] == pytest.approx(r[key], rel=2e-5, abs=1e-7), (cell, step, key, g[key], r[key])
        for name, g_ref in ref["grads"].items():
            err = float((grads[name] - g_ref).abs().max())
            assert err <= 2e-5 * float(g_ref.abs().max()) + 1e-9, (cell, name, err)
        return
    if "ep" not in cell:  # no forward arithmetic changes without EP: bitwise
        assert (got[0]["lm_loss"], got[0]["mtp_loss"]) == (
            ref["metrics"][0]["lm_loss"],
            ref["metrics"][0]["mtp_loss"],
        )
    bound = _bf16_loss_bound(reference, packed=bool(layout.get("packed")))
    for step, (g, r) in enumerate(zip(got, ref["metrics"], strict=True), start=1):
        for key in ("lm_loss", "mtp_loss"):
            assert abs(g[key] - r[key]) <= bound, (cell, step, key, g[key], r[key], bound)
        assert g["lr"] == r["lr"]
    for name, g_ref in ref["grads"].items():
        err = float((grads[name] - g_ref).abs().max())
        assert err <= _MICRO_BATCHES * _BF16_U * float(g_ref.abs().max()), (cell, name, err)
    assert ref["metrics"][-1]["lm_loss"] < ref["metrics"][0]["lm_loss"]


def test_pp2_bf16_gradients_bitwise_but_the_shared_embedding(reference, parallel):
    """PP2 in bf16 computes the same math as one stage: the first step's loss and every gradient are bitwise equal,
    except the word embedding's (main-head + MTP contributions summed in fp32 across stages instead of in bf16)."""
    ref = reference["bf16"]
    per_rank = parallel("pp2", "bf16")
    grads = merge_rank_grads([r["grads"] for r in per_rank])
    differing = sorted(name for name, g in ref["grads"].items() if not torch.equal(grads[name], g))
    assert differing in ([], ["embedding.word_embeddings.weight"]), differing
    got = per_rank[-1]["metrics"][0]
    assert (got["lm_loss"], got["mtp_loss"]) == (ref["metrics"][0]["lm_loss"], ref["metrics"][0]["mtp_loss"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", sorted(SEEDED))
def test_seeded_layout_starts_from_the_single_process_model(reference, parallel, cell, dtype):
    """Built from ``--seed`` alone, the layout's initial parameters (PP stages and VPP chunks renumbered to global
    layers, EP ranks' experts concatenated, DP replicas and the MTP embedding copy bitwise equal) are the
    single-process model's, bit for bit (each parameter drawn from its own ``(seed, global name)`` generator)."""
    initial = merge_rank_grads([r["initial"] for r in parallel(cell, dtype)])
    ref = reference[_ref_key(dtype, CELLS[cell][1])]["initial"]
    assert set(initial) == set(ref)
    differing = sorted(name for name, p in ref.items() if not torch.equal(initial[name], p))
    assert differing == [], differing
