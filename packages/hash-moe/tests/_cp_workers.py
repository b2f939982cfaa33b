"""gloo workers of ``test_cp_parity`` (module-level: ``run_distributed`` pickles them by module name)."""

import torch
from _moe_setup import HIDDEN, VOCAB, build_layer

T, CP = 12, 2
CU = torch.tensor([0, 5, 5, 12])  # document 1 is empty; document 2 crosses the rank boundary at row 6


def _inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, 1, HIDDEN, generator=g, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    pad = torch.zeros(1, T, dtype=torch.bool)
    pad[0, -1] = True  # static-shape tail row
    grad = torch.randn(T, 1, HIDDEN, generator=g, dtype=torch.float64)
    return x, ids, pad, grad


def _run(hash_routing, rows, cu):
    layer, _ = build_layer(hash_routing, balance=0.1)
    layer.train()
    x, ids, pad, grad = _inputs()
    x = x[rows].clone().requires_grad_()
    out, _ = layer(x, padding_mask=pad[:, rows], input_ids=ids[:, rows], cu_seqlens=cu)
    (out * grad[rows]).sum().backward()
    return {
        "out": out.detach(),
        "dx": x.grad,
        "dgate": layer.router.weight.grad.clone(),
        "balance": getattr(layer.router, "last_balance_loss", torch.zeros(())).clone(),
        "loads": getattr(layer.router, "local_tokens_per_expert", torch.zeros(1)).clone(),
    }


def _cp_worker(rank, world_size):
    from dsv4_testkit import megatron_cpu_context

    out = {}
    with megatron_cpu_context(cp=1):  # the reference: the whole pack on every rank
        for hash_routing in (False, True):
            out["ref", hash_routing] = _run(hash_routing, slice(0, T), CU)
    local = T // CP
    rows = slice(rank * local, (rank + 1) * local)
    cu_local = (CU - rank * local).clamp(0, local)  # hybrid_model.mtp.router_cu_seqlens under CP
    with megatron_cpu_context(cp=CP):
        for hash_routing in (False, True):
            out["cp", hash_routing] = _run(hash_routing, rows, cu_local)
    return out
