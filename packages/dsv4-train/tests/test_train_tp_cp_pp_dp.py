"""``--tp 2 --cp 2`` on 8 ranks (issue 31): ``dsv4 train --tp 2 --cp 2 --pp 2`` and ``dsv4 train --tp 2 --cp 2``
with DP 2 (8 gloo processes, CPU) train like one process on the same global batch from the same ``--seed``.

Layouts (megatron-core 0.19.2 ``initialize_model_parallel``, order ``tp-cp-ep-dp-pp``): global rank ``r`` is TP rank
``r % 2`` and CP rank ``(r // 2) % 2``;

* TP2 x CP2 x PP2 (DP 1): PP stage ``r // 4``. Each stage runs the TP x CP model of ``test_train_tensor_context_
  parallel.py`` on its layers; the streams crossing the stage boundary are this rank's sequence-parallel shard of
  its CP chunk (megatron's p2p shape ``[s/(cp·tp), b, n·d]``), the two micro-batches of the global batch go through
  the 1F1B schedule.
* TP2 x CP2 x DP2: DP rank ``r // 4``. DP replicates the TP x CP model; each DP rank trains one micro-batch of the
  global batch and DDP reduces the gradients over DP x CP for the distributed optimizer's DP shards (as under
  ``--cp 2`` with DP 2).

The global batch: 2 sequences of 16 tokens (``--seq-len 16``, a multiple of ``cp·tp = 4``: each rank holds 4 rows
of its CP chunk of 8, two CSA blocks of 4; shorter lengths were not tried) in micro-batches of one sequence, short mock documents (3..12
tokens) so rows end in padding tails; the ``tiny`` preset's default pattern (DSv4 attention W C H with its heads
split, hash-routed and learned MoE in every layer, mHC, one MTP depth), 2 steps, one thread per process; both steps
are compared. The fp32 runs pass ``--warmup-steps 0``, so step 1's update uses the full rate and step 2 starts from
the weights the first step's reduced gradients produced: step 2 checks those gradients (TP, CP, DP reductions, the
pipeline's backward, the distributed optimizer's shards) through the optimizer too. (With the default warm-up from
0, step 1's rate is 0 and step 2 runs the initial weights on the next batch.) The bf16 runs keep the default
warm-up: their bound (below) holds for runs on the same weights, which a full-rate AdamW step breaks (measured with
``--warmup-steps 0``: step 2's indexer loss, one process bf16 ``1.2920e-2``, 8 ranks bf16 ``1.2249e-2``, fp32
``1.2639e-2`` for both: the 8-rank run's deviation from fp32 is 1.4 times the one process's, 6.7e-4 apart against
``2·δ = 5.6e-4``; AdamW's normalized update turns bf16 gradient noise on small gradients into steps of ``±lr``, so
the deviation after an update is no longer of one size).

The runs, one module-scoped set: the three one-process runs (fp32 ``--warmup-steps 0``, the reference of the fp32
runs; bf16 and its fp32 twin, both with the default warm-up) in one process, the four 8-rank runs (both layouts,
both dtypes) one after the other in one set of 8 spawned gloo workers (:func:`cli_runs.train_in_workers`: the CLI's
``main`` with those flags as ``torchrun`` runs it; ``test_train_tensor_parallel_combos.py`` checks that ``torchrun``
gives such runs' metrics bit for bit), so the process start and the imports are paid once per world size; the
one-process runs are the reference of both layouts.

Bounds (derived in ``test_train_tensor_context_parallel.py``, :mod:`cli_runs`):

* fp32: ``cli_runs.FP32_REL = 2e-5`` relative. The layouts change only summation orders (row-parallel partial sums,
  the vocab-parallel softmax statistics, the loss partials over TP x CP, the gradient reductions over TP, CP and DP,
  the micro-batch accumulation across stages), each an fp32 sum of ``k <= 512`` terms in another order, within
  ``k·u`` relative (``u = 2**-24``, ``512·u ≈ 3e-5`` worst case; random-signed errors far below it in practice).
* bf16: each bf16 run makes the same roundings of the same magnitudes in another order, so its deviation from the
  fp32 run is of the size of the one-process bf16 run's own deviation ``δ_m = max_step |m_bf16 - m_fp32|``; by the
  triangle inequality ``|m_8 - m_one| <= 2·δ_m``, floored at ``2·u_bf16·|m_one|`` (``u_bf16 = 2**-8``) for the fp32
  statistics of bf16 activations (indexer and balance losses). The LR is exact.

Measured (CPU): fp32, both layouts within 3.1e-7 relative of one process (LM 1.2e-7, MTP 3.8e-8, grad norm
1.4e-7, balance 4.6e-8, indexer 3.1e-7). bf16, both layouts (their metrics agree to 1e-8): LM 7.2e-4 (bound 1.2e-3),
MTP 2.0e-4 (3.8e-4), grad norm 1.2e-3 (1.2e-2), indexer 4.3e-5 (2.3e-4), balance 1.2e-8 (8.0e-7).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import assert_bf16_parity, assert_fp32_parity, assert_same_steps, train_in_workers
from warm_workers import run_warm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLD = 8
_COMMON = [
    "--preset", "tiny", "--seed", "11", "--steps", "2", "--seq-len", "16", "--no-progress", "--no-save-final",
    "--data", "mock:docs=64,min=3,max=12,mean=6", "--micro-batch-size", "1", "--global-batch-size", "2",
]  # fmt: skip
#: the flags of each dtype's runs (module docstring); ``fp32-twin``: the one-process bf16 run's fp32 twin
DTYPES = {"fp32": ["--no-bf16", "--warmup-steps", "0"], "bf16": ["--bf16"]}
TWIN = {"fp32-twin": ["--no-bf16"]}
#: the 8-rank layouts (module docstring); DP = 8 / (tp·cp·pp)
LAYOUTS = {
    "tpcppp": ["--tp", "2", "--cp", "2", "--pp", "2"],
    "tpcpdp": ["--tp", "2", "--cp", "2"],
}


def _named(
    layouts: dict[str, list[str]], dtypes: dict[str, list[str]], out: Path
) -> list[tuple[str, list[str]]]:
    return [
        (f"{name}:{dt}", [*_COMMON, *flags, *layout, "--out", str(out / f"{name}-{dt}")])
        for name, layout in layouts.items()
        for dt, flags in dtypes.items()
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{(layout, dtype): metrics of steps 1 and 2}``: ``one`` (one process, also ``fp32-twin``) and both 8-rank
    :data:`LAYOUTS`."""
    tmp = tmp_path_factory.mktemp("tpcp8")
    (one,) = run_warm(train_in_workers, 1, _named({"one": []}, DTYPES | TWIN, tmp), timeout=900)
    per_rank = run_warm(train_in_workers, WORLD, _named(LAYOUTS, DTYPES, tmp), timeout=2400)
    assert all(r == per_rank[0] for r in per_rank)  # every rank read the same metrics.jsonl
    return {tuple(name.split(":")): rows for name, rows in (one | per_rank[0]).items()}


def _check(runs: dict, layout: str, dtype: str) -> None:
    one, got = runs["one", dtype], runs[layout, dtype]
    assert_same_steps(got, one)
    if dtype == "fp32":
        assert got[0]["lr"] > 0  # step 2 runs the weights step 1's update made (module docstring)
        assert_fp32_parity(got, one)
    else:
        assert_bf16_parity(got, one, runs["one", "fp32-twin"])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tp2xcp2xpp2_from_the_cli_equals_one_process(runs, dtype):
    _check(runs, "tpcppp", dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tp2xcp2xdp2_from_the_cli_equals_one_process(runs, dtype):
    _check(runs, "tpcpdp", dtype)
