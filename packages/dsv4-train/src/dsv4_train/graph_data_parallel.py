"""``--cuda-graph`` with data parallelism: the DP gradient reduction runs eagerly beside the captured step.

megatron-core 0.19.2's ``FullCudaGraphWrapper`` captures the whole ``forward_backward_func`` call, and
``forward_backward_no_pipelining`` ends with ``config.finalize_model_grads_func`` — the data-parallel gradient
reduction (``finish_grad_sync``: a reduce-scatter per bucket for the distributed optimizer, an all-reduce
otherwise, after scaling by ``1 / DP``). With DP > 1 that collective would be baked into the graph. We keep it out:

* **inside the graph**: every micro-batch's forward and backward. megatron's DDP is built with
  ``overlap_grad_reduce=False`` (:func:`~dsv4_train.setup.build_model`), so its backward hooks only
  accumulate each parameter's gradient into the contiguous fp32 grad buffer (``main_grad``) and launch no
  collective, micro-batch after micro-batch (``no_sync`` only matters with overlap). No rank-to-rank traffic is
  captured: nothing in the forward or backward at TP = CP = EP = PP = 1 talks to another rank.
* **beside the graph, eagerly after each replay**: megatron's own ``finalize_model_grads`` with the arguments the
  schedule passed it (:class:`GradReductionAfterSchedule` swaps ``config.finalize_model_grads_func`` for a recorder
  while the schedule runs, then calls the real one). The grad buffers live at fixed addresses, so the eager
  reduction reads exactly what the replay wrote. The loss and token-count reductions, the optimizer step (whose
  distributed-optimizer parameter all-gather follows it) and the selection-bias update were eager already.

No megatron source is forked: the schedule is configured through the hook it already calls.

**What this costs.** The gradient reduction starts only after the last backward kernel of the step (no overlap of
the reduce-scatter with the backward, which ``overlap_grad_reduce`` gives an eager run). For the DSv4 sizes this
runs at (graphs pay off at short sequences, where a step is launch-bound) it is one reduce-scatter of the fp32 grad
buffers per step.

**What capturing the reduction would need.** NCCL collectives can be captured (gloo ones cannot: they run on host
threads); capturing ``finish_grad_sync`` needs every rank to capture at the same step with the same bucket layout
(true here) and NCCL's graph-capture support (``NCCL_GRAPH_MIXING_SUPPORT`` for collectives issued both eagerly and
from graphs on one communicator, or a communicator used only by the graph). Overlapping it with the backward would
also mean capturing megatron's ``overlap_grad_reduce`` hooks (bucket collectives launched from the backward hooks,
joined in ``finish_grad_sync``). Neither is validated on more than one GPU here (one GPU cannot host two NCCL
ranks), so the reduction stays beside the graph.

Every rank captures and replays the same step: fixed-length ``[B, S]`` batches give every DP rank
``global_batch_size / (DP x micro_batch_size)`` micro-batches, the recapture key (attention phase, MTP weight) is a
function of the step number, and ``FullCudaGraphWrapper`` puts a barrier around the capture.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def check_equal_microbatches(num_microbatches: int, group, device) -> None:
    """``RuntimeError`` unless every rank of ``group`` runs ``num_microbatches`` micro-batches per step (one small
    all-reduce): a rank that captured another number of micro-batches would replay another step, and the ranks
    would wait for each other at megatron's capture barrier or in the reduction."""
    if group is None or dist.get_world_size(group) == 1:
        return
    bounds = torch.tensor([num_microbatches, -num_microbatches], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    high, low = int(bounds[0]), -int(bounds[1])
    if high != low:
        raise RuntimeError(
            f"--cuda-graph with data parallelism needs the same number of micro-batches on every rank (this rank "
            f"runs {num_microbatches}, the data-parallel group {low}..{high})"
        )


def check_no_sync_in_backward(chunks) -> None:
    """``RuntimeError`` if a DDP chunk would launch gradient collectives from its backward hooks
    (``overlap_grad_reduce``): they would be captured into the graph instead of running beside it."""
    for chunk in chunks:
        if chunk.ddp_config.overlap_grad_reduce:
            raise RuntimeError(
                "--cuda-graph with data parallelism keeps the gradient reduction out of the graph, which needs "
                "DistributedDataParallelConfig(overlap_grad_reduce=False): the backward hooks must only accumulate"
            )


class GradReductionAfterSchedule:
    """Runs a forward-backward function with megatron's ``finalize_model_grads`` taken out of it, then runs that
    reduction eagerly.

    ``config``: the megatron ``TransformerConfig`` whose ``finalize_model_grads_func`` the schedule calls. The
    arguments of the schedule's call are kept between steps: a replayed graph runs no Python, so the reduction after
    a replay reuses the arguments recorded at the capture (the model chunks, ``None`` or the static token-count
    tensor, the process groups — all fixed for the run). ``group`` / ``device``: the data-parallel group and the
    device of a small tensor; the first call checks that every rank runs the same number of micro-batches
    (:func:`check_equal_microbatches`).
    """

    def __init__(self, config, group=None, device=None) -> None:
        self.config = config
        self.group, self.device = group, device
        self.checked = False
        self.call: tuple[tuple, dict] | None = None  # (args, kwargs) of the schedule's last finalize call

    def _record(self, *args: Any, **kwargs: Any) -> None:
        self.call = (args, kwargs)

    def __call__(self, forward_backward_func, **schedule) -> Any:
        if not self.checked:
            check_equal_microbatches(schedule["num_microbatches"], self.group, self.device)
            self.checked = True
        finalize = self.config.finalize_model_grads_func
        if finalize is None:
            return forward_backward_func(**schedule)
        self.config.finalize_model_grads_func = self._record
        try:
            out = forward_backward_func(**schedule)
        finally:
            self.config.finalize_model_grads_func = finalize
        if self.call is None:
            raise RuntimeError(
                "the forward-backward schedule never called finalize_model_grads: the data-parallel gradient "
                "reduction would be skipped"
            )
        args, kwargs = self.call
        finalize(*args, **kwargs)
        return out


def data_parallel_size(ps) -> int:
    """The number of ranks the gradients are reduced over (data x context parallel)."""
    return ps.get_data_parallel_world_size(with_context_parallel=True)
