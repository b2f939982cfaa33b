"""Tensor x context parallel ``DSv4Attention`` (TP=2 x CP=2, sequence parallelism inside each CP chunk) equals the
one-process run (issue 31), on one 4-rank gloo world for every case.

Per case (``_tp_cases.CASES``: window / HCA / CSA dense and sparse phase, sparse and dense indexer loss, packed
documents crossing rank and CP-chunk boundaries, shards (6 rows) shorter than the halo, all-tie index scores, ranks
without indexer-loss rows, HCA ratio-128 groups straddling ranks, bf16 window / CSA): the outputs and input
gradients gathered in rank order, the indexer loss summed over the four partials, every parameter gradient
(replicated ones summed over TP by megatron's ``finalize_model_grads`` helper, equal on both TP ranks, then summed
over CP as megatron's DDP does; head-split ones summed over CP and concatenated over TP along their
``partition_dim``) and the top-k ids each rank attends with (its CP chunk's rows) equal the one-process run.

Tolerances. fp32: TP x CP changes only the order of fp32 sums (head-partial outputs reduced over TP, gradients
summed over TP and CP, the teacher's log-sum-exp over two groups of heads, the halo rows' KV gradient summed over
CP ranks), a few ulps each: the testkit's fp32 rule (``atol = 1e-5 * max(1, max|ref|)``). bf16: the bf16
reduce-scatter of the head-partial outputs, the bf16 halo-gradient sums and the projections of the extended rows
round differently from one process, each at most a bf16 rounding of the same terms one process rounds once, so
TP x CP in bf16 must be as close to the fp32 one-process run as the bf16 one-process run is, with a factor 2 for the
extra rounding of each partial sum (``assert_close_to_ref``: error <= 2 x the one-process bf16 error + the bf16
atol ``1e-3 * max(1, max|ref|)``). Top-k ids are compared exactly in fp32 (the indexer runs all its heads on one
rank: one process's arithmetic and tie rule).
"""

from __future__ import annotations

import pytest
import torch
from _tp_cases import CASES, run_case
from _tpcp_cases import ADAPTER_KINDS, CP, TP, adapter_reference, world_worker

from dsv4_attention.tp import HEAD_SPLIT
from dsv4_testkit import assert_close_to_ref, run_distributed


@pytest.fixture(scope="module")
def world():
    return run_distributed(world_worker, TP * CP, timeout=1500)


def _collect(results: list[dict]) -> dict[str, torch.Tensor]:
    """``results[c*TP + t]`` -> the one-process tensors (module docstring)."""
    got = {"y": torch.cat([r["y"] for r in results]), "x.grad": torch.cat([r["xg"] for r in results])}
    if results[0]["loss"] is not None:
        got["indexer loss"] = sum(r["loss"] for r in results)
    for n in results[0]["grads"]:
        per = [r["grads"][n] for r in results]
        if per[0] is None:
            assert all(p is None for p in per), n
            continue
        by_tp = [sum(per[c * TP + t] for c in range(CP)) for t in range(TP)]  # DDP's sum over CP
        if n in HEAD_SPLIT:
            got[n + ".grad"] = torch.cat(by_tp, HEAD_SPLIT[n])
        else:  # replicated: megatron's TP all-reduce left the same sum on both TP ranks of a chunk
            for c in range(CP):
                torch.testing.assert_close(per[c * TP + 1], per[c * TP], rtol=0, atol=0)
            got[n + ".grad"] = by_tp[0]
    return got


def _expected(res: dict) -> dict[str, torch.Tensor]:
    out = {"y": res["y"], "x.grad": res["xg"]}
    if res["loss"] is not None:
        out["indexer loss"] = res["loss"]
    out.update({n + ".grad": g for n, g in res["grads"].items() if g is not None})
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_tpcp_equals_one_process(world, name):
    ref_run = run_case(name, "fp32")
    ref = _expected(ref_run)
    bf16 = CASES[name].get("dtype") == "bf16"
    ref_bf16 = _expected(run_case(name)) if bf16 else None
    ranks = [world[r][name] for r in range(TP * CP)]
    got = _collect(ranks)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for key, out in got.items():
        assert_close_to_ref(
            f"{name} TP2xCP2: {key}", out, ref[key], None if ref_bf16 is None else ref_bf16[key]
        )
    if CASES[name]["kind"] == "CSA":  # the indexer is trained: its parameters get gradients on every rank
        for r in ranks:
            assert all(r["grads"][n] is not None for n in r["grads"] if ".indexer." in n), name
    if CASES[name]["kind"] == "CSA" and not CASES[name].get("dense"):
        for r in ranks:  # every rank attends its CP chunk's rows with one process's selection, ties included
            assert len(r["topk"]) == len(ref_run["topk"]) == 1
            lo, hi = r["chunk"]
            assert r["topk"][0].shape[0] == hi - lo
            if not bf16:
                torch.testing.assert_close(r["topk"][0], ref_run["topk"][0][lo:hi], rtol=0, atol=0)


def test_tpcp_refuses_cp_fastest_order(world):
    """Groups whose TP x CP order is not TP fastest: ``ValueError`` naming the order, on the ranks it misplaces."""
    for r in (1, 2):
        assert "TP fastest" in world[r]["swapped"], world[r]["swapped"]
    for r in (0, 3):
        assert world[r]["swapped"] == ""


@pytest.mark.parametrize("kind", list(ADAPTER_KINDS))
def test_megatron_adapter_tp2xcp2_equals_one_process(world, kind):
    """The megatron adapter in megatron's TP=2 x CP=2 state (megatron's order puts rank ``r`` at CP ``r // 2``, TP
    ``r % 2``) equals the core layer on the whole pack: outputs, input gradients, every parameter gradient
    (gathered as above), and the logged indexer loss (the tracker sums the four partials over ``pg_collection.tp_cp``
    before the DP mean)."""
    ref = adapter_reference(ADAPTER_KINDS[kind])
    ranks = [world[r]["adapter"][kind] for r in range(TP * CP)]
    assert [r["ranks"] for r in ranks] == [(r, r // TP, r % TP) for r in range(TP * CP)]
    got = {"y": torch.cat([r["y"] for r in ranks]), "x.grad": torch.cat([r["xg"] for r in ranks])}
    exp = {"y": ref["y"], "x.grad": ref["xg"]}
    assert set(ranks[0]["grads"]) == set(ref["grads"])
    for n, g_ref in ref["grads"].items():
        by_tp = [sum(ranks[c * TP + t]["grads"][n] for c in range(CP)) for t in range(TP)]
        per_tp_sum = sum(by_tp) if n not in HEAD_SPLIT else torch.cat(by_tp, HEAD_SPLIT[n])
        got[n + ".grad"], exp[n + ".grad"] = per_tp_sum, g_ref
    if ref["loss"] is not None:
        assert all(r["sums_over_tp_cp"] for r in ranks)
        got["logged indexer loss"] = sum(r["logged"] for r in ranks)
        exp["logged indexer loss"] = ref["loss"]
    else:
        assert all(r["logged"] is None for r in ranks)
    for key, out in got.items():
        assert_close_to_ref(f"adapter {kind} TP2xCP2: {key}", out, exp[key], None)
