"""Context-parallel ``DSv4Attention`` at CP=2 and CP=4 equals CP=1 (D8), on one 4-rank gloo world for every case.

Per case (``_cp_cases.CASES``: window / HCA / CSA dense and sparse phase, sparse and dense indexer loss, packs with
documents crossing rank boundaries, documents shorter than the window, an empty document, per-document padding and
a static tail, ratio-128 groups straddling ranks, shards shorter than the halo): the gathered outputs and input
gradients, the parameter gradients summed over the CP ranks and the indexer loss summed over the CP ranks equal the
single-process run of the same global batch. Then the megatron adapter at CP=2 (x DP=2) equals CP=1.

Tolerances. fp32: CP changes only the order of fp32 sums (gradients summed over ranks, the slot order of the
indexer's top-k), each a few ulps, so the testkit's fp32 rule (``atol = 1e-5 * max(1, max|ref|)``) holds with
room (measured: ~5e-7 relative). bf16: the projections of the extended rows and the bf16 sums of the gradient
reduce-scatter round differently from CP=1, so CP=P in bf16 must be as close to the fp32 CP=1 run as the bf16
CP=1 run is (``assert_close_to_ref``: error <= 2 x CP=1's bf16 error + the bf16 atol ``1e-3 * max(1, max|ref|)``).
"""

from __future__ import annotations

import pytest
import torch
from _cp_cases import CASES, adapter_step, run_case, world_worker

from dsv4_testkit import assert_close_to_ref, megatron_cpu_context, run_distributed


@pytest.fixture(scope="module")
def world():
    """Every case at CP=2 and CP=4 and the adapter at CP=2: one spawned 4-rank world."""
    return run_distributed(world_worker, 4, timeout=1500)


def _gathered(results: list[dict], key: str) -> torch.Tensor:
    return torch.cat([r[key] for r in results])


def _check(name: str, got: dict[str, torch.Tensor], ref: dict, ref_bf16: dict | None) -> None:
    for key, out in got.items():
        same = None if ref_bf16 is None else ref_bf16[key]
        assert_close_to_ref(f"{name}: {key}", out, ref[key], same)


def _collect(results: list[dict]) -> dict[str, torch.Tensor]:
    got = {"y": _gathered(results, "y"), "x.grad": _gathered(results, "xg")}
    if results[0].get("loss") is not None:
        got["indexer loss"] = sum(r["loss"] for r in results)
    for n, g in results[0]["grads"].items():
        if g is None:
            assert all(r["grads"][n] is None for r in results), n
            continue
        got[n + ".grad"] = sum(r["grads"][n] for r in results)
    return got


def _expected(res: dict) -> dict[str, torch.Tensor]:
    out = {"y": res["y"], "x.grad": res["xg"]}
    if res.get("loss") is not None:
        out["indexer loss"] = res["loss"]
    out.update({n + ".grad": g for n, g in res["grads"].items() if g is not None})
    return out


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_cp_equals_cp1(world, name, cp):
    ref = _expected(run_case(name, "fp32"))
    bf16 = CASES[name].get("dtype") == "bf16"
    ref_bf16 = _expected(run_case(name)) if bf16 else None
    got = _collect([world[r][(name, cp)] for r in range(cp)])
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    if CASES[name]["kind"] == "CSA":  # the indexer is trained: its parameters get gradients on every rank
        for r in range(cp):
            gr = world[r][(name, cp)]["grads"]
            assert all(gr[n] is not None for n in gr if ".indexer." in n), name
    _check(f"{name} CP={cp}", got, ref, ref_bf16)


def test_halo_exchange_forward_backward(world):
    """Rows ``[max(ls - d, 0), le)`` on every rank (also multi-hop, ``L < d``); each row's gradient = the sum of
    its cotangents over every rank that holds it (its owner and the ranks whose halo contains it)."""
    from _cp_cases import HALO_SIZES

    for d in HALO_SIZES:
        grad = torch.zeros(24)
        for r in range(4):
            res = world[r]["halo"][d]
            rows = torch.arange(res["start"], res["stop"], dtype=torch.float32)
            torch.testing.assert_close(res["ext"], rows[:, None].repeat(1, 2), rtol=0, atol=0)
            assert res["stop"] - res["start"] == 6 + min(d, 6 * r)
            grad[res["start"] : res["stop"]] += rows + 1
        got = torch.cat([world[r]["halo"][d]["xg"] for r in range(4)])
        torch.testing.assert_close(got, grad[:, None].repeat(1, 2), rtol=0, atol=0)


def test_megatron_adapter_cp2_equals_cp1(world):
    with megatron_cpu_context():
        ref = adapter_step(1)
    ranks = [world[r]["adapter"] for r in range(2)]  # CP group {0, 1} of the CP=2 x DP=2 state
    got = {"y": _gathered(ranks, "y"), "x.grad": _gathered(ranks, "xg")}
    got.update({n: sum(r["grads"][n] for r in ranks) for n in ref["grads"]})
    got["logged indexer loss"] = sum(r["logged"] for r in ranks)  # the tracker sums the CP partials
    assert ref["sums_over_cp"] and all(r["sums_over_cp"] for r in ranks)
    exp = {"y": ref["y"], "x.grad": ref["xg"], **ref["grads"], "logged indexer loss": ref["logged"]}
    assert set(ranks[0]["grads"]) == set(ref["grads"])
    _check("adapter CP=2", got, exp, None)
