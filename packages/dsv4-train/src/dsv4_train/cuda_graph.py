"""Whole-step CUDA graphs for ``dsv4 train --cuda-graph`` (megatron-core's ``FullCudaGraphWrapper``).

At short sequences a DSv4 training step is launch-bound: a flash-smoke step at S = 4096 issues ~2,100 kernels, many of
them a few microseconds long (mHC coefficients, norms, routing), and eager PyTorch cannot launch them as fast as the
GPU runs them. megatron-core's ``FullCudaGraphWrapper`` wraps the forward-backward schedule: after
``cuda_graph_warmup_steps`` eager steps it captures one step (every micro-batch's forward and backward, the gradient
hooks, and ``finalize_model_grads`` at DP = 1) in a CUDA graph and replays it from then on, copying each step's batch
into static input buffers first. The optimizer step, the loss reduction and the selection-bias update stay eager.

What makes the step capturable (no host reads, no host-to-device copies of pageable memory, static shapes):

* every kernel of the attention stack takes host-side layout bounds (no ``cu_seqlens`` read-back); small host
  integer tables are uploaded once and cached (:func:`csa_kernels.varlen.upload_host_ints`);
* at one TP x EP rank the MoE dispatcher keeps the per-expert counts on the device and the grouped GEMM pads into a
  static worst-case buffer (hash-moe 0.4);
* the hash router's token-id range check becomes a device-side assert while a graph is captured.

**Streams.** Autograd nodes remember the CUDA stream they were created on. megatron's DDP keeps the gradient
accumulator nodes of all parameters alive from construction on; if they were created on the default (legacy)
stream, capturing the backward on a side stream fails ("operation would make the legacy stream depend on a capturing
blocking stream"; fixed in PyTorch only after 2.11). The Trainer therefore makes megatron's shared capture stream
the current stream before it builds the model and keeps it for the whole run (:func:`use_capture_stream`).

**Recapture.** Host-side values of a step are baked into the graph. The Trainer recaptures (after a new eager
warm-up) whenever one of them changes: the dense / sparse attention phase (``--dense-steps``) and the MTP loss weight
(its decay at the start of the LR decay).

**Data parallelism.** With DP > 1 the graph holds every micro-batch's forward and backward (the DDP hooks only
accumulate into the grad buffers); megatron's ``finalize_model_grads`` — the DP reduce-scatter of the gradients —
runs eagerly after each replay, before the optimizer step (:mod:`~dsv4_train.graph_data_parallel`:
what it costs, what capturing the collective would need).

**Packed batches** (``--packed``): the pack's boundaries move every step, so they are copied into the static buffers
with the batch (``cu_seqlens`` at a fixed document capacity) and the attention stack runs in its device-bounds mode
(:mod:`dsv4_train.graph_packs`); the micro-batch count of a step is part of the recapture key.

Limits (``ValueError`` at configuration time): a CUDA device, bf16, one model-parallel rank (PP = EP = TP = CP = 1),
any number of data-parallel ranks with fixed-length ``[B, S]`` batches, one process with ``--packed`` (the
dp-balanced scheduler gives DP ranks different micro-batch counts, and every rank must replay the same graph).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader, get_shared_capture_stream

from dsv4_train.graph_packs import BATCH_FIELDS, static_pack_batch

# the fields of a fixed-length micro-batch that the forward step reads (copied into static buffers every step)


def use_capture_stream() -> torch.cuda.Stream:
    """Make megatron's shared graph-capture stream the current stream and return the previous one (see the module
    docstring: the model, its DDP gradient hooks and every step must live on the stream the graph is captured on)."""

    previous = torch.cuda.current_stream()
    torch.cuda.set_stream(get_shared_capture_stream())
    return previous


def static_batch(mb: Any, *, max_docs: int | None = None, step: int = 0) -> dict[str, torch.Tensor]:
    """A micro-batch as the dict of tensors that ``FullCudaGraphWrapper`` copies into its static buffers; a packed
    one (``max_docs``: its document capacity) with its boundaries (:func:`~.graph_packs.static_pack_batch`)."""
    if max_docs is not None:
        return static_pack_batch(mb, max_docs=max_docs, step=step)
    return {name: getattr(mb, name) for name in BATCH_FIELDS}


class GraphedForwardBackward:
    """megatron's forward-backward schedule behind ``FullCudaGraphWrapper``, recaptured when ``key`` changes.

    ``key`` is any hashable summary of the host-side values the captured step depends on; a new key drops the graph
    and starts a new eager warm-up of ``warmup_steps`` steps, then captures again.
    """

    def __init__(self, forward_backward_func, warmup_steps: int) -> None:

        self.wrapper = FullCudaGraphWrapper(forward_backward_func, cuda_graph_warmup_steps=warmup_steps)
        self.close()  # megatron keeps the graphs and the static input buffers at class level: start clean
        self.key: Any = None
        self.captures = 0

    @property
    def captured(self) -> bool:
        return type(self.wrapper).cuda_graph["training"] is not None

    def __call__(self, key: Any, **kwargs):
        if key != self.key:
            self.wrapper.reset_cuda_graph("training")
            self.key = key
        was_captured = self.captured
        out = self.wrapper(**kwargs)
        if self.captured and not was_captured:
            self.captures += 1
        return out

    def close(self) -> None:
        """Drop the graph, its memory pool's tensors and the static input buffers (shaped for this run's batches)."""

        self.wrapper.reset_cuda_graph()
        for stage in StaticBufferLoader.static_buffers:
            StaticBufferLoader.static_buffers[stage] = []
