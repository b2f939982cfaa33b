"""``--tp 2`` combined with DP, PP (and PP x VPP) and EP (issue 31): ``dsv4 train --preset tiny --tp 2 [--pp 2
[--vpp 2] | --ep 2]`` on 4 gloo processes (CPU, sequence parallelism, micro-batches of one sequence) trains like the
single process on the same global batch from the same ``--seed``.

The runs: every cell in both dtypes runs one after the other in one set of 4 spawned gloo processes, both
single-process runs in one process (:func:`cli_runs.train_in_workers`: the CLI's ``main`` with those flags, each run
building and destroying its own megatron state), so the process start and the imports are paid once per world size
instead of once per run. ``torchrun`` itself launches one cell (TP2 x PP2 x VPP2, fp32), whose metrics equal the
spawned run of the same flags bit for bit (the same arithmetic in the same order).

Cells (4 processes each): TP2 x DP2 (``--tp 2``: DP = 4 / 2), TP2 x PP2 (the mHC streams cross the stage boundary as
this rank's sequence shard, megatron's p2p shape ``[s/tp, b, n·d]``), TP2 x PP2 x VPP2 (interleaved schedule, 4
segments of the tiny preset's 6 layers, folded streams ``[(s/tp)·n, b, d]``) and TP2 x EP2 (DP 2, experts split
over 2 EP ranks: each TP rank routes its own sequence shard through the expert all-to-all with expert TP 1). The
global batch: 4 sequences of 64 tokens, micro-batches of one sequence, 2 steps, ``--seed 11``; every process runs
one thread (the single process too: the CPU GEMMs' blocking, and so their rounding, depends on the thread count).

fp32, both steps against the single process: TP changes the summation order of the row-parallel products, of the
vocab-parallel softmax statistics and of the replicated parameters' gradients (two sequence shards summed by the TP
all-reduce); DP, PP and EP add the order of the micro-batch accumulation and of the DP / expert-DP reductions.
Each is an fp32 sum of ``k <= 512`` terms in another order, within ``k·u`` relative (``u = 2**-24``, ``512·u ≈
3e-5``): the losses and the grad norm are compared at ``2e-5`` relative, as the TP2 and parallel-matrix tests do.
The fp32 runs pass ``--warmup-steps 0``, so step 1 updates at the full rate and step 2 also checks the update:
the distributed optimizer's DP shards, and the learned routers' selection bias,
whose expert loads are summed over every rank that routed other tokens (TP's sequence shards too: with DP x CP only,
the TP ranks' biases drifted apart after step 1 and step 2's indexer loss moved by 2e-3 relative). Measured: step 1's
LM / MTP losses and step 2's LM loss bitwise, every value of both steps within 4.3e-7 relative.

bf16, against the single-process bf16 run: TP changes the forward arithmetic (each row-parallel output is two
partial products rounded to bf16 and then added, instead of one sum rounded once; the indexer's and the
vocabulary's statistics are reduced in another order), so nothing is bitwise. We bound it by bf16 rounding itself,
as the parallel matrix does: the single-process bf16 run deviates from the fp32 run of the same weights by its
accumulated bf16 rounding ``δ`` (``max`` over both steps of ``|L_bf16 - L_fp32|``, LM and MTP losses; measured
2.9e-4; the bf16 runs keep the default warm-up, step 1's rate 0, and their fp32 twin is a third single-process run
of that schedule); a TP run makes roundings of the same magnitudes in another grouping, so its deviation from fp32 is of the
same size and ``|L_tp - L_ref| <= 2·δ`` (measured: within 5e-5). Likewise the first step's grad norm within
``2·|g_bf16 - g_fp32|`` (one process; measured 1.1e-2 against a TP deviation of at most 9.1e-5).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import torchrun, train_in_workers, train_metrics
from warm_workers import run_warm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_ARGS = [
    "--preset", "tiny", "--seed", "11", "--steps", "2", "--seq-len", "64", "--global-batch-size", "4",
    "--micro-batch-size", "1", "--no-progress", "--no-save-final",
]  # fmt: skip
_REL = 2e-5
_KEYS = ("lm_loss", "mtp_loss", "grad_norm", "balance_loss", "indexer_loss")
#: fp32 updates at the full rate from step 1 (``--warmup-steps 0``: step 2 checks the update); bf16 keeps the default
#: warm-up (step 1's rate 0) and is compared through a one-process fp32 ``twin`` of its schedule
#: (test_train_tensor_context_parallel.py says why)
_DTYPE_FLAGS = {"fp32": ["--no-bf16", "--warmup-steps", "0"], "bf16": ["--bf16"]}
_TWIN = {"twin": ["--no-bf16"]}

#: cell -> the layout flags of a 4-process run
CELLS = {
    "tp2xdp2": ["--tp", "2"],
    "tp2xpp2": ["--tp", "2", "--pp", "2"],
    "tp2xpp2xvpp2": ["--tp", "2", "--pp", "2", "--vpp", "2"],
    "tp2xep2": ["--tp", "2", "--ep", "2"],
}
#: the cell that torchrun launches too (fp32)
TORCHRUN_CELL = "tp2xpp2xvpp2"


def _flags(layout: list[str], dtype: str, out: Path) -> list[str]:
    return [*_ARGS, *(_DTYPE_FLAGS | _TWIN)[dtype], *layout, "--out", str(out)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{(name, dtype): metrics of steps 1 and 2}``: ``one`` (the single process) and every cell (4 processes)."""
    out = tmp_path_factory.mktemp("tp-combos")
    single = [(f"one-{dt}", _flags([], dt, out / f"one-{dt}")) for dt in _DTYPE_FLAGS | _TWIN]
    cells = [
        (f"{c}-{dt}", _flags(lay, dt, out / f"{c}-{dt}")) for c, lay in CELLS.items() for dt in _DTYPE_FLAGS
    ]
    (one,) = run_warm(train_in_workers, 1, single, timeout=900)
    per_rank = run_warm(train_in_workers, 4, cells, timeout=1800)
    assert all(r == per_rank[0] for r in per_rank)  # every rank read the same metrics.jsonl
    metrics = {tuple(name.rsplit("-", 1)): rows for name, rows in (one | per_rank[0]).items()}
    for rows in metrics.values():
        assert [r["step"] for r in rows] == [1, 2]
    return metrics


def test_torchrun_launches_a_cell_like_the_spawned_run(runs, tmp_path):
    """``torchrun --nproc-per-node 4 -m dsv4_train train`` with the cell's flags logs the spawned run's losses,
    grad norm and LR, bit for bit."""
    got = train_metrics(
        torchrun(4), tmp_path / "cli", *_flags(CELLS[TORCHRUN_CELL], "fp32", tmp_path / "x")[:-2]
    )
    want = runs[TORCHRUN_CELL, "fp32"]
    assert [[m[k] for k in (*_KEYS, "lr")] for m in got] == [[m[k] for k in (*_KEYS, "lr")] for m in want]


@pytest.mark.parametrize("cell", list(CELLS))
def test_tp2_combination_fp32_matches_one_process(runs, cell):
    got, one = runs[cell, "fp32"], runs["one", "fp32"]
    for step, (g, r) in enumerate(zip(got, one, strict=True), start=1):
        for key in _KEYS:
            assert g[key] == pytest.approx(r[key], rel=_REL), (cell, step, key, g[key], r[key])
    assert [r["lr"] for r in got] == [r["lr"] for r in one]
    assert one[0]["lr"] > 0  # step 2 starts from step 1's update


@pytest.mark.parametrize("cell", list(CELLS))
def test_tp2_combination_bf16_within_bf16_rounding_of_one_process(runs, cell):
    got, ref, fp32 = runs[cell, "bf16"], runs["one", "bf16"], runs["one", "twin"]
    delta = max(abs(b[k] - f[k]) for b, f in zip(ref, fp32, strict=True) for k in ("lm_loss", "mtp_loss"))
    assert delta > 0, "the bf16 run must round somewhere"
    for step, (g, r) in enumerate(zip(got, ref, strict=True), start=1):
        for key in ("lm_loss", "mtp_loss"):
            assert abs(g[key] - r[key]) <= 2 * delta, (cell, step, key, g[key], r[key], 2 * delta)
        assert g["lr"] == r["lr"]
    bound = 2 * abs(ref[0]["grad_norm"] - fp32[0]["grad_norm"])
    assert abs(got[0]["grad_norm"] - ref[0]["grad_norm"]) <= bound, (cell, got[0]["grad_norm"], bound)
