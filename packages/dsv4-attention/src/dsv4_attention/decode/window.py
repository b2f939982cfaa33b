"""``WindowCache``: the sliding-window branch's keys of every sequence, a ring of the last ``n_win`` KV rows.

Every layer kind attends its last ``n_win`` raw tokens (spec §2.2, oracle M3: query ``p`` sees positions
``[p - n_win + 1, p]``), so a decode cache keeps the rotated shared K = V rows (``kv = RoPE(kv_norm(x @ wkv^T))``,
``[c]`` each) of the last ``W = n_win`` positions of each sequence::

    ring[b, p % W] = kv row of sequence b at position p,   for the last W positions p < lengths[b]

A call's window keys are ``cat(ring.view(B*W, c), kv_new [R, c])``. For a new row at position ``p`` of sequence
``b``, window slot ``j`` holds position ``s = p - W + 1 + j`` (the slot order of ``csa_kernels.window_indices``:
the query itself last, the ``-1`` slots first), at::

    s < 0            -> -1                                   (before the sequence start)
    s >= lengths[b]  -> B*W + row_starts[b] + s - lengths[b]  (a new row of this call)
    otherwise        -> b*W + s % W                           (the ring: s >= lengths[b] - W + 1 always)

Speculative decoding drops a call's newest rows again (:meth:`WindowCache.rollback`): the slots the call wrote get
their values from before the call back (:meth:`WindowCache.overwritten`, read before :meth:`WindowCache.append`),
then the kept rows are appended again, so the ring is exactly the one of a call that appended only the kept rows.
"""

from __future__ import annotations

import torch

from dsv4_attention.decode.plan import ExtendPlan


class WindowCache:
    """Ring buffer ``kv [B, W, c]`` (zeros until written).

    Args:
        batch, window, head_dim: ``B``, ``W = n_win``, ``c``.
        device, dtype: of the ring (the layer's activation dtype).
    """

    def __init__(self, batch: int, window: int, head_dim: int, *, device=None, dtype=torch.float32) -> None:
        if batch < 1 or window < 1 or head_dim < 1:
            raise ValueError(
                f"WindowCache needs batch, window, head_dim >= 1, got {batch}, {window}, {head_dim}"
            )
        self.window = window
        self.kv = torch.zeros(batch, window, head_dim, device=device, dtype=dtype)  # [B, W, c]

    def indices(self, plan: ExtendPlan, positions: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """int32 ``[R, W]`` rows of ``cat(ring [B*W], kv_new [R])`` (module docstring); ``positions`` /
        ``sequences``: the plan's rows (:meth:`ExtendPlan.row_positions` / :meth:`ExtendPlan.row_sequences`)."""
        dev = positions.device
        w = self.window
        lengths = plan.row_lengths(dev)  # [R]
        s = positions[:, None] + torch.arange(1 - w, 1, device=dev)[None, :]  # [R, W] key positions
        rows = torch.arange(positions.shape[0], device=dev)[:, None]  # [R, 1]
        new = plan.batch * w + rows + s - positions[:, None]  # a row of this call (row r holds position p)
        ring = sequences[:, None] * w + s.remainder(w)  # a ring slot
        idx = torch.where(s >= lengths[:, None], new, ring)
        return torch.where(s >= 0, idx, -1).to(torch.int32)

    def append(
        self, kv_new: torch.Tensor, plan: ExtendPlan, positions: torch.Tensor, sequences: torch.Tensor
    ) -> None:
        """Write the call's rows ``kv_new [R, c]`` into the ring (the last ``W`` of each sequence)."""
        keep = plan.ring_rows(self.window, positions.device)  # [N]: one row per ring slot at most
        self.write(kv_new[keep], positions[keep], sequences[keep])

    def write(self, kv: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor) -> None:
        """Write rows ``kv [N, c]`` at ``positions [N]`` of ``sequences [N]`` (at most one row per ring slot)."""
        self.kv[sequences, positions.remainder(self.window)] = kv.to(self.kv.dtype)

    def overwritten(self, positions: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """``[R, c]``: what the ring slots of the call's rows hold now (a copy; read it before :meth:`append`)."""
        return self.kv[sequences, positions.remainder(self.window)]

    def rollback(
        self,
        plan: ExtendPlan,
        positions: torch.Tensor,
        sequences: torch.Tensor,
        before: torch.Tensor,
        kv_new: torch.Tensor,
        kept: tuple[int, ...],
    ) -> None:
        """Undo :meth:`append` of ``plan``'s rows ``kv_new [R, c]`` (``before``: :meth:`overwritten` of them)
        but for the first ``kept[b]`` new rows of each sequence b: the ring then equals the ring of a call that
        appended only those rows. (Rows sharing a slot all hold its value from before the call.)"""
        self.kv[sequences, positions.remainder(self.window)] = before
        if sum(kept):
            # the first kept[b] rows of each sequence b, planned on the host
            rows = [r0 + i for r0, k in zip(plan.row_starts, kept) for i in range(k)]
            keep = torch.tensor(rows, dtype=torch.int64, device=positions.device)  # [N]
            self.append(kv_new[keep], ExtendPlan(plan.lengths, kept), positions[keep], sequences[keep])

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
