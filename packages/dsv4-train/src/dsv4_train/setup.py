"""Construction of a ``dsv4 train`` run: process groups, the model (DDP, bf16 wrapper), the distributed optimizer,
the LR scheduler and the batch iterator, each from a :class:`~dsv4_train.config.TrainConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from dsv4_attention import get_indexer_loss_tracker
from dsv4_attention.indexer_loss import IndexerLossAutoScaler
from dsv4_primitives.megatron import cuda_as_cpu
from dsv4_primitives.megatron.precision import Float16ModuleKeepFP32
from dsv4_train.config import DIST_BACKENDS, TrainConfig, effective_config
from dsv4_train.data import build_batches
from dsv4_train.eval_data import build_run_data
from dsv4_train.model_config import model_config_for
from dsv4_train.offload import offload_config_fields
from dsv4_train.offload_pipeline import CHUNK_NUMEL as OFFLOAD_CHUNK_NUMEL
from dsv4_train.optimizer import build_optimizer as build_megatron_optimizer
from dsv4_train.recompute import recompute_config
from dsv4_train.support import Machine, check_run_relations
from dsv4_train.virtual_pipeline import VirtualPipelineChunks, check_vpp_config, chunk_stages, ddp_chunks
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.latent_attention import reset_dsa_indexer_loss_state
from hybrid_model.model import build_model as build_dsv4_model
from hybrid_model.seeded_init import seed_parameters


def machine_for(tc: TrainConfig) -> Machine:
    """What the support table needs to know of this machine for ``tc``: the data-parallel size (from the process
    group, else torchrun's ``WORLD_SIZE``) and whether CUDA is visible."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    p = tc.parallel
    return Machine(dp=max(1, world // (p.tp * p.pp * p.cp)), cuda=torch.cuda.is_available())


def check_world(tc: TrainConfig, world: int) -> None:
    """``ValueError`` when ``world`` processes cannot hold the layout of ``tc``: DP = world / (tp·pp·cp) ranks,
    and the experts of a stage split over ``ep`` ranks (megatron: world divisible by tp·ep·pp)."""
    p = tc.parallel
    for what, size in (
        (f"pp={p.pp} x tp={p.tp} x cp={p.cp} (DP = world / (tp*pp*cp))", p.pp * p.tp * p.cp),
        (
            f"ep={p.ep} x tp={p.tp} x pp={p.pp} (the experts of a stage split over EP ranks)",
            p.ep * p.tp * p.pp,
        ),
    ):
        if world % size:
            raise ValueError(
                f"world size {world} is not divisible by {what}: start torchrun with a multiple of {size} processes "
                f"(e.g. torchrun --nproc-per-node {size} -m dsv4_train train ...)"
            )


def check_run(tc: TrainConfig) -> TrainConfig:
    """The effective config of ``tc`` on this machine, checked before any work: the values left to the machine
    resolved (:func:`~dsv4_train.config.effective_config`), the support table's refusals that need the machine,
    and the rules that need the model (``--vpp`` segments and hash layers). ``ValueError`` with the reason."""
    tc = effective_config(tc, cuda_available=torch.cuda.is_available())
    # the preset with the overrides and the pipeline layout (ValueError naming the flags)
    model_config_for(tc)
    if tc.parallel.vpp > 1:
        check_vpp_config(tc)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_world(tc, world)
    check_run_relations(tc, machine_for(tc))
    return tc


def resolve_dist_backend(backend: str | None) -> str:
    """``--dist-backend``: ``None`` -> ``"nccl"`` on CUDA, ``"gloo"`` on CPU; ``ValueError`` for an unknown name
    or NCCL without CUDA."""
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in DIST_BACKENDS:
        raise ValueError(f"--dist-backend must be one of {DIST_BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "--dist-backend nccl needs CUDA devices (none is visible); use --dist-backend gloo on CPU"
        )
    return backend


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int]:
    """``(rank, world)`` of the default process group, created when missing with ``backend`` (see
    :func:`resolve_dist_backend`): from torchrun's environment, else one local process on a free loopback port.
    Each torchrun process takes the GPU ``LOCAL_RANK``; with gloo on CUDA, ``LOCAL_RANK`` modulo the visible GPUs
    (several ranks may share one GPU, which NCCL refuses). ``timeout_s``: how long a collective may wait for the
    other ranks (``--dist-timeout``; torch's default when ``None``). An existing process group is used as it is."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = resolve_dist_backend(backend)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local % torch.cuda.device_count() if backend == "gloo" else local)
        dist.init_process_group(backend, rank=rank, world_size=world, **timeout)
        return rank, world
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=0, world_size=1, **timeout)
    return 0, 1


def reset_metric_trackers() -> None:
    """Process-wide per-layer loss trackers are sized by the first model that records, and the auxiliary-loss
    auto-scalers keep the backward scale tensor of the first step that set it (class attributes, later updated in
    place with ``copy_``, so a previous run's tensor would fix this run's shape and device): start each run fresh."""

    destroy_moe_metrics_tracker()
    get_indexer_loss_tracker().reset()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    IndexerLossAutoScaler.main_loss_backward_scale = None

    reset_dsa_indexer_loss_state()  # megatron's DSA ('D') scaler and tracker


def default_peak_tflops() -> float:
    """Dense BF16 peak of the device for MFU (H200 989 TFLOP/s); a nominal 1 TFLOP/s on CPU."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if "H200" in name or "H100" in name:
            return 989.0
        return 312.0
    return 1.0


def params_dtype_of(tc: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if tc.precision.bf16 else torch.float32


@dataclass
class ModelParts:
    """``core``: the :class:`~hybrid_model.model.DSv4Model` itself (with ``--vpp``: the rank's chunks as one
    :class:`~dsv4_train.virtual_pipeline.VirtualPipelineChunks`); ``model``: it under the bf16
    ``Float16Module`` (with ``--bf16``) and megatron's ``DistributedDataParallel`` (with ``--vpp``: a list, one
    per chunk); ``config``: the megatron ``TransformerConfig`` (of the first chunk)."""

    core: Any
    model: Any
    config: Any


def build_model(tc: TrainConfig, model_config: DSv4ModelConfig, ps, pg, device: torch.device) -> ModelParts:
    """The DSv4 model of this rank's pipeline stage (``--vpp``: its chunks), wrapped for bf16 and in DDP. Its
    parameters are functions of ``(tc.schedule.seed, global name)`` (:func:`hybrid_model.seeded_init.seed_parameters`):
    the same initial model under every PP / VPP / EP / DP / CP layout."""

    torch.manual_seed(tc.schedule.seed)
    vpp_kw = {"virtual_pipeline_model_parallel_size": tc.parallel.vpp} if tc.parallel.vpp > 1 else {}
    cores, models = [], []
    for vp_stage, pre, post in chunk_stages(ps, tc.parallel.vpp):
        # bf16 as megatron's training loop does it: params (and the pipeline p2p buffers) in bf16, the model
        # wrapped in a Float16Module (bf16 first-stage inputs, fp32 last-stage outputs); the keep-in-fp32 tensors
        # (mHC, sinks, compressor ape, router selection bias) stay fp32. ``config.bf16`` alone makes the mHC
        # layers cast activations to bf16, which then meet fp32 weights ("expected mat1 and mat2 to have the same
        # dtype").
        with cuda_as_cpu():  # PP + MTP: megatron moves the last stage's embedding copy with .cuda()
            core = build_dsv4_model(
                model_config,
                pre_process=pre,
                post_process=post,
                pg_collection=pg,
                vp_stage=vp_stage,
                tensor_model_parallel_size=tc.parallel.tp,
                pipeline_model_parallel_size=tc.parallel.pp,
                expert_model_parallel_size=tc.parallel.ep,
                context_parallel_size=tc.parallel.cp,
                balance_loss_coeff=tc.loss.balance_loss_coeff,
                indexer_loss_coeff=tc.loss.indexer_loss_coeff,
                bf16=tc.precision.bf16,
                params_dtype=params_dtype_of(tc),
                fused_linear_cross_entropy=tc.precision.fused_linear_ce,
                deterministic_mode=tc.precision.deterministic,  # megatron's embedding: weight[ids] (sort-based backward)
                recompute=recompute_config(tc),
                **vpp_kw,
            ).to(device)
        # every parameter a function of (seed, its one-process name): the same model under every layout
        seed_parameters(core, tc.schedule.seed)
        model = core
        if tc.precision.bf16:
            model = Float16ModuleKeepFP32(core.config, model)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
        )
        # megatron's training loop passes disable_bucketing=True for VPP chunks after the first; on 0.19.2 with the
        # distributed optimizer and several grad buffers per chunk (bf16 params + keep-in-fp32 params) that one
        # forced bucket group corrupts the chunk's params at the first bf16 step (measured: PP2xVPP2 chunk-1
        # weights replaced by other params' values). Without overlap_grad_reduce each buffer is one bucket anyway.
        with cuda_as_cpu():
            model = DistributedDataParallel(core.config, ddp_config, model, disable_bucketing=False)
        cores.append(core)
        models.append(model)
    if tc.parallel.vpp == 1:
        return ModelParts(core=cores[0], model=models[0], config=cores[0].config)
    return ModelParts(core=VirtualPipelineChunks(cores), model=models, config=cores[0].config)


def optimizer_config(tc: TrainConfig) -> OptimizerConfig:
    """megatron's ``OptimizerConfig`` of the run (torch Adam, betas 0.9 / 0.95, gradient clipping, the offload
    fields of :mod:`dsv4_train.offload`)."""

    offload_fields = (
        offload_config_fields(tc.optimizer.optimizer_offload_fraction)
        if tc.optimizer.optimizer_cpu_offload
        else {}
    )

    return OptimizerConfig(
        optimizer="adam",
        lr=tc.optimizer.lr,
        min_lr=tc.optimizer.min_lr,
        weight_decay=tc.optimizer.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=tc.optimizer.clip_grad,
        use_distributed_optimizer=True,
        bf16=tc.precision.bf16,
        params_dtype=params_dtype_of(tc),
        **offload_fields,
    )


def build_optimizer(tc: TrainConfig, model) -> Any:
    """megatron's distributed optimizer (:func:`optimizer_config`) over the DDP ``model``, on the AdamW kernel
    ``tc.optimizer.optimizer_impl`` (:mod:`dsv4_train.optimizer`), its offloaded host step pipelined with
    ``--optimizer-offload-overlap`` (:mod:`dsv4_train.offload_pipeline`)."""

    opt_config = optimizer_config(tc)
    chunk = OFFLOAD_CHUNK_NUMEL if tc.optimizer.optimizer_offload_overlap else None
    with cuda_as_cpu():
        # megatron 0.19.2's distributed optimizer on torch Adam loses the restored Adam ``step`` (overwritten
        # by the loading template, then shared by all params) — the primitives subclass fixes both
        return build_megatron_optimizer(
            opt_config, ddp_chunks(model), impl=tc.optimizer.optimizer_impl, offload_chunk_numel=chunk
        )


def build_scheduler(tc: TrainConfig, optimizer) -> Any:
    """megatron's ``OptimizerParamScheduler``: linear warm-up, then cosine to ``min_lr`` or WSD (constant, then a
    cosine anneal over the last ``lr_wsd_decay_steps``); constant weight decay."""

    wsd = tc.optimizer.lr_decay_style == "wsd"
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=tc.optimizer.lr,
        min_lr=tc.optimizer.min_lr,
        lr_warmup_steps=min(tc.optimizer.warmup_steps, tc.schedule.steps - 1),
        lr_decay_steps=max(tc.schedule.steps, 2),
        lr_decay_style="WSD" if wsd else "cosine",
        wsd_decay_steps=tc.optimizer.lr_wsd_decay_steps if wsd else None,
        lr_wsd_decay_style="cosine" if wsd else None,
        start_wd=tc.optimizer.weight_decay,
        end_wd=tc.optimizer.weight_decay,
        wd_incr_steps=tc.schedule.steps,
        wd_incr_style="constant",
    )


def attach_schedule_hooks(config, model) -> None:
    """The megatron schedule's hooks on the model config: gradient finalisation, no loss scaling, DDP's no-sync."""

    chunks = ddp_chunks(model)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = None
    # the interleaved schedule (VPP) takes one no-sync per chunk
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]


def build_data(
    tc: TrainConfig, model_config: DSv4ModelConfig, ps, *, announce: bool = False
) -> tuple[Any, Any]:
    """``(batches, data)``: thd-packing's global-batch iterator over ``--data`` (or the embedded corpus, or mock
    data), this rank's share of every global batch (``[B, S]`` or packed THD, static shapes; every CP rank of a DP
    replica reads the same global batch, packs sliced to its contiguous rows), and the run's
    :class:`~dsv4_train.eval_data.RunData` (training and evaluation datasets); reading rules and the
    summary (printed when ``announce``) in :mod:`dsv4_train.data` / ``eval_data``."""

    data = build_run_data(tc, model_config.vocab_size)
    if announce:
        print(data.summary, flush=True)
    batches = build_batches(
        data.train,
        tc,
        vocab_size=model_config.vocab_size,
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
    )
    return batches, data
