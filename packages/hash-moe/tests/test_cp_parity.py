"""Context parallelism (static contiguous CP=2, gloo) of the DSv4 MoE layer equals CP=1: each rank holds its rows
of one THD pack (documents crossing the rank boundary, an empty document, a padding row) with the global documents
clipped to its rows; hash routing reads the local token ids, the sequence-wise balance loss sums its per-document
counts over the CP group (each rank's partial adds up to the CP=1 loss), gradients add up to CP=1's."""

import pytest
import torch
from _cp_workers import CP, T, _cp_worker


@pytest.mark.distributed
def test_cp2_moe_layer_equals_cp1(megatron_cpu):
    from dsv4_testkit import run_distributed

    results = run_distributed(_cp_worker, CP, timeout=600)
    local = T // CP
    for hash_routing in (False, True):
        ref = results[0]["ref", hash_routing]
        parts = [r["cp", hash_routing] for r in results]
        for key in ("out", "dx"):  # per-token values: the concatenated CP slices
            got = torch.cat([p[key] for p in parts])
            torch.testing.assert_close(got, ref[key], rtol=1e-10, atol=1e-12)
            assert got.shape[0] == CP * local
        # gate gradient (the balance loss's included) and the balance loss: the CP partials add up to CP=1's
        torch.testing.assert_close(sum(p["dgate"] for p in parts), ref["dgate"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(sum(p["balance"] for p in parts), ref["balance"], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(sum(p["loads"] for p in parts), ref["loads"])
        if not hash_routing:
            assert float(ref["balance"]) > 0 and all(float(p["balance"]) > 0 for p in parts)
