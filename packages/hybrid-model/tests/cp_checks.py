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
