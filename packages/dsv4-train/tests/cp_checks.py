"""gloo workers of ``test_context_parallel`` (module-level: ``run_distributed`` pickles them by module name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

T, CP = 16, 2
# padded documents [0, 5) (4 real + 1 pad), [5, 5) empty, [5, 13) crossing the rank boundary at 8; tail [13, 16)
CU = torch.tensor([0, 4, 4, 12], dtype=torch.int32)
CU_PADDED = torch.tensor([0, 5, 5, 13], dtype=torch.int32)


def _psp():
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=CU,
        cu_seqlens_kv=CU,
        cu_seqlens_q_padded=CU_PADDED,
        cu_seqlens_kv_padded=CU_PADDED,
        max_seqlen_q=8,
        max_seqlen_kv=8,
    )


def mtp_and_loss_worker(rank: int, world: int) -> dict:
    """CP=1 and CP=2 results of the MTP rolls, the router intervals and the loss partials on one rank."""
    from hybrid_model.context_parallel import cp_partial_mean, cp_token_count
    from hybrid_model.mtp import mtp_roll_left, router_cu_seqlens

    group = dist.new_group(list(range(world)))
    local = T // CP
    rows = slice(rank * local, (rank + 1) * local)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 100, (1, T), generator=g)
    mask = (torch.rand(1, T, generator=g) > 0.3).float()
    x = torch.randn(1, T, generator=g, dtype=torch.float64)
    w = torch.randn(1, T, generator=g, dtype=torch.float64)
    psp = _psp()
    out: dict = {}
    # the rolls: ids (twice: t+2), mask; a float tensor with its gradient
    out["ids"] = mtp_roll_left(mtp_roll_left(ids[:, rows], psp, group), psp, group)
    out["ids_ref"] = mtp_roll_left(mtp_roll_left(ids, psp), psp)[:, rows]
    out["mask"] = mtp_roll_left(mask[:, rows], psp, group)
    out["mask_ref"] = mtp_roll_left(mask, psp)[:, rows]
    xl = x[:, rows].clone().requires_grad_()
    (mtp_roll_left(xl, psp, group) * w[:, rows]).sum().backward()
    xr = x.clone().requires_grad_()
    (mtp_roll_left(xr, psp) * w).sum().backward()
    out["dx"], out["dx_ref"] = xl.grad, xr.grad[:, rows]
    # router intervals: this rank's rows of every global document (document ids agree with CP=1's)
    cu_local = router_cu_seqlens(psp, local, group)
    cu_full = router_cu_seqlens(psp, T)
    from dsv4_primitives.varlen import document_ids

    out["doc_ids"] = document_ids(cu_local.long(), local)
    out["doc_ids_ref"] = document_ids(cu_full.long(), T)[rows]
    out["num_docs"] = (cu_local.numel(), cu_full.numel())
    # loss partials: sum over CP = the CP=1 masked mean; the token count is the global one
    per_token = x.float()
    out["partial"] = float(cp_partial_mean(per_token[:, rows], mask[:, rows], group))
    out["full"] = float(cp_partial_mean(per_token, mask, None))
    out["count"] = float(cp_token_count(mask[:, rows], group))
    out["count_ref"] = float(mask.sum())
    return out


MEM_T = 512  # one document of 512 tokens: at CP=2 it crosses the rank boundary (rank 1 gets every halo)


def saved_bytes(cp_rank: int, cp_size: int) -> dict[str, int]:
    """Bytes of the distinct activation storages the tiny model saves for backward in one sparse-phase forward of
    this CP rank's rows (parameters excluded): ``attn`` inside the DSv4 attention layers, ``total`` all."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from dsv4_attention.megatron import DSv4HybridAttention
    from hybrid_model.model import build_model
    from hybrid_model.presets import get_preset

    cfg = get_preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (1, MEM_T), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, MEM_T], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=MEM_T, max_seqlen_kv=MEM_T
    )
    torch.manual_seed(0)
    model = build_model(cfg).train()
    model.set_step_state(dense_attention=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    depth = [0]  # > 0 inside an attention layer's forward
    for m in model.modules():
        if isinstance(m, DSv4HybridAttention):
            m.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
            m.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
    saved: dict[int, tuple[int, bool]] = {}
    # every packed tensor stays referenced until the count is taken, so a storage freed inside the forward (a
    # discarded branch) cannot hand its address to a later one and hide it (the count then depended on the
    # allocator: 8 bytes apart between two processes on the CI box)
    alive: list[torch.Tensor] = []

    def pack(t):
        alive.append(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in saved:
            saved[ptr] = (t.untyped_storage().nbytes(), depth[0] > 0)
        return t

    local = MEM_T // cp_size
    rows = slice(cp_rank * local, (cp_rank + 1) * local)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids[:, rows], None, None, labels=torch.roll(ids, -1, 1)[:, rows], packed_seq_params=psp)
    return {"total": sum(n for n, _ in saved.values()), "attn": sum(n for n, a in saved.values() if a)}


def memory_worker(rank: int, world: int) -> dict:
    """The saved bytes at CP=1 (every rank runs the whole pack) and on this rank at CP=``world``."""
    from dsv4_testkit import megatron_cpu_context

    with megatron_cpu_context(cp=1):
        one = saved_bytes(0, 1)
    with megatron_cpu_context(cp=world):
        mine = saved_bytes(rank, world)
    return {"cp1": one, "cp": mine}


def cp2_worker(rank: int, world: int) -> dict:
    """One 2-rank world for the rolls / loss partials and the memory count."""
    return {**mtp_and_loss_worker(rank, world), "memory": memory_worker(rank, world)}
