"""Load balancing (§7.5): the aux-loss-free selection-bias update and the sequence-wise balance loss.

Selection bias (DeepSeek-V3 scheme, learned-routing layers only), applied **after** the optimizer step:

```
load_e  = Σ over data-parallel ranks of the tokens routed to expert e since the last update   (valid tokens)
bias_e += γ · sign(mean_e' load_e' − load_e)                                          γ = 0.001 (report)
```

Sequence-wise balance loss (V3 definition), per sequence of ``T`` valid tokens, averaged over the sequences:

```
L_bal = α Σ_e f_e P_e,   f_e = E/(K·T) Σ_t 1[e ∈ idx_t],   P_e = (1/T) Σ_t s'_{e,t},   s'_{e,t} = s_{e,t} / Σ_e' s_{e',t}
```

Shape legend: ``N`` tokens, ``E`` experts, ``K`` experts per token, ``D`` sequences.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4_primitives.cp_partial_loss import partial_loss
from dsv4_primitives.varlen import document_ids


def tokens_per_expert(
    experts: torch.Tensor, num_experts: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``[E]`` fp32 count of (valid token, chosen expert) pairs per expert; padding tokens are not counted.

    A scatter-add of ones (zeros on padding rows), not ``bincount`` / boolean indexing: both read values back to
    the host on CUDA (a device synchronisation per routed layer).
    """
    ones = torch.ones(experts.shape, dtype=torch.float32, device=experts.device)  # [N, K]
    if valid is not None:
        ones = ones * valid.reshape(-1, *([1] * (experts.dim() - 1))).to(torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=experts.device)
    return counts.scatter_add_(0, experts.reshape(-1).long(), ones.reshape(-1))


@torch.no_grad()
def update_selection_bias_(
    bias: torch.Tensor,
    tokens: torch.Tensor,
    speed: float,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """In place ``bias += speed · sign(mean(load) − load)`` with ``load`` summed over ``group``.

    Args:
        bias: ``[..., E]`` fp32 selection biases (several routers may be stacked on the leading dims).
        tokens: ``[..., E]`` local token counts per expert (not modified).
        speed: update speed ``γ`` (> 0).
        group: the process group whose ranks saw different tokens for the same router (megatron: the
            tensor x data x context parallel group); ``None`` = no reduction (single process).

    Returns:
        The globally reduced load ``[..., E]``.
    """
    if not speed > 0:
        raise ValueError(f"bias update speed must be > 0, got {speed}")
    if bias.shape != tokens.shape:
        raise ValueError(
            f"bias {tuple(bias.shape)} and token counts {tuple(tokens.shape)} must have the same shape"
        )
    load = tokens.detach().float().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(load, op=dist.ReduceOp.SUM, group=group)
    offset = load.mean(dim=-1, keepdim=True) - load
    bias.add_(torch.sign(offset).to(bias.dtype), alpha=speed)
    return load


def sequence_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[N]`` int64 index of the packed sequence (document) that holds each token of a THD pack.

    Validates ``cu_seqlens`` against ``num_tokens`` (one device -> host read), then
    :func:`dsv4_primitives.varlen.document_ids`. While a CUDA graph is being captured the values are not read
    back (illegal there): static-shape packs are validated on the host before they are copied in.
    """
    cu = cu_seqlens.long()
    if cu.is_cuda and torch.cuda.is_current_stream_capturing():
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [D + 1] with D >= 1, got shape {tuple(cu.shape)}")
        return document_ids(cu, num_tokens)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens must be 1-D, start at 0 and end at the token count {num_tokens}; got {cu.tolist()}"
        )
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    return document_ids(cu, num_tokens)


def sequence_balance_loss(
    scores: torch.Tensor,
    experts: torch.Tensor,
    *,
    coeff: float,
    sequence_ids: torch.Tensor | None = None,
    num_sequences: int = 1,
    valid: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Sequence-wise balance loss ``α · mean_seq Σ_e f_e P_e`` (differentiable through ``scores``).

    Padding tokens (``valid == False``) are ignored: they count neither in ``f``, ``P`` nor ``T``. Sequences
    without any valid token are left out of the mean.

    Args:
        scores: ``[N, E]`` fp32 unbiased scores ``s`` (from the router; normalised over all experts here).
        experts: ``[N, K]`` chosen expert ids.
        coeff: ``α`` (1e-4 in the report).
        sequence_ids: ``[N]`` int64 sequence index of each token in ``[0, D)``; ``None`` = one sequence.
        num_sequences: ``D``.
        valid: ``[N]`` bool, False marks padding tokens.
        group: ranks holding other tokens of the same sequences (sequence/context parallel); the counts and
            lengths are summed over it and each rank returns its partial loss
            (:mod:`dsv4_primitives.cp_partial_loss`: the partials add up to the full loss).
    """
    n, num_experts = scores.shape
    topk = experts.shape[1]
    if sequence_ids is None:
        sequence_ids = torch.zeros(n, dtype=torch.long, device=scores.device)
        num_sequences = 1
    if sequence_ids.shape != (n,):
        raise ValueError(f"sequence_ids must be [{n}], got {tuple(sequence_ids.shape)}")
    dt = scores.dtype
    keep = torch.ones(n, dtype=dt, device=scores.device) if valid is None else valid.to(dt)
    s_norm = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)  # [N, E]
    seq = sequence_ids.long()
    # Σ_t s'_{e,t} per sequence, valid tokens only: [D, E]
    p_sum = scores.new_zeros(num_sequences, num_experts).index_add(0, seq, s_norm * keep.unsqueeze(-1))
    with torch.no_grad():
        zeros = {"dtype": dt, "device": scores.device}
        hits = torch.zeros(n, num_experts, **zeros).scatter_(1, experts, 1.0) * keep.unsqueeze(-1)  # [N, E]
        counts = torch.zeros(num_sequences, num_experts, **zeros).index_add_(0, seq, hits)  # [D, E]
        lengths = torch.zeros(num_sequences, **zeros).index_add_(0, seq, keep)  # [D]
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
            dist.all_reduce(lengths, group=group)
        present = lengths > 0
        t = lengths.clamp_min(1.0).unsqueeze(-1)
        f = counts * (num_experts / topk) / t  # [D, E]
    per_seq = (f * p_sum / t).sum(dim=-1)  # [D]
    # under a group, this rank's partial over the global count of sequences (dsv4_primitives.cp_partial_loss)
    return partial_loss(coeff * (per_seq * present).sum(), present.sum())
