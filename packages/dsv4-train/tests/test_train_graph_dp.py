"""``--cuda-graph`` with data parallelism: the graph holds the forward and backward, the DP gradient reduction
(megatron's ``finalize_model_grads``) runs eagerly after it (:mod:`dsv4_train.graph_data_parallel`).

CPU (gloo, 2 processes, fp32): the restructured step — the reduction taken out of the schedule and run after it, the
code path of a graphed DP step, here run eagerly — equals today's DP2 step bitwise (losses, grad norm and every
reduced gradient of the first step) and the single-process run of the same global batch (the parallel matrix's fp32
tolerance, 2e-5: DP sums in another order). The gloo-on-CUDA host staging of the distributed optimizer's
collectives (all-reduce + slice for the reduce-scatter, a host all-gather) is checked the same way on CPU tensors.

GPU (``gpu`` marker, one GPU): two gloo processes on the same GPU train ``--cuda-graph`` DP2 and eager DP2 in bf16;
the per-step losses agree within the bf16 rule of the parallel matrix and are printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from graph_dp_runs import graph_vs_eager, train_variants
from parallel_runs import METRIC_KEYS, merge_rank_grads, train_layouts
from warm_workers import run_warm

from dsv4_train.graph_data_parallel import GradReductionAfterSchedule

# 2 steps: the second one runs on the parameters the distributed optimizer all-gathered after the first. Every run
# builds the model from the same seed at PP = EP = 1, so the DP ranks and the single process start from the same
# weights (the comparison with the single process checks that too)
_BASE = dict(
    seq_len=128, global_batch_size=4, micro_batch_size=1, warmup_steps=1, lr=3e-3, steps=2, bf16=False
)


class _Config:
    def __init__(self, finalize) -> None:
        self.finalize_model_grads_func = finalize


def test_reduction_runs_after_the_schedule_and_after_replays():
    """The schedule's finalize call is recorded, not run, while the schedule runs; the real one runs after it with
    the same arguments — also after a 'replay' (a schedule call that runs no Python, so records nothing)."""
    calls, seen_inside = [], []
    config = _Config(lambda *a, **k: calls.append((a, k)))
    reduction = GradReductionAfterSchedule(config)

    def schedule(**kw):  # megatron's schedule: finalize at its end
        seen_inside.append(config.finalize_model_grads_func)
        config.finalize_model_grads_func(["model"], None, pg_collection="pg", force_all_reduce=False)
        return ["report"]

    assert reduction(schedule, num_microbatches=2) == ["report"]
    assert calls == [((["model"], None), {"pg_collection": "pg", "force_all_reduce": False})]
    assert seen_inside[0] is not config.finalize_model_grads_func  # the recorder, not the reduction
    replay = lambda **kw: ["replayed report"]  # a graph replay: no Python of the schedule runs
    assert reduction(replay, num_microbatches=2) == ["replayed report"]
    assert len(calls) == 2 and calls[1] == calls[0]


def test_a_schedule_without_finalize_is_an_error():
    reduction = GradReductionAfterSchedule(_Config(lambda *a, **k: None))
    with pytest.raises(RuntimeError, match="never called finalize_model_grads"):
        reduction(lambda **kw: [], num_microbatches=1)


@pytest.mark.distributed
def test_split_step_equals_dp2_and_single_process(tmp_path):
    (ref,) = run_warm(
        train_layouts, 1, [("single", _BASE | dict(out=str(tmp_path / "single"), save_final=False))]
    )
    ref = ref["single"]
    runs = [
        (name, _BASE | dict(out=str(tmp_path / name), save_final=False), variant)
        for name, variant in (
            ("dp2", {}),
            ("dp2-split", {"split": True}),
            ("dp2-split-staged", {"split": True, "staged": True}),
        )
    ]
    per_rank = run_warm(train_variants, 2, runs, timeout=900)
    for r in per_rank:  # ranks with different micro-batch counts would replay different steps: refused
        assert (
            "same number of micro-batches" in r["unequal-microbatches"]
            and "2..3" in r["unequal-microbatches"]
        )
    today = per_rank[0]["dp2"]
    assert not today["recorded"]
    for name in ("dp2-split", "dp2-split-staged"):
        assert all(r[name]["recorded"] for r in per_rank), name  # the reduction ran after the schedule
        for rank in per_rank:
            assert rank[name]["metrics"] == rank["dp2"]["metrics"], name  # bitwise: every metric, every step
            assert rank[name]["grads"].keys() == rank["dp2"]["grads"].keys()
            for key, g in rank[name]["grads"].items():
                assert torch.equal(g, rank["dp2"]["grads"][key]), (name, key)
    # against the single process of the same global batch (fp32, the parallel matrix's tolerance)
    got = per_rank[0]["dp2-split"]["metrics"]
    for step, (g, r) in enumerate(zip(got, ref["metrics"], strict=True), start=1):
        for key in METRIC_KEYS:
            assert r[key] is not None, key
            assert g[key] == pytest.approx(r[key], rel=2e-5, abs=1e-7), (step, key, g[key], r[key])
    grads = merge_rank_grads([r["dp2-split"]["grads"] for r in per_rank])
    ref_grads = merge_rank_grads([ref["grads"]])
    assert set(grads) == set(ref_grads)
    for name, g_ref in ref_grads.items():
        err = float((grads[name] - g_ref).abs().max())
        assert err <= 2e-5 * float(g_ref.abs().max()) + 1e-9, (name, err)


_GPU_BASE = dict(
    preset="tiny",
    steps=6,
    seq_len=128,
    global_batch_size=4,
    micro_batch_size=1,
    warmup_steps=0,
    save_final=False,
    mtp_loss_weight_decay=None,  # a constant MTP weight: one capture
    deterministic=True,  # the replays then repeat the eager arithmetic
)


@pytest.mark.gpu
@pytest.mark.distributed
def test_graphed_dp2_on_one_gpu_matches_eager(tmp_path):
    """Two gloo ranks on one GPU (the same as ``torchrun --nproc-per-node 2 -m dsv4_train train --cuda-graph
    --dist-backend gloo``): ``--cuda-graph`` DP2 vs eager DP2 in bf16, per-step losses within ``2·δ``, where
    ``δ = max_step |L_bf16 - L_fp32|`` of the eager DP2 runs (the parallel matrix's bf16 rule: a run that makes the
    same bf16 roundings in another order deviates from fp32 by the same amount; with deterministic kernels the
    replays are expected to repeat the eager arithmetic exactly, which is printed)."""
    runs = [
        ("eager-fp32", _GPU_BASE | dict(bf16=False, out=str(tmp_path / "eager-fp32"))),
        ("eager-bf16", _GPU_BASE | dict(bf16=True, out=str(tmp_path / "eager-bf16"))),
        ("graph-bf16", _GPU_BASE | dict(bf16=True, cuda_graph=True, out=str(tmp_path / "graph-bf16"))),
    ]
    per_rank = run_warm(graph_vs_eager, 2, runs, timeout=1500)
    for name, _ in runs:  # every metric is reduced over the ranks
        assert all(r[name]["metrics"] == per_rank[0][name]["metrics"] for r in per_rank), name
    res = per_rank[0]
    fp32, eager, graph = (res[k]["metrics"] for k in ("eager-fp32", "eager-bf16", "graph-bf16"))
    keys = ("lm_loss", "mtp_loss")
    delta = max(abs(b[k] - f[k]) for b, f in zip(eager, fp32, strict=True) for k in keys)
    print("\nstep  eager-bf16 lm / mtp            graph-bf16 lm / mtp            replayed")
    for e, g, rep in zip(eager, graph, res["graph-bf16"]["replayed"], strict=True):
        print(
            f"{e['step']:>4}  {e['lm_loss']:.9f} / {e['mtp_loss']:.9f}  {g['lm_loss']:.9f} / {g['mtp_loss']:.9f}  {rep}"
        )
    print(f"bound 2*delta = {2 * delta:.3g}; bitwise equal: {eager == graph}")
    assert res["graph-bf16"]["split"] and not res["eager-bf16"]["split"]
    # two eager warm-up steps (bitwise the eager run's), the capture step (replayed at once), replays
    assert res["graph-bf16"]["replayed"] == [False, False] + [True] * 4 and res["graph-bf16"]["captures"] == 1
    assert graph[:2] == eager[:2]
    for g, e in zip(graph, eager, strict=True):
        for k in keys:
            assert abs(g[k] - e[k]) <= 2 * delta, (g["step"], k, g[k], e[k], 2 * delta)
        assert g["lr"] == e["lr"]
    assert graph[-1]["lm_loss"] < graph[0]["lm_loss"]


def test_overlapped_grad_reduce_is_refused():
    """Collectives launched from the backward hooks would be captured: the graphed DP step refuses them."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallelConfig

    from dsv4_train.graph_data_parallel import check_no_sync_in_backward

    def chunk(overlap: bool):  # what the check reads of a megatron DDP chunk
        return SimpleNamespace(ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=overlap))

    check_no_sync_in_backward([chunk(False)])
    with pytest.raises(RuntimeError, match="overlap_grad_reduce=False"):
        check_no_sync_in_backward([chunk(False), chunk(True)])


def test_dist_backend_flag():
    from dsv4_train.cli import build_parser, train_config_from_args
    from dsv4_train.config import TrainConfig, effective_config

    args = build_parser().parse_args(["train", "--dist-backend", "gloo"])
    assert train_config_from_args(args).parallel.dist_backend == "gloo"
    default = effective_config(
        TrainConfig.from_flat(), cuda_available=torch.cuda.is_available()
    ).parallel.dist_backend
    assert default == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(ValueError, match="--dist-backend must be one of"):
        TrainConfig.from_flat(dist_backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--dist-backend nccl needs CUDA"):
            effective_config(TrainConfig.from_flat(dist_backend="nccl"), cuda_available=False)


def test_host_staging_is_scoped():
    """The staged collectives replace megatron's module-level functions only inside the block."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from dsv4_train.gloo_cuda import host_staged_collectives

    names = ("dist_reduce_scatter_func", "dist_all_gather_func", "_coalescing_manager")
    before = [getattr(pgb, n) for n in names]
    with host_staged_collectives():
        assert all(getattr(pgb, n) is not b for n, b in zip(names, before, strict=True))
    assert [getattr(pgb, n) for n in names] == before
