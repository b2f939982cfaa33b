"""``--tp 2 --cp 2 --ep 2`` from the CLI (issue 31): ``torchrun --nproc-per-node 4 -m dsv4_train train --tp 2 --cp 2
--ep 2`` (gloo, CPU) trains like one process, both from a ``dsv4 convert HF OUT --tp 2 --ep 2`` conversion and from
the same ``--seed``.

Layout (megatron-core 0.19.2 ``initialize_model_parallel``): the dense ranks are TP x CP (global rank ``r`` at CP
rank ``r // 2``, TP rank ``r % 2``, DP 1); the experts get their own rank generator, expert TP 1 x EP 2 x expert DP
``world / (etp·ep·pp) = 2``, which only needs the world divisible by ``etp·ep·pp``: EP groups ``{0, 1}, {2, 3}``
(each TP pair of one CP chunk), expert DP groups ``{0, 2}, {1, 3}``. Each rank's sequence-parallel shard of its CP
chunk goes through the expert all-to-all of its EP group, as under ``--tp 2 --ep 2``; the routed experts' gradients
are averaged over expert DP (the two CP chunks).

One module-scoped set of runs (two 4-rank runs one after the other in one set of 4 spawned gloo processes, three
one-process runs in one process: :func:`cli_runs.train_in_workers`, the CLI's ``main`` with those flags; the process
start and the imports are paid once per world size, and ``test_train_tensor_parallel_combos.py`` checks that
``torchrun`` gives such runs' metrics bit for bit), on ``[B, S]`` micro-batches of ``B = 3``
sequences of 64 tokens (a THD pack of three documents cut over CP, then over TP: the shard edges of
``test_train_tensor_context_parallel.py``), the ``tiny`` preset (its pattern has MoE in every layer and the MTP
block), one thread per process:

* fp32, from a conversion: the 4-rank run ``--init-from`` the ``--tp 2 --ep 2`` conversion of an HF export (each
  rank reads its TP and EP shards from it), against one process ``--init-from`` the TP 1
  conversion of the same export: every metric of both steps within ``2e-5`` relative (the bound of
  ``test_convert_released_cli.py`` and ``test_train_tensor_context_parallel.py``: fp32 sums of ``k <= 512`` terms in
  another order). The second step starts from the weights the first step's reduced gradients produced, so it checks
  those gradients (TP, CP and expert-DP reductions) through the optimizer too. Measured (CPU): grad norm within 2.4e-7
  relative, the LM and MTP losses within 6e-8, the indexer loss 2.8e-7.
* bf16, from the same ``--seed`` (one initial model under every layout): the 4-rank run against one process with the
  bound that ``test_train_tensor_context_parallel.py`` derives: ``2·δ_m``, ``δ_m`` the one-process bf16 run's own
  deviation from its fp32 run, floored at ``2·u_bf16·|m|`` for the fp32 statistics (indexer and balance losses).
  Measured (CPU): LM 1.8e-4 (bound 3.4e-4), MTP 1.3e-4 (5.1e-4), grad norm 5.2e-4 (1.2e-3), indexer 1.3e-4
  (1.2e-3), balance 1.2e-9 (7.9e-7).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import assert_bf16_parity, assert_fp32_parity, assert_same_steps, train_in_workers
from warm_workers import run_warm

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from dsv4_train.cli import main
from hybrid_model.hf.convert import export_hf_checkpoint
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_COMMON = [
    "--preset", "tiny", "--seed", "11", "--steps", "2", "--seq-len", "64", "--no-progress", "--no-save-final",
    "--data", "mock:docs=64,min=5,max=40,mean=16", "--micro-batch-size", "3", "--global-batch-size", "3",
]  # fmt: skip
_LAYOUT = ["--tp", "2", "--cp", "2", "--ep", "2"]
#: the fp32 runs: step 1 updates at the full rate, so step 2 checks the reduced gradients through the optimizer (the
#: bf16 runs and their fp32 twin keep the default warm-up, step 1's rate 0: test_train_tensor_context_parallel.py)
_FULL_RATE = ["--warmup-steps", "0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{(layout, dtype, start): metrics of steps 1 and 2}``: ``start`` is ``"conv"`` (``--init-from`` a
    conversion: TP 1 for one process, ``--tp 2 --ep 2`` for the 4 ranks) or ``"seed"``."""
    tmp = tmp_path_factory.mktemp("tpcpep")
    hf, tp1, tp2ep2 = tmp / "hf", tmp / "conv-tp1", tmp / "conv-tp2-ep2"
    with megatron_cpu_context():
        torch.manual_seed(0)
        export_hf_checkpoint(build_model(get_preset("tiny")).eval(), hf, max_shard_bytes=1 << 40)
        assert main(["convert", str(hf), str(tp1)]) == 0
        assert main(["convert", str(hf), str(tp2ep2), "--tp", "2", "--ep", "2"]) == 0
    single = {
        ("one", "fp32", "conv"): [*_COMMON, "--no-bf16", *_FULL_RATE, "--init-from", str(tp1)],
        ("one", "fp32", "seed"): [*_COMMON, "--no-bf16"],
        ("one", "bf16", "seed"): [*_COMMON, "--bf16"],
    }
    four = {
        ("tpcpep", "fp32", "conv"): [
            *_COMMON,
            "--no-bf16",
            *_FULL_RATE,
            *_LAYOUT,
            "--init-from",
            str(tp2ep2),
        ],
        ("tpcpep", "bf16", "seed"): [*_COMMON, "--bf16", *_LAYOUT],
    }
    out = {}
    for world, runs in ((1, single), (4, four)):
        named = [("-".join(key), [*flags, "--out", str(tmp / "-".join(key))]) for key, flags in runs.items()]
        per_rank = run_warm(train_in_workers, world, named, timeout=1800)
        assert all(r == per_rank[0] for r in per_rank)  # every rank read the same metrics.jsonl
        out |= {key: per_rank[0]["-".join(key)] for key in runs}
    return out


def test_tp2xcp2xep2_from_a_tp2_ep2_conversion_equals_one_process(runs):
    one, got = runs["one", "fp32", "conv"], runs["tpcpep", "fp32", "conv"]
    assert_same_steps(got, one)
    # the conversion, not the seed, gave the initial model (the seed's own model starts elsewhere)
    assert one[0]["lm_loss"] != runs["one", "fp32", "seed"][0]["lm_loss"]
    assert_fp32_parity(got, one)


def test_tp2xcp2xep2_bf16_from_the_seed_equals_one_process(runs):
    one, got, fp32 = runs["one", "bf16", "seed"], runs["tpcpep", "bf16", "seed"], runs["one", "fp32", "seed"]
    assert_same_steps(got, one)
    assert_bf16_parity(got, one, fp32)
