"""``--tp 2 --cp 2`` (issue 31): ``dsv4 train --tp 2 --cp 2`` on 4 gloo processes (CPU; megatron's order puts
global rank ``r`` at CP rank ``r // 2``, TP rank ``r % 2``) trains like one process on the same global batch from the
same ``--seed``: every metric of both steps (LM, MTP, balance and indexer losses, grad norm, LR), fp32 and bf16, for
the two ways a micro-batch reaches the model:

* ``[B, S]`` micro-batches of ``B = 3`` sequences of ``S = 64`` tokens (short mock documents, so rows end in padding
  tails): under CP a micro-batch runs as a THD pack of ``B`` documents of ``S`` tokens (192 rows); CP rank ``c``
  holds the contiguous rows ``[96c, 96c + 96)`` and sequence parallelism cuts them over TP, so rank ``(c, t)`` holds
  ``[48(2c + t), 48(2c + t + 1))`` (megatron's tensor-and-context-parallel group, rank ``2c + t``): the shard edges
  fall inside sequences 0 and 2 and on the edge of sequence 1. ``B = 1`` is the same path with a pack of one document.
* ``--packed``: packs of 64 rows holding several mock documents (5..40 tokens) each, sharded by the batch iterator
  over CP as ``--cp`` alone does, then cut over TP by the model; document boundaries fall inside and across the four
  ranks' row ranges.

DSv4 attention ``W C H`` runs dsv4-attention's TP x CP plan (head half over the CP chunk, sequence half over the four
ranks), the hash and learned MoE routers sum their per-document balance statistics over TP x CP, the MTP roll
crosses CP edges, mHC and MTP one depth as in the TP test. Both steps are compared. The fp32 runs pass
``--warmup-steps 0``: step 1 updates at the full rate, so step 2 starts from the weights the first step's reduced
gradients produced and checks those gradients through the optimizer too. The bf16 runs keep the default warm-up
(step 1's rate is 0, so their step 2 checks the forward and backward of the initial weights on the second batch)
and are compared through a one-process fp32 twin of the same schedule: after a full-rate first AdamW step (an
update of about ``lr·sign(g)`` per element) bf16 rounding flips the sign of small gradients, and the deviation from
one process is no longer of the size of the one-process bf16 run's own (test_train_tp_cp_pp_dp.py measured it).

Every run uses one thread per process (the CPU GEMMs' blocking, and so their rounding, depends on the thread count).
The runs: the four 4-process runs (both batches, both dtypes) run one after the other in one set of 4 spawned gloo
processes, the four one-process runs in one process (:func:`cli_runs.train_in_workers`: the CLI's ``main`` with
those flags, each run building and destroying its own megatron state), so the process start and the imports are paid
once per world size instead of once per run (``test_train_tensor_parallel_combos.py`` checks that ``torchrun``
gives those runs' metrics bit for bit).

fp32: ``2e-5`` relative, the parallel matrix's bound. TP x CP changes the summation order of the row-parallel
products (two partial sums added by the reduce-scatter), of the vocab-parallel softmax statistics, of the loss
partials (LM / MTP over CP, indexer and balance over the four ranks) and of the replicated parameters' gradients
(summed over TP by ``finalize_model_grads`` and over CP by DDP). Each is an fp32 sum of ``k <= 512`` terms in another
order, within ``k·u`` relative (``u = 2**-24``, ``512·u ≈ 3e-5`` worst case; such errors are random-signed and far
below it in practice). Measured (CPU, this pattern): the losses within 1e-7 relative (the balance loss equal), the
grad norm within 5e-7 (micro-batches of one sequence; with ``B = 3`` and with packs the losses within 2e-7, the
grad norm within 1e-7).

bf16 (the argument of ``test_parallel_matrix`` and ``test_train_context_parallel``): the TP x CP run makes the same
bf16 roundings as the one-process bf16 run, of the same magnitudes, in another order (each rank's rows and heads,
the gathered compressed entries, the partial sums), so its deviation from the fp32 run is of the size of the
one-process bf16 run's own deviation ``δ_m = max_step |m_bf16 - m_fp32|`` for metric ``m``; by the triangle
inequality ``|m_tpcp - m_one| <= 2·δ_m``. Applied as is to the LM and MTP losses (as the CP test does) and to the
grad norm (a norm of the bf16-rounded gradients). The indexer and balance losses are fp32 statistics of bf16
activations (the indexer's scores, the routers' fp32 gate on the bf16 hidden states): a relative perturbation of
``u_bf16 = 2**-8`` of their inputs moves them by about ``u_bf16`` relative, so each of the two runs is within that of
the fp32 value and they are compared at ``max(2·δ_m, 2·u_bf16·|m_one|)``; the floor matters where the one-process
bf16 and fp32 values happen to nearly coincide (measured: the balance loss's ``δ`` is 2.6e-9 of 1e-4, the TP x CP
deviation 6.3e-9). The LR is exact. Measured (CPU): LM 4.4e-5 (bound 2.7e-4), MTP 3.1e-5 (4.5e-4), grad norm 7.4e-4
(7.6e-3), indexer 1.6e-5 (5.4e-4), balance 6.3e-9 (7.9e-7).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import assert_bf16_parity, assert_fp32_parity, assert_same_steps, train_in_workers
from warm_workers import run_warm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_COMMON = [
    "--preset", "tiny", "--pattern", "WEC-HE/WE", "--seed", "11", "--steps", "2", "--seq-len", "64",
    "--no-progress", "--no-save-final", "--data", "mock:docs=64,min=5,max=40,mean=16",
]  # fmt: skip
#: the two ways a micro-batch reaches the model (module docstring)
BATCHES = {
    "bs3": ["--micro-batch-size", "3", "--global-batch-size", "3"],
    "packed": ["--packed", "--global-batch-size", "2"],
}
DTYPES = {"fp32": ["--no-bf16", "--warmup-steps", "0"], "bf16": ["--bf16"]}
#: one process only: the fp32 twin of the bf16 runs (their schedule), from which the bf16 bound is derived
TWIN = {"twin": ["--no-bf16"]}
LAYOUTS = {"one": [], "tpcp": ["--tp", "2", "--cp", "2"]}


def _runs(layout: str, out: Path) -> list[tuple[str, list[str]]]:
    """``(f"{batch}-{dtype}", dsv4 train flags)`` of both batches in both dtypes on ``layout`` (and the twin)."""
    dtypes = DTYPES | (TWIN if layout == "one" else {})
    return [
        (f"{b}-{dt}", [*_COMMON, *batch, *flags, *LAYOUTS[layout], "--out", str(out / f"{layout}-{b}-{dt}")])
        for b, batch in BATCHES.items()
        for dt, flags in dtypes.items()
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{(layout, batch, dtype): metrics of steps 1 and 2}`` for one process (``one``) and TP 2 x CP 2 (``tpcp``),
    fp32 and bf16, on both :data:`BATCHES`."""
    tmp = tmp_path_factory.mktemp("tpcp")
    (one,) = run_warm(train_in_workers, 1, _runs("one", tmp), timeout=900)
    per_rank = run_warm(train_in_workers, 4, _runs("tpcp", tmp), timeout=1800)
    assert all(r == per_rank[0] for r in per_rank)  # every rank read the same metrics.jsonl
    return {
        (layout, *name.split("-")): rows
        for layout, metrics in (("one", one), ("tpcp", per_rank[0]))
        for name, rows in metrics.items()
    }


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_tp2xcp2_from_the_cli_equals_one_process(runs, batch, dtype):
    one, got = runs["one", batch, dtype], runs["tpcp", batch, dtype]
    assert_same_steps(got, one)
    if dtype == "fp32":
        assert_fp32_parity(got, one)
    else:
        assert_bf16_parity(got, one, runs["one", batch, "twin"])
