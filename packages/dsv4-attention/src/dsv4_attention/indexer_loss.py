"""Indexer-loss scheduling: the auto-scaler that attaches the loss to the activations, and the per-layer tracker.

The lightning indexer is trained only by its KL loss (spec §5; inputs detached, oracle I3). The loss is not added
to the returned LM loss; instead :class:`IndexerLossAutoScaler` attaches it to the attention output (identity in
forward) and injects ``d(loss) = scale`` in backward, like megatron's MoE aux loss. megatron-core's pipeline
schedule sets ``scale`` every micro-batch through ``config.experimental_attention_variant_loss_scale_func``
(which :class:`~dsv4_attention.megatron.config.DSv4AttentionConfig` points at :meth:`IndexerLossAutoScaler.set_loss_scale`):

    scale = grad_scale_func(1)                                  if calculate_per_token_loss
    scale = grad_scale_func(1) * cp_size / num_microbatches     otherwise   (gradient accumulation)

(under context parallelism the loss of a rank is its partial and ``cp_size`` its gradient scale:
:mod:`dsv4_primitives.cp_partial_loss`).

:class:`IndexerLossTracker` records the (unscaled, detached) loss per layer. Main layer ``n`` (1-based) uses slot
``n - 1``; MTP layer ``n`` uses slot ``num_layers + n - 1`` (MTP layers get their own slots). For logging,
:meth:`IndexerLossTracker.reduce` sums across the pipeline group (ranks without an indexer take part with zeros,
after negotiating a common tracker length), sums the CP partials over the optional ``reduce_group``, applies the
optional ``avg_group`` and averages over the data-parallel group, all taken from the explicit
``ProcessGroupCollection``; :meth:`IndexerLossTracker.track_metrics` then logs ``"indexer loss"`` = mean over the ratio-4 (CSA) layers.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from dsv4_primitives.cp_partial_loss import sum_partials


class IndexerLossAutoScaler(torch.autograd.Function):
    """``forward(output, loss) = output``; ``backward`` returns ``(grad_output, ones_like(loss) * scale)``."""

    main_loss_backward_scale: ClassVar[torch.Tensor | None] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, indexer_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indexer_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indexer_loss,) = ctx.saved_tensors
        scale = IndexerLossAutoScaler.main_loss_backward_scale
        if scale is None:
            return grad_output, torch.ones_like(indexer_loss)
        if not (scale.device.type == "cpu" and scale.dim() == 0):  # a CPU scalar multiplies without a copy
            scale = scale.to(device=indexer_loss.device)
        return grad_output, (torch.ones_like(indexer_loss) * scale).to(indexer_loss.dtype)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor | float) -> None:
        """Set the backward scale of every attached indexer loss (called by megatron's schedule per micro-batch)."""
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(scale))
        cur = IndexerLossAutoScaler.main_loss_backward_scale
        if cur is None or cur.shape != scale.shape or cur.device != scale.device:
            IndexerLossAutoScaler.main_loss_backward_scale = scale.detach().clone()
        else:
            cur.copy_(scale.detach())

    @staticmethod
    def reset() -> None:
        """Forget the scale (next backward uses 1)."""
        IndexerLossAutoScaler.main_loss_backward_scale = None


def attach_indexer_loss(output: torch.Tensor, indexer_loss: torch.Tensor) -> torch.Tensor:
    """Attach ``indexer_loss`` (a scalar with grad) to ``output``: identity forward, scaled loss grad in backward."""
    return IndexerLossAutoScaler.apply(output, indexer_loss)


def indexer_loss_tracker_slot(layer_number: int, num_layers: int, is_mtp_layer: bool) -> int:
    """0-based tracker slot of a 1-based layer: ``n - 1`` (main) or ``num_layers + n - 1`` (MTP)."""
    if layer_number < 1:
        raise ValueError(f"layer_number is 1-based, got {layer_number}")
    return (num_layers if is_mtp_layer else 0) + layer_number - 1


class IndexerLossTracker:
    """Per-layer indexer-loss accumulator for logging (one process-wide instance: :func:`get_indexer_loss_tracker`).

    ``values[slot]`` accumulates detached per-micro-batch losses; the tensor grows on demand, so MTP slots past the
    configured length are never dropped.
    """

    def __init__(self) -> None:
        self.values: torch.Tensor | None = None
        self.reduce_group: dist.ProcessGroup | None = None
        self.avg_group: dist.ProcessGroup | None = None
        self._pp_size_cache: dict[tuple[int, int], int] = {}

    def save(
        self,
        loss: torch.Tensor,
        slot: int,
        num_slots: int,
        *,
        reduce_group: dist.ProcessGroup | None = None,
        avg_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Add ``loss`` (detached) to ``values[slot]``; ``num_slots`` is the expected tracker length."""
        if slot < 0:
            raise ValueError(f"tracker slot must be >= 0, got {slot}")
        size = max(num_slots, slot + 1)
        if self.values is None:
            self.values = torch.zeros(size, device=loss.device, dtype=torch.float32)
        elif self.values.numel() < size:
            grown = torch.zeros(size, device=self.values.device, dtype=torch.float32)
            grown[: self.values.numel()] = self.values
            self.values = grown
        self.values[slot] += loss.detach().float().to(self.values.device)
        self.reduce_group = reduce_group
        self.avg_group = avg_group

    def clean(self, preserve_groups: bool = False) -> None:
        """Zero the values (kept allocated); keep the CP groups when ``preserve_groups`` (CUDA-graph replays)."""
        if self.values is not None:
            self.values.zero_()
        if not preserve_groups:
            self.reduce_group = None
            self.avg_group = None

    def reset(self) -> None:
        """Drop everything (tests, new runs)."""
        self.__init__()

    def _negotiate_size(self, pp_group, num_slots: int, device) -> int:
        """A tracker length common to the pipeline group (ranks without an indexer layer participate too)."""
        local = max(num_slots, 0 if self.values is None else self.values.numel())
        if pp_group is None or not dist.is_initialized() or dist.get_world_size(pp_group) == 1:
            return local
        key = (id(pp_group), local)
        cached = self._pp_size_cache.get(key)
        if cached is not None:
            return cached
        t = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pp_group)
        self._pp_size_cache[key] = int(t.item())
        return self._pp_size_cache[key]

    def reduce(self, pg_collection, num_slots: int, device=None) -> torch.Tensor:
        """Reduce the per-slot values across ranks and return them (``[max slots]`` fp32).

        Sum over ``pg_collection.pp``; then ``reduce_group`` (sum) and ``avg_group`` (mean) if saved; then the mean
        over ``pg_collection.dp``. Every rank of those groups must call this (collective).
        """
        if pg_collection is None:
            raise ValueError(
                "IndexerLossTracker.reduce needs an explicit ProcessGroupCollection (pp and dp groups)"
            )
        if device is None:
            device = self.values.device if self.values is not None else _default_device()
        pp = getattr(pg_collection, "pp", None)
        size = self._negotiate_size(pp, num_slots, device)
        vals = torch.zeros(size, device=device, dtype=torch.float32)
        if self.values is not None:
            vals[: self.values.numel()] = self.values.to(device)
        if dist.is_initialized():
            if pp is not None:
                dist.all_reduce(vals, group=pp)
            vals = sum_partials(vals, self.reduce_group)  # the CP partials of a layer: its replica's loss
            if self.avg_group is not None:
                _all_reduce_mean(vals, self.avg_group)
            dp = getattr(pg_collection, "dp", None)
            if dp is not None:
                _all_reduce_mean(vals, dp)
        return vals

    def track_metrics(
        self,
        loss_scale: float,
        iteration: int,
        writer=None,
        wandb_writer=None,
        total_loss_dict: dict | None = None,
        *,
        pg_collection,
        num_layers: int,
        num_indexer_layers: int,
        per_layer_logging: bool = False,
        preserve_groups: bool = False,
    ) -> dict[str, float]:
        """Reduce, log ``"indexer loss"`` (mean over the ``num_indexer_layers`` CSA layers) and clean the tracker.

        Args:
            loss_scale: multiplies the accumulated values (``1 / num_microbatches`` in megatron's ``training_log``).
            num_layers: tracker length (``num_layers + mtp_num_layers``).
            num_indexer_layers: number of ratio-4 layers in the whole model (main + MTP), over which the mean is
                taken; ``0`` logs nothing.
        Returns:
            the logged scalars (``{"indexer loss": ..., "indexer loss layer 3": ...}``).
        """
        vals = self.reduce(pg_collection, num_layers) * loss_scale
        out: dict[str, float] = {}
        if num_indexer_layers > 0:
            avg = vals.sum() / num_indexer_layers
            out["indexer loss"] = float(avg)
            if total_loss_dict is not None:
                total_loss_dict["indexer loss"] = total_loss_dict.get("indexer loss", 0.0) + avg
            if per_layer_logging:
                for i, v in enumerate(vals.tolist()):
                    if v != 0.0:
                        out[f"indexer loss layer {i + 1}"] = v
            for name, v in out.items():
                if writer is not None:
                    writer.add_scalar(name, v, iteration)
                if wandb_writer is not None:
                    wandb_writer.log({name: v}, iteration)
        self.clean(preserve_groups=preserve_groups)
        return out


def _all_reduce_mean(t: torch.Tensor, group) -> None:
    # gloo has no ReduceOp.AVG: sum, then divide
    n = dist.get_world_size(group)
    if n > 1:
        dist.all_reduce(t, group=group)
        t.div_(n)


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


_TRACKER = IndexerLossTracker()


def get_indexer_loss_tracker() -> IndexerLossTracker:
    """The process-wide tracker that DSv4 attention layers write to."""
    return _TRACKER
