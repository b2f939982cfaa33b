"""Pipeline transport of the mHC streams (P3) for megatron-core 0.19.2's schedules.

Between pipeline stages the activations are the ``n`` streams, ``[s, b, n·d]``, not ``[s, b, d]``. The inactive
edges (the first stage's receive, the last stage's send) carry nothing; megatron's non-interleaved 1F1B schedule
skips them, so one uniform shape per direction is correct there. 0.19.2's interleaved (VPP) schedule has no
shape hook (it asserts ``adjust_tensor_shapes_fn is None`` and sizes every p2p buffer
``[seq_length, micro_batch_size, hidden_size]``). For it the streams travel *folded*: the stage output
``X [s, b, n·d]`` is presented as ``[s·n, b, d]`` (:func:`fold_streams`, a view of the same contiguous memory, no
copy) and the schedule is called with ``seq_length = s·n`` (:func:`mhc_folded_seq_length`); the receiving stage
unfolds it (:func:`unfold_streams`). Only the element count and the dtype of a p2p buffer matter to the transfer,
and autograd carries the gradient through the same views, so the folded transport moves exactly the bytes of the
unfolded one. Every edge of the interleaved schedule (stage to stage, and the wrap-around from the last stage's
chunk ``v`` to the first stage's chunk ``v + 1``) carries streams, so one shape serves all of them.
:class:`~mhc.megatron.HyperConnectionHybridStack` folds / unfolds when the megatron config has
``virtual_pipeline_model_parallel_size`` set (:func:`uses_folded_streams`).

Use::

    # 1F1B (no VPP): a shape hook
    forward_backward_pipelining_without_interleaving(..., adjust_tensor_shapes_fn=make_mhc_adjust_tensor_shapes_fn(4))
    # interleaved (VPP): folded streams
    forward_backward_pipelining_with_interleaving(..., seq_length=mhc_folded_seq_length(s, 4))

What crosses a stage boundary, in which dtype (megatron allocates both p2p buffers in ``config.pipeline_dtype``):

=================================  ===============  =================================================================
tensor                             dtype            why
=================================  ===============  =================================================================
streams ``X [s, b, n·d]`` forward  stream dtype     the residual streams are stored in ``MHCConfig.stream_dtype``
                                                    (fp32 by default, also under bf16 params): a bf16 buffer would
                                                    round them at every boundary, which a single-stage run never does
gradient ``dL/dX`` backward        stream dtype     autograd's gradient of an fp32 tensor is fp32 (same buffer dtype)
=================================  ===============  =================================================================

So ``config.pipeline_dtype`` must equal the stream dtype: :func:`check_mhc_pipeline_dtype` refuses anything else
at build time (:class:`~mhc.megatron.HyperConnectionHybridStack` calls it), instead of gloo/NCCL failing at the first
send with a byte-count mismatch (a bf16 buffer is half the size of the fp32 streams) or silently rounding. With the
stream dtype on the wire the transport is exact: a pipelined run computes the same streams and stream gradients as
one stage does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def mhc_pipeline_hidden_size(
    hidden_size: int, num_streams: int, *, is_recv: bool, is_first_stage: bool, is_last_stage: bool
) -> int:
    """Channels of the p2p tensor on one edge: ``n·d`` on active inter-stage edges, ``d`` on inactive ones.

    The first stage's receive and the last stage's send have no peer (the embedding feeds the first stage, the
    loss ends the last), so they keep ``d``.
    """
    if num_streams < 1 or hidden_size < 1:
        raise ValueError(f"hidden_size and num_streams must be positive, got {hidden_size}, {num_streams}")
    inactive = (is_recv and is_first_stage) or ((not is_recv) and is_last_stage)
    return hidden_size if inactive else hidden_size * num_streams


def mhc_pipeline_dtype(mhc) -> torch.dtype:
    """The dtype of every inter-stage p2p tensor of an mHC model: the streams' storage dtype ``mhc.stream_dtype``."""
    return mhc.stream_dtype


def check_mhc_pipeline_dtype(config, mhc) -> None:
    """``ValueError`` unless ``config.pipeline_dtype`` is the stream dtype (checked only with pipeline stages).

    ``config``: the megatron ``TransformerConfig``; ``mhc``: the :class:`~mhc.MHCConfig` of the stack.
    """
    if (config.pipeline_model_parallel_size or 1) <= 1:
        return
    want = mhc_pipeline_dtype(mhc)
    if config.pipeline_dtype != want:
        raise ValueError(
            f"config.pipeline_dtype={config.pipeline_dtype} but the mHC streams crossing pipeline stages are "
            f"{want} (MHCConfig.stream_dtype): set pipeline_dtype={want} (the p2p buffers hold the streams "
            "[s, b, n·d] and their gradients; another dtype breaks the transfer or rounds the residual streams)"
        )


def _expand(shapes: Sequence, num_streams: int) -> list:
    out = []
    for shape in shapes:
        shape = tuple(shape)
        # () is the variable-sequence-length placeholder: shapes are exchanged at run time, keep it
        out.append(shape if len(shape) == 0 else (*shape[:-1], shape[-1] * num_streams))
    return out


def make_mhc_adjust_tensor_shapes_fn(num_streams: int) -> Callable[[list, list], tuple[list, list]]:
    """An ``adjust_tensor_shapes_fn`` for ``forward_backward_pipelining_without_interleaving``: ``d -> n·d``."""
    if num_streams < 1:
        raise ValueError(f"num_streams must be >= 1, got {num_streams}")

    def adjust(recv_tensor_shapes: list, send_tensor_shapes: list) -> tuple[list, list]:
        return _expand(recv_tensor_shapes, num_streams), _expand(send_tensor_shapes, num_streams)

    return adjust


def mhc_p2p_tensor_shapes(
    *,
    seq_length: int,
    micro_batch_size: int,
    config,
    num_streams: int,
    decoder_seq_length: int | None = None,
    tp_group=None,
    cp_group=None,
) -> list[tuple[int, ...]]:
    """megatron's ``get_tensor_shapes`` (CP/SP sequence scaling included) with the hidden dim times ``n``."""
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    if cp_group is None and not config.variable_seq_lengths:
        raise ValueError(
            "cp_group is required (pass pg_collection.cp) unless config.variable_seq_lengths is set"
        )
    shapes = get_tensor_shapes(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        config=config,
        tp_group=tp_group,
        cp_group=cp_group,
    )
    return _expand(shapes, num_streams)


def uses_folded_streams(config) -> bool:
    """Whether the stages of ``config`` (megatron ``TransformerConfig``) exchange folded streams: with virtual
    pipeline stages (the interleaved schedule, which has no shape hook)."""
    return (getattr(config, "virtual_pipeline_model_parallel_size", None) or 0) > 1


def mhc_folded_seq_length(seq_length: int, num_streams: int) -> int:
    """The ``seq_length`` to give megatron's interleaved schedule so that its p2p buffers
    ``[seq_length, b, d]`` hold the folded streams ``[s·n, b, d]`` of :func:`fold_streams`."""
    if seq_length < 1 or num_streams < 1:
        raise ValueError(f"seq_length and num_streams must be positive, got {seq_length}, {num_streams}")
    return seq_length * num_streams


def fold_streams(x: torch.Tensor, num_streams: int) -> torch.Tensor:
    """``X [s, b, n·d]`` -> ``[s·n, b, d]``: the same contiguous memory under the interleaved schedule's p2p shape.

    Not a sequence reordering: row ``i`` of the result is bytes ``i·b·d ... (i+1)·b·d`` of ``X``. Its only consumer
    is the p2p transfer (and autograd back through the view); :func:`unfold_streams` is the inverse.
    """
    s, b, nd = x.shape
    if nd % num_streams:
        raise ValueError(f"the streams have {nd} channels, not a multiple of num_streams={num_streams}")
    return x.contiguous().view(s * num_streams, b, nd // num_streams)


def unfold_streams(x: torch.Tensor, num_streams: int) -> torch.Tensor:
    """``[s·n, b, d]`` (a received folded buffer) -> ``X [s, b, n·d]``; inverse of :func:`fold_streams`."""
    sn, b, d = x.shape
    if sn % num_streams:
        raise ValueError(
            f"a folded stream buffer has {sn} rows, not a multiple of num_streams={num_streams}: was the "
            "interleaved schedule called with seq_length = mhc_folded_seq_length(s, n)?"
        )
    return x.contiguous().view(sn // num_streams, b, num_streams * d)
