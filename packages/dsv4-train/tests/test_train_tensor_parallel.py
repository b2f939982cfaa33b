"""``--tp`` from the CLI (issue 31): ``torchrun --nproc-per-node 2 -m dsv4_train train --tp 2`` (gloo, CPU, sequence
parallelism, micro-batches of one sequence) on a pattern of DSv4 attention ``W C H`` (its heads split by
dsv4-attention's TP core), megatron's MLP ``-``, DSv4 MoE ``E`` (hash-routed and learned), mHC and one MTP depth
starts from the single process's model and batches: its first step is the single process's first step (LM / MTP /
balance / indexer losses and the grad norm). Megatron's ``*`` under TP (one attention family per model, so another
pattern) is covered at the model level (hybrid-model ``tests/test_tensor_parallel.py``, ``*E-E/*E``). ``--tp 2
--packed`` and ``--tp 2 --micro-batch-size 3`` (run as a THD pack of 3 documents, padded by one row) train like one
process for two steps, fp32 and bf16 (the last two tests).

The runs: the five ``--tp 2`` runs run one after the other in one pair of spawned gloo processes, the seven
one-process runs (those five and the bf16 runs' fp32 twins) in one process (:func:`cli_runs.train_in_workers`: the CLI's ``main`` with those flags, each run
building and destroying its own megatron state), so the process start and the imports are paid once per world size
instead of once per run (``test_train_tensor_parallel_combos.py`` checks that ``torchrun`` gives those runs' metrics
bit for bit).

Both runs use one thread per process (the single process is given ``OMP_NUM_THREADS=1`` too: the CPU GEMMs'
blocking, and so their rounding, depends on the thread count).

Bounds (fp32): TP changes the summation order of the row-parallel products (``linear_proj``, ``linear_fc2``, the
shared expert's ``linear_down``, DSv4 attention's ``wo_b``: two partial sums of ``k/2`` terms added by the
reduce-scatter), of the vocab-parallel softmax statistics, of the indexer loss's per-rank partials and of the
replicated parameters' gradients (two sequence shards summed by the TP all-reduce). Each is an fp32 sum of ``k <=
512`` terms in another order: within ``k·u`` relative (``u = 2**-24``, ``512·u ≈ 3e-5``) of its value; the losses
and the grad norm are compared at ``2e-5`` relative as the parallel matrix does (measured with this pattern: the LM
loss within 2e-8, the grad norm within 4e-7, the indexer loss within 1e-7 relative).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import ONE_PROCESS, train_in_workers, train_metrics
from warm_workers import run_warm

_COMMON = [
    "--preset", "tiny", "--pattern", "WEC-HE/WE", "--seed", "11", "--seq-len", "64", "--global-batch-size", "4",
    "--no-progress", "--no-save-final",
]  # fmt: skip
_ARGS = [*_COMMON, "--no-bf16", "--steps", "1", "--micro-batch-size", "1"]
_REL = 2e-5

# --- packs and [B, S] micro-batches of several sequences under TP (one THD pack cut into sequence-parallel shards)

#: short mock documents (5..40 tokens) in rows / packs of 64: every pack holds several documents, and document
#: boundaries fall inside both TP shards and across the shard edge (row 32)
_DOCS = ["--data", "mock:docs=64,min=5,max=40,mean=16", "--steps", "2"]
_KEYS = ("lm_loss", "mtp_loss", "grad_norm", "balance_loss", "indexer_loss")
#: fp32 updates at the full rate from step 1 (``--warmup-steps 0``: step 2 checks the update); bf16 keeps the default
#: warm-up (step 1's rate 0) and is compared through a one-process fp32 ``twin`` of its schedule
#: (test_train_tensor_context_parallel.py says why)
_DTYPES = {"fp32": ["--no-bf16", "--warmup-steps", "0"], "bf16": ["--bf16"]}
_TWIN = {"twin": ["--no-bf16"]}
#: case -> the flags of its runs (``first``: one step; the others in both dtypes, named ``CASE-DTYPE``)
_CASES = {
    "packed": [*_COMMON, *_DOCS, "--packed"],
    "micro": [*_COMMON, *_DOCS, "--seq-len", "63", "--micro-batch-size", "3", "--global-batch-size", "6"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """``{"one" | "tp": {run: metrics}}``: every run of the module on one process and with ``--tp 2``."""
    tmp = tmp_path_factory.mktemp("tp2")
    out = {}
    for layout, world, extra in (("one", 1, []), ("tp", 2, ["--tp", "2"])):
        dtypes = _DTYPES | (_TWIN if layout == "one" else {})
        runs = [("first", [*_ARGS, *extra])] + [
            (f"{case}-{dt}", [*flags, *dt_flags, *extra])
            for case, flags in _CASES.items()
            for dt, dt_flags in dtypes.items()
        ]
        runs = [(name, [*flags, "--out", str(tmp / f"{layout}-{name}")]) for name, flags in runs]
        per_rank = run_warm(train_in_workers, world, runs, timeout=1800)
        assert all(r == per_rank[0] for r in per_rank)  # every rank read the same metrics.jsonl
        out[layout] = per_rank[0]
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_last_one_process_run_of_the_worker_equals_a_fresh_process(runs, tmp_path):
    """The worker's one-process runs share a process: its last run (after four others) logs what a fresh ``dsv4
    train`` process logs with the same flags, bit for bit (no state leaks from one run into the next)."""
    got = train_metrics(ONE_PROCESS, tmp_path / "fresh", *_CASES["micro"], *_DTYPES["bf16"])
    want = runs["one"]["micro-bf16"]
    assert [[m[k] for k in (*_KEYS, "lr")] for m in got] == [[m[k] for k in (*_KEYS, "lr")] for m in want]


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_from_the_cli_starts_like_one_process(runs):
    one, tp = runs["one"]["first"][0], runs["tp"]["first"][0]
    assert one["step"] == tp["step"] == 1
    for key in ("lm_loss", "mtp_loss", "grad_norm", "balance_loss", "indexer_loss"):
        assert tp[key] == pytest.approx(one[key], rel=_REL), (key, tp[key], one[key])


def _tp2_matches_one_process(runs, case: str) -> None:
    """fp32 and bf16, one process and ``--tp 2`` on the same ``case`` flags: fp32 within :data:`_REL` at every
    step, bf16 within ``2·δ`` per metric (the docstrings of the callers)."""
    one_fp32, one_bf16, twin = (
        runs["one"][f"{case}-fp32"],
        runs["one"][f"{case}-bf16"],
        runs["one"][f"{case}-twin"],
    )
    tp_fp32, tp_bf16 = runs["tp"][f"{case}-fp32"], runs["tp"][f"{case}-bf16"]
    assert [m["step"] for m in one_fp32] == [m["step"] for m in tp_fp32] == [1, 2]
    assert one_fp32[0]["lr"] > 0  # step 2 starts from step 1's update
    for one, tp in zip(one_fp32, tp_fp32, strict=True):
        for key in _KEYS:
            assert tp[key] == pytest.approx(one[key], rel=_REL), ("fp32", one["step"], key, tp[key], one[key])
    for key in _KEYS:
        delta = max(abs(b[key] - f[key]) for b, f in zip(one_bf16, twin, strict=True))
        for one, tp in zip(one_bf16, tp_bf16, strict=True):
            assert abs(tp[key] - one[key]) <= 2 * delta, ("bf16", one["step"], key, tp[key], one[key], delta)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_packed_from_the_cli_trains_like_one_process(runs):
    """``--tp 2 --packed`` equals one process ``--packed`` for two steps (fp32 and bf16).

    The packs (``--seq-len 64`` rows, several mock documents each, a static dummy tail) are fed whole to every TP
    rank with the global ``PackedSeqParams``; the model cuts the rows into the sequence-parallel shards ``[r·32,
    (r+1)·32)``: DSv4 attention's TP layout keeps every document's window, compressor groups and indexer rows, the
    MTP roll runs on the whole pack (inside documents), the routers' per-document balance loss takes the pack's
    intervals clipped to the rank's rows and sums its counts over TP, the LM / MTP losses are computed on the
    gathered rows with the whole pack's loss mask.

    fp32: the module docstring's bound (the same sums in another order), at both steps.

    bf16 (derived as ``test_parallel_matrix``'s loss bound): both runs make the same bf16 roundings of the same
    magnitudes, in another order (the head split, the two sequence shards' GEMMs, the reduce-scatters): each deviates
    from the exact value by at most about what the single process's bf16 run deviates from its fp32 run, ``δ =
    max_step |m_bf16 - m_fp32|`` per metric (measured in the test; the fp32 runs agree within 2e-5 relative). By the
    triangle inequality ``|m_tp - m_one| <= 2·δ`` for the losses and the grad norm at both steps."""
    _tp2_matches_one_process(runs, "packed")


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_micro_batches_from_the_cli_train_like_one_process(runs):
    """``--tp 2 --micro-batch-size 3`` equals one process with micro-batches of 3 sequences for two steps (fp32, bf16).

    Under TP a ``[B, S]`` micro-batch runs as a THD pack of ``B`` documents of ``S`` tokens (row ``b`` is document
    ``b``, its padding tail inside it, masked): per sequence the same attention, compressors and MTP targets as
    ``[B, S]``, the same loss normalization (masked mean over the ``B·S`` tokens), the balance loss per document =
    per sequence. The short mock documents leave padding tails in the rows, so masking is exercised. ``B = 3`` rows
    of ``S = 63`` tokens: the pack's 189 rows do not split over 2 ranks, so one row is appended outside every document
    (:func:`dsv4_train.sequence_parallel.pad_pack_rows`), and the shard edge (row 95) falls inside sequence 1.

    Bounds: fp32 and bf16 as :func:`test_tp2_packed_from_the_cli_trains_like_one_process` (the same derivation)."""
    _tp2_matches_one_process(runs, "micro")
