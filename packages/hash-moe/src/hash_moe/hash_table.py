"""Builders of the hash-routing table ``tid2eid`` (§7.4): ``[V, K]`` distinct expert ids per token id.

The hash function of DeepSeek-V4 is unpublished (the released checkpoints ship the table). For training from
scratch we offer (**[OUR CHOICE]**, spec §7.4):

- :func:`build_tid2eid_balanced`: greedy balancing of the *expected* load from corpus token frequencies. Token ids
  are visited in decreasing frequency (ties: a seeded permutation); each takes the ``K`` experts with the least
  expected load so far (ties: fewer token ids assigned, then a seeded expert order), and adds its frequency to them.
  Zero-frequency ids (unseen in the corpus) add no load; they are spread evenly over the experts by count.
- :func:`build_tid2eid_round_robin`: ``tid2eid[t, j] = (t·K + j) mod E`` (balanced in token-id count only).
- :func:`load_tid2eid`: from a checkpoint (a state dict, a tensor, or a ``torch.save`` file).

Every table is validated by :func:`validate_tid2eid` and returned as int32 (checkpoints store int64; both load).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Mapping

import torch


def validate_tid2eid(
    tid2eid: torch.Tensor, *, num_experts: int, topk: int, vocab_size: int | None = None
) -> None:
    """Raise ValueError unless ``tid2eid`` is an integer ``[V, K]`` table of distinct ids in ``[0, E)``."""
    if tid2eid.dtype.is_floating_point or tid2eid.dtype == torch.bool or tid2eid.dim() != 2:
        raise ValueError(
            f"tid2eid must be a 2-D integer tensor [vocab, topk], got {tid2eid.dtype} {tuple(tid2eid.shape)}"
        )
    if tid2eid.shape[1] != topk:
        raise ValueError(f"tid2eid has {tid2eid.shape[1]} experts per token, the router uses topk={topk}")
    if vocab_size is not None and tid2eid.shape[0] != vocab_size:
        raise ValueError(f"tid2eid covers {tid2eid.shape[0]} token ids, expected vocab_size={vocab_size}")
    if tid2eid.numel() == 0:
        return
    lo, hi = int(tid2eid.min()), int(tid2eid.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(
            f"tid2eid expert ids must lie in [0, num_experts={num_experts}), got range [{lo}, {hi}]"
        )
    srt = tid2eid.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
    if bool(dup.any()):
        row = int(dup.nonzero()[0, 0])
        raise ValueError(
            f"tid2eid row {row} repeats an expert: {tid2eid[row].tolist()} (ids must be distinct)"
        )


def _check_sizes(vocab_size: int, num_experts: int, topk: int) -> None:
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")


def build_tid2eid_round_robin(vocab_size: int, num_experts: int, topk: int) -> torch.Tensor:
    """``[V, K]`` int32 table ``(t·K + j) mod E``: K consecutive (hence distinct) experts per token id."""
    _check_sizes(vocab_size, num_experts, topk)
    t = torch.arange(vocab_size, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(topk, dtype=torch.int64).unsqueeze(0)
    return ((t * topk + j) % num_experts).to(torch.int32)


def build_tid2eid_balanced(
    token_counts: torch.Tensor, num_experts: int, topk: int, *, seed: int = 0
) -> torch.Tensor:
    """``[V, K]`` int32 table balancing the expected per-expert load from corpus token frequencies.

    Args:
        token_counts: ``[V]`` non-negative occurrence counts (or frequencies) of each token id in the corpus.
        num_experts: ``E``.
        topk: ``K`` (distinct experts per token id).
        seed: fixes the tie-breaking order; the same counts and seed always give the same table.
    """
    counts = torch.as_tensor(token_counts).detach().cpu()
    if counts.dim() != 1 or counts.dtype == torch.bool or counts.is_complex():
        raise ValueError(
            f"token_counts must be a 1-D real tensor [vocab], got {counts.dtype} {tuple(counts.shape)}"
        )
    counts = counts.double()
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError("token_counts must be finite and non-negative")
    vocab_size = counts.shape[0]
    _check_sizes(vocab_size, num_experts, topk)
    gen = torch.Generator().manual_seed(seed)
    token_tiebreak = torch.randperm(vocab_size, generator=gen)
    expert_tiebreak = torch.randperm(num_experts, generator=gen).tolist()
    # decreasing count, seeded order among equal counts (two stable sorts)
    order = token_tiebreak[torch.sort(counts[token_tiebreak], descending=True, stable=True).indices].tolist()
    weights = counts.tolist()
    rows: list[list[int]] = [[]] * vocab_size
    # heap of (expected load, token ids assigned, tie-break, expert): the K smallest are the K least loaded
    heap = [(0.0, 0, expert_tiebreak[e], e) for e in range(num_experts)]
    heapq.heapify(heap)
    # ids never seen in the corpus add no load: spread them evenly by count instead (second heap)
    unseen = [(0, expert_tiebreak[e], e) for e in range(num_experts)]
    heapq.heapify(unseen)
    for tok in order:
        w = weights[tok]
        if w > 0:
            picked = [heapq.heappop(heap) for _ in range(topk)]
            rows[tok] = [p[3] for p in picked]
            for load, n, tie, e in picked:
                heapq.heappush(heap, (load + w, n + 1, tie, e))
        else:
            picked = [heapq.heappop(unseen) for _ in range(topk)]
            rows[tok] = [p[2] for p in picked]
            for n, tie, e in picked:
                heapq.heappush(unseen, (n + 1, tie, e))
    return torch.tensor(rows, dtype=torch.int32).reshape(vocab_size, topk)


def load_tid2eid(
    source: str | os.PathLike | Mapping[str, torch.Tensor] | torch.Tensor,
    *,
    num_experts: int,
    topk: int,
    vocab_size: int | None = None,
    key: str | None = None,
) -> torch.Tensor:
    """Read a ``tid2eid`` table from a checkpoint; returns a validated ``[V, K]`` int32 tensor.

    Args:
        source: the table itself, a state dict, or a path to a ``torch.save`` file of either.
        num_experts, topk, vocab_size: expected sizes (``vocab_size=None`` accepts any).
        key: the state-dict key, e.g. ``"layers.0.ffn.gate.tid2eid"``; may be omitted when exactly one key ends
            with ``"tid2eid"``.
    """
    obj = source
    if isinstance(source, (str, os.PathLike)):
        obj = torch.load(os.fspath(source), map_location="cpu", weights_only=True)
    if isinstance(obj, Mapping):
        if key is None:
            keys = [k for k in obj if str(k).endswith("tid2eid")]
            if len(keys) != 1:
                raise ValueError(f"pass key=...: found {len(keys)} keys ending with 'tid2eid' ({keys[:5]})")
            key = keys[0]
        if key not in obj:
            raise ValueError(
                f"key {key!r} not in the checkpoint (keys ending with tid2eid: "
                f"{[k for k in obj if str(k).endswith('tid2eid')][:5]})"
            )
        obj = obj[key]
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"expected a tensor for tid2eid, got {type(obj).__name__}")
    validate_tid2eid(obj, num_experts=num_experts, topk=topk, vocab_size=vocab_size)
    return obj.to(device="cpu", dtype=torch.int32).contiguous()
