"""The context-parallel partial-loss rule: every CP rank's losses add up to the CP=1 losses. Written once, here.

Static contiguous CP (dsv4-attention ``dsv4_attention.cp``): CP rank ``r`` of ``P`` holds the rows
``[r·L, (r+1)·L)`` of one data-parallel replica's global pack of ``T = P·L`` rows. A loss that is a masked mean over
rows (the LM and MTP cross entropies over their loss masks, a CSA layer's indexer KL over its valid rows) is
computed on each rank as its PARTIAL:

    partial_r = Σ_{t in rank r} loss_t · m_t  /  max(1, Σ_{all ranks} m_t)          (m: the row mask)

Why the partials add up to the CP=1 loss: the denominator is the same global count on every rank, so
``Σ_r partial_r = Σ_t loss_t · m_t / max(1, Σ_t m_t)``, the masked mean over the whole pack, which is what CP=1
computes (bitwise at CP=1, where the local count is the global one). The global count comes from an all-reduce of
the local counts (:func:`cp_token_count`) or, where every rank holds the global layout, from that layout without
communication (the attention's indexer loss).

Gradients: megatron's schedule multiplies the losses it knows (the main loss, the MoE and attention auxiliary
losses) by ``P`` and its DDP averages the gradients over DP x CP, so the gradient of the partials, summed over the
``P`` ranks, equals the CP=1 gradient. A loss the schedule does not scale (the MTP loss) is multiplied by
:func:`partial_loss_gradient_scale` where it enters backward.

Logging: a value that is a partial is summed over the CP group (:func:`sum_partials`) before any data-parallel mean,
or it enters a world-wide (sum, count) mean with a count of ``1 / P``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def loss_denominator(global_count: torch.Tensor) -> torch.Tensor:
    """``max(1, global_count)``: the denominator of a partial (a pack with no counted row has loss 0, not NaN)."""
    return global_count.clamp(min=1)


def partial_loss(local_sum: torch.Tensor, global_count: torch.Tensor) -> torch.Tensor:
    """This rank's partial ``local_sum / max(1, global_count)`` (module docstring); at CP=1 ``global_count`` is the
    local count and the partial is the masked mean. Differentiable through ``local_sum``."""
    return local_sum / loss_denominator(global_count)


def cp_token_count(mask: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``Σ mask`` (fp32 scalar, no gradient) over this rank's rows, summed over ``cp_group`` when given (``None``:
    CP=1): the global count of a partial."""
    num = mask.detach().float().sum()
    if cp_group is not None:
        dist.all_reduce(num, group=cp_group)
    return num


def cp_partial_mean(
    per_token: torch.Tensor, mask: torch.Tensor, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``Σ per_token·mask / max(1, Σ_CP mask)``: the masked mean at CP=1, this rank's partial under CP (the CP
    ranks' partials add up to the masked mean over the whole pack). Differentiable through ``per_token``."""
    count = cp_token_count(mask, cp_group)
    return partial_loss((per_token.float() * mask.float()).sum(), count)


def sum_partials(values: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The replica's value of partial losses ``values`` (any shape, e.g. one per layer): their sum over
    ``cp_group`` (a detached copy); ``values`` itself when ``cp_group`` is ``None`` (CP=1)."""
    if cp_group is None:
        return values
    total = values.detach().clone()
    dist.all_reduce(total, group=cp_group)
    return total


def partial_loss_gradient_scale(cp_group: dist.ProcessGroup | None) -> int:
    """``P`` (1 without a group): the factor a partial loss needs before backward when megatron's schedule does not
    apply it (DDP averages over DP x CP; module docstring)."""
    return 1 if cp_group is None else cp_group.size()


__all__ = [
    "cp_partial_mean",
    "cp_token_count",
    "loss_denominator",
    "partial_loss",
    "partial_loss_gradient_scale",
    "sum_partials",
]
