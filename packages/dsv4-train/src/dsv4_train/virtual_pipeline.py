"""Virtual pipeline stages (``dsv4 train --pp P --vpp V``) on megatron-core 0.19.2's interleaved 1F1B schedule.

Each pipeline rank holds ``V`` model chunks; the ``P·V`` ``|``-separated segments of the layer pattern are assigned
as megatron does it: chunk ``v`` of rank ``r`` is segment ``v·P + r``. So the embedding and the hash layers sit in
chunk 0 of rank 0 (segment 0: hash layers must be there, checked when the model config is made), the HyperHead, the
head and MTP in chunk ``V-1`` of rank ``P-1``. Data flows ``r -> r+1`` inside a virtual stage and wraps around from
rank ``P-1``'s chunk ``v`` to rank 0's chunk ``v+1``.

Transport without forking megatron: 0.19.2's interleaved schedule has no tensor-shape hook (it asserts
``adjust_tensor_shapes_fn is None``) and sizes every p2p buffer ``[seq_length, b, hidden_size]``. The mHC stack
presents its streams ``X [s, b, n·d]`` folded as ``[s·n, b, d]`` (same memory; :mod:`mhc.megatron.pipeline`) and
the step calls the schedule with ``seq_length = s·n``. Every edge, the wrap-around included, carries streams in the
stream dtype (fp32), so the transport is exact: a PP2 x VPP2 run computes the streams of a single stage.

:class:`VirtualPipelineChunks` is the trainer's view of the ``V`` unwrapped chunks (per-step state on all of them,
MTP facts from the last one, one checkpoint entry per chunk).
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4_train.model_config import model_config_for


def check_vpp_config(tc) -> None:
    """``ValueError`` (what and how to fix) when the model of ``tc`` (a ``TrainConfig`` with ``vpp > 1``) cannot be
    split into its virtual stages (the layouts VPP combines with are the support table's, :mod:`dsv4_train.support`)."""
    cfg = model_config_for(tc)  # P·V segments; hash layers must be in the first (ValueError from the config)
    n_segments = len(cfg.parsed_pattern.segments)
    if n_segments != tc.parallel.pp * tc.parallel.vpp:
        raise ValueError(
            f"--pp {tc.parallel.pp} --vpp {tc.parallel.vpp} needs {tc.parallel.pp * tc.parallel.vpp} pipeline segments, but the model's pattern has "
            f"{n_segments} (a model_overrides pipeline_stages or '|' pattern must have pp*vpp segments)"
        )


def check_vpp_microbatches(num_microbatches: int, pp: int) -> None:
    """megatron's interleaved schedule runs micro-batches in groups of ``pp`` per virtual stage: the count per
    step (global batch / (micro-batch x DP); with ``--packed`` the step's pack count) must be a multiple of ``pp``.
    The trainer checks ``[B, S]`` runs before the first step; packed runs ask thd-packing's scheduler for a pack
    count that is a multiple of ``pp`` (``microbatch_group_size_per_vp_stage``), and every step is checked again."""
    if num_microbatches < pp or num_microbatches % pp:
        raise ValueError(
            f"--vpp needs a multiple of --pp {pp} micro-batches per step, got {num_microbatches} (global batch / "
            "(micro-batch size x DP)): change --global-batch-size or --micro-batch-size"
        )


def chunk_stages(ps, vpp: int) -> list[tuple[int | None, bool, bool]]:
    """``(vp_stage, pre_process, post_process)`` of this rank's chunks (``vp_stage=None`` without VPP)."""
    if vpp == 1:
        return [(None, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())]
    return [
        (
            v,
            ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
        )
        for v in range(vpp)
    ]


class VirtualPipelineChunks(torch.nn.Module):
    """The ``V`` :class:`~hybrid_model.model.DSv4Model` chunks of one pipeline rank, as one object for the trainer.

    ``parameters()`` / ``modules()`` cover every chunk. The step state is set on every chunk; MTP lives in the
    last. ``sharded_state_dict()`` is ``{"chunk0": ..., "chunk1": ...}`` (each chunk's megatron sharded state dict:
    layers under their global numbers, so the files are those of any other layout) and ``load_state_dict`` takes
    the same nesting.
    """

    def __init__(self, chunks: list) -> None:
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    @property
    def config(self):
        return self.chunks[0].config

    @property
    def step_state(self):
        return self.chunks[0].step_state

    def set_step_state(self, **kwargs: Any) -> None:
        for chunk in self.chunks:
            chunk.set_step_state(**kwargs)

    @property
    def mtp_process(self) -> bool:
        return self.chunks[-1].mtp_process

    @property
    def last_mtp_loss(self):
        return self.chunks[-1].last_mtp_loss

    @property
    def last_mtp_losses(self):
        return self.chunks[-1].last_mtp_losses

    @property
    def context_parallel_group(self):
        """The chunks' CP group (``None`` at CP = 1; ``--vpp`` with ``--cp`` > 1 is refused at config time)."""
        return self.chunks[0].context_parallel_group

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return {f"chunk{i}": c.sharded_state_dict(*args, **kwargs) for i, c in enumerate(self.chunks)}

    def load_state_dict(self, state_dict, strict: bool = True):  # type: ignore[override]
        return [c.load_state_dict(state_dict[f"chunk{i}"], strict=strict) for i, c in enumerate(self.chunks)]

    def forward(self, *args: Any, **kwargs: Any):
        raise TypeError("VirtualPipelineChunks is not called: megatron's schedule runs each chunk")


def ddp_chunks(model) -> list:
    """The DDP-wrapped chunks of ``model`` (one DDP module, or the list of VPP chunks)."""
    return list(model) if isinstance(model, list | tuple) else [model]
