"""Tensor-parallel ``DSv4Attention`` (sequence parallelism) at TP=2 and TP=4 equals TP=1 (issue 31), on one 4-rank
gloo world for every case.

Per case (``_tp_cases.CASES``: window / HCA / CSA dense and sparse phase, sparse and dense indexer loss, documents
crossing rank boundaries, shards shorter than the halo, all-tie index scores, ranks without indexer-loss rows): the
gathered outputs and input gradients, every parameter gradient (head-split ones concatenated along their
``partition_dim``, replicated ones summed over TP by megatron's ``finalize_model_grads`` helper and equal on every
rank), the indexer loss summed over the TP partials and the top-k ids the attention uses equal the one-process run.

Tolerances. fp32: TP changes only the order of fp32 sums (head-partial output projections reduced over ranks,
gradients summed over ranks, the teacher's log-sum-exp over two rank groups of heads), a few ulps: the testkit's
fp32 rule (``atol = 1e-5 * max(1, max|ref|)``). bf16: the reduce-scatter of the bf16 head-partial outputs and the
gradient sums round differently from TP=1, so TP=P in bf16 must be as close to the fp32 TP=1 run as the bf16 TP=1
run is, the replicated gradients summed over TP in fp32 (DDP's fp32 main gradients) from bf16 per-rank partials
(``assert_close_to_ref``: error <= 2 x TP=1's bf16 error + the bf16 atol ``1e-3 * max(1, max|ref|)``). Top-k
ids are compared exactly in fp32 (the indexer runs all its heads on one rank: TP=1's arithmetic).
"""

from __future__ import annotations

import pytest
import torch
from _tp_cases import CASES, TP4_CASES, gathered_grad, run_case, world_worker

from dsv4_attention.tp import HEAD_SPLIT
from dsv4_testkit import assert_close_to_ref, run_distributed


@pytest.fixture(scope="module")
def world():
    return run_distributed(world_worker, 4, timeout=900)


def _collect(results: list[dict]) -> dict[str, torch.Tensor]:
    got = {"y": torch.cat([r["y"] for r in results]), "x.grad": torch.cat([r["xg"] for r in results])}
    if results[0]["loss"] is not None:
        got["indexer loss"] = sum(r["loss"] for r in results)
    for n in results[0]["grads"]:
        per = [r["grads"][n] for r in results]
        if per[0] is None:
            assert all(p is None for p in per), n
            continue
        if n not in HEAD_SPLIT:  # replicated: megatron's all-reduce left the same sum on every rank
            for p in per[1:]:
                torch.testing.assert_close(p, per[0], rtol=0, atol=0)
        got[n + ".grad"] = gathered_grad(n, per)
    return got


def _expected(res: dict) -> dict[str, torch.Tensor]:
    out = {"y": res["y"], "x.grad": res["xg"]}
    if res["loss"] is not None:
        out["indexer loss"] = res["loss"]
    out.update({n + ".grad": g for n, g in res["grads"].items() if g is not None})
    return out


@pytest.mark.parametrize(("name", "tp"), [(n, 2) for n in CASES] + [(n, 4) for n in TP4_CASES])
def test_tp_equals_tp1(world, name, tp):
    ref_run = run_case(name, "fp32")
    ref = _expected(ref_run)
    bf16 = CASES[name].get("dtype") == "bf16"
    ref_bf16 = _expected(run_case(name)) if bf16 else None
    ranks = [world[r][(name, tp)] for r in range(tp)]
    got = _collect(ranks)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for key, out in got.items():
        assert_close_to_ref(
            f"{name} TP={tp}: {key}", out, ref[key], None if ref_bf16 is None else ref_bf16[key]
        )
    if CASES[name]["kind"] == "CSA" and not CASES[name].get("dense"):
        for r in ranks:  # every rank attends with TP=1's selection, ties included
            assert len(r["topk"]) == len(ref_run["topk"]) == 1
            if not bf16:
                torch.testing.assert_close(r["topk"][0], ref_run["topk"][0], rtol=0, atol=0)


def test_tp_parameter_marks(world):
    """Head-split parameters carry megatron's partition dim, every other one ``sequence_parallel``."""
    marks = world[0][("csa_sparse_sparseloss_mixed", 2)]["marks"]
    for name, (dim, seq) in marks.items():
        if name in HEAD_SPLIT:
            assert dim == HEAD_SPLIT[name] and not seq, name
        else:
            assert seq and dim is None, name
    assert set(HEAD_SPLIT) <= set(marks)
