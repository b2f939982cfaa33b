"""Pipeline transport of the mHC streams (P3) for megatron-core 0.19.2's schedules.

Between pipeline stages the activations are the ``n`` streams, ``[s, b, n·d]``, not ``[s, b, d]``. The inactive
edges (the first stage's receive, the last stage's send) carry nothing; megatron's non-interleaved 1F1B schedule
skips them, so one uniform shape per direction is correct there. 0.19.2's interleaved (VPP) schedule has no
shape hook (it asserts ``adjust_tensor_shapes_fn is None`` and uses ``config.hidden_size``), so VPP with mHC is
not supported by that release.

Use::

    forward_backward_pipelining_without_interleaving(..., adjust_tensor_shapes_fn=make_mhc_adjust_tensor_shapes_fn(4))

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
