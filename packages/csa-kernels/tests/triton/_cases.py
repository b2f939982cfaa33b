"""Case builders shared by the Triton tests: varlen documents, window + compressed indices with -1 slots."""

from __future__ import annotations

import torch

from dsv4_primitives.varlen import SeqBoundaries


def cu_from_lengths(lengths: list[int], device="cpu") -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(device)


def attention_case_indices(
    lengths: list[int], ratio: int, window: int, topk: int, gen: torch.Generator, duplicates: bool = True
) -> tuple[torch.Tensor, int, int]:
    """Indices [T, window + topk] into ``kv_all = cat(kv [T], entries [Tc])`` and (T, Tc).

    Window rows ``t-W+1..t`` clipped at the document start (-1 beyond); compressed part: a random subset of the
    visible entries (``w < floor((t_rel+1)/ratio)``) of the token's own document, -1 padded at random slots, and
    (``duplicates``) one repeated valid index per row where possible.
    """
    T = sum(lengths)
    Tc = sum(n // ratio for n in lengths)
    rows = []
    start, cstart = 0, 0
    for n in lengths:
        for tr in range(n):
            t = start + tr
            win = [t - window + 1 + i if t - window + 1 + i >= start else -1 for i in range(window)]
            vis = (tr + 1) // ratio
            perm = torch.randperm(vis, generator=gen)[: min(topk, vis)]
            comp = [T + cstart + int(w) for w in perm]
            if duplicates and comp and len(comp) < topk:
                comp.append(comp[0])
            comp = comp + [-1] * (topk - len(comp))
            order = torch.randperm(topk, generator=gen).tolist()
            comp = [comp[i] for i in order]
            rows.append(win + comp)
        start += n
        cstart += n // ratio
    return torch.tensor(rows, dtype=torch.int32).reshape(T, window + topk), T, Tc


def sparse_attn_oracle(q, kv, sink, indices, scale):
    """Plain PyTorch gather -> softmax-with-sink -> weighted sum in the inputs' own dtype (tolerance yardstick)."""
    valid = indices >= 0  # [T, K]
    g = kv[indices.clamp(min=0).long()]  # [T, K, D]
    z = torch.einsum("thd,tkd->thk", q, g) * scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    s = sink.to(z.dtype)[None, :, None].expand(z.shape[0], -1, 1)
    zz = torch.cat([z, s], dim=-1)
    lse = torch.logsumexp(zz, dim=-1)  # [T, H]
    p = torch.exp(z - lse[..., None])
    o = torch.einsum("thk,tkd->thd", p.to(g.dtype), g)
    return o, lse


def bounds_from_lengths(lengths: list[int], device="cpu") -> SeqBoundaries:
    """The ops' boundaries object of documents of ``lengths`` (host copy included: no device sync)."""
    return SeqBoundaries.from_lengths(lengths, device)


def bounds_of(cu: torch.Tensor) -> SeqBoundaries:
    """The ops' boundaries object of a ``cu_seqlens`` tensor (its host copy read back once)."""
    return SeqBoundaries.from_tensor(cu)
