"""``--optimizer-impl fused-step`` (issue 34): megatron-core's optimizer step with gradient clipping, the AdamW
update and the main -> model param copy in one Triton pass (:func:`dsv4_primitives.fused_adamw.fused_adamw_step`).

What megatron-core 0.19.2's step does otherwise, each a pass over every param (``optimizer/optimizer.py``
``MixedPrecisionOptimizer.step`` / ``ChainedOptimizer.step``): the gradient norm, the clip (``grads *= coef``, read
+ write), torch's AdamW (read grads, params, moments; write params, moments) and ``_copy_main_params_to_model_params``
(read fp32 main params, write bf16 model params). Here the norm stays megatron's (it returns a host float
anyway); the clip is deferred into the kernel, and the copy is written by the kernel:

* the inner torch ``AdamW`` becomes :class:`FusedStepAdamW` in place (as ``_pin_kernel`` does): same param groups,
  same ``state`` (``step`` a CPU float32 tensor, ``exp_avg`` / ``exp_avg_sq`` fp32 like the param: the format of
  ``--optimizer-impl unfused``; checkpoints load across impls); its ``step()`` launches the kernel once per
  (grad dtype, model-param dtype) over all its params;
* each main param's model-param destination is the one megatron's copy writes: the distributed optimizer's slice
  of the bucket's ``param_data`` at ``gbuf_world_in_bucket``, the Float16 optimizer's model param; none for
  native FP32 params whose main param is the model param (keep-in-FP32 params, ``FP32Optimizer``); the slices are
  cached and rebuilt when a bucket's ``param_data`` changes;
* the wrapper's ``_copy_main_params_to_model_params`` is skipped exactly once after a step in which the kernel
  wrote every destination, and runs as megatron's otherwise (a param without a gradient, a load);
* ``megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32`` (process-wide, idempotent;
  :func:`install_deferred_clip`) records ``coef = max_norm / (norm + 1e-6)`` (applied when ``< 1``, as megatron)
  on the owning :class:`FusedStepAdamW` instead of scaling the gradients, for param lists it owns entirely; every
  other call goes to megatron's function. The gradients therefore stay unclipped after ``step()``.

Numerics: the kernel's fp32 update follows torch's single-tensor AdamW operation by operation (the bound of
:mod:`dsv4_train.optimizer` holds); the clipped gradient is ``fp32(g * coef)`` as megatron's in-place scale; the bf16
copy is the round-to-nearest-even of the new main param as ``copy_``.

Refused (``ValueError``): torch ``Adam`` with L2 weight decay, ``amsgrad`` / ``maximize`` / ``capturable`` /
``differentiable``, megatron's precision-aware optimizer (and so CPU offload), FP8 / FP4 param gather,
Megatron-FSDP, MXFP8 buffer reuse, params neither on CUDA nor on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import types
import weakref

import torch
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32 as megatron_clip

from dsv4_primitives.dispatch import triton_usable
from dsv4_primitives.fused_adamw import AdamWHyper, fused_adamw_step
from dsv4_train.kernel_choice import KernelChoice, check_fresh, convert_in_place
from dsv4_train.offload import MEGATRON_ADAM_FLAGS

# attribute of a main param: weakref to the FusedStepAdamW stepping it (for the deferred clip)
_OWNER_ATTR = "_dsv4_fused_step_owner"


class FusedStepAdamW(KernelChoice, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step()`` is one fused Triton pass (module doc); megatron's checkpoint format."""

    destinations: list  # per main param (param-group order): a callable giving its model-param view, or None
    clip_coefs: dict  # id(main param) -> deferred clip coefficient (float or device tensor) of this step
    wrote_model_params: bool

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError(
                "--optimizer-impl fused-step: step(closure) is not supported (megatron passes none)"
            )
        params, grads, exp_avgs, exp_avg_sqs, step_tensors, hypers, dsts, coefs = ([] for _ in range(8))
        all_stepped = True
        dest_iter = iter(self.destinations)
        for group in self.param_groups:
            hyper = AdamWHyper(float(group["lr"]), *group["betas"], group["eps"], group["weight_decay"])
            for p in group["params"]:
                dest = next(dest_iter)
                if p.grad is None:
                    all_stepped = False
                    continue
                state = self.state[p]
                if "step" not in state or state["step"].device.type != "cpu":
                    state["step"] = torch.tensor(float(state.get("step", 0.0)), dtype=torch.float32)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in state:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                step_tensors.append(state["step"])
                hypers.append(hyper)
                dsts.append(None if dest is None else dest())
                coefs.append(self.clip_coefs.pop(id(p), 1.0))
        self.clip_coefs.clear()
        if step_tensors:
            torch._foreach_add_(step_tensors, 1.0)  # CPU scalars, as torch's single-tensor AdamW
            steps = torch.stack(step_tensors).tolist()
            by_coef: dict = {}
            for i, c in enumerate(coefs):
                by_coef.setdefault(id(c) if torch.is_tensor(c) else float(c), (c, []))[1].append(i)
            for coef, idx in by_coef.values():
                fused_adamw_step(
                    [params[i] for i in idx],
                    [grads[i] for i in idx],
                    [exp_avgs[i] for i in idx],
                    [exp_avg_sqs[i] for i in idx],
                    [int(steps[i]) for i in idx],
                    [hypers[i] for i in idx],
                    [dsts[i] for i in idx],
                    _coef_tensor(coef, params[idx[0]].device),
                )
        self.wrote_model_params = all_stepped
        return None


def _coef_tensor(coef, device: torch.device) -> torch.Tensor:
    """The clip coefficient as a one-element fp32 tensor on ``device`` (host floats through pinned memory)."""
    if torch.is_tensor(coef):
        return coef.detach().float().reshape(1).to(device)
    host = torch.tensor([float(coef)], dtype=torch.float32)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _deferred_clip(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's ``clip_grad_by_total_norm_fp32``, deferred into the fused step for params a
    :class:`FusedStepAdamW` owns (module doc); megatron's own function for anything else."""
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    owners = [(getattr(p, _OWNER_ATTR, None) or (lambda: None))() for p in params]
    if use_decoupled_grad or not params or any(o is None for o in owners):
        return megatron_clip(parameters, max_norm, total_norm, use_decoupled_grad)
    coef = max_norm / (total_norm + 1.0e-6)
    if torch.is_tensor(coef):
        coef = coef.clamp_max(1.0)  # megatron's tensor path (clamp_max_), without touching its input
    elif not coef < 1.0:
        coef = 1.0  # megatron scales only when coef < 1
    for p, owner in zip(params, owners, strict=True):
        if p.grad is not None:
            owner.clip_coefs[id(p)] = coef
    return None


def install_deferred_clip() -> bool:
    """Route megatron's optimizer-module ``clip_grad_by_total_norm_fp32`` through :func:`_deferred_clip`
    (process-wide, idempotent); whether this call installed it."""
    if megatron_optimizer.clip_grad_by_total_norm_fp32 is _deferred_clip:
        return False
    megatron_optimizer.clip_grad_by_total_norm_fp32 = _deferred_clip
    return True


def remove_deferred_clip() -> None:
    """Put megatron's ``clip_grad_by_total_norm_fp32`` back."""
    if megatron_optimizer.clip_grad_by_total_norm_fp32 is _deferred_clip:
        megatron_optimizer.clip_grad_by_total_norm_fp32 = megatron_clip


def _refuse_unsupported(wrapper, inner) -> None:
    config, ddp_config = wrapper.config, getattr(wrapper, "ddp_config", None)
    why = None
    if type(inner) is not torch.optim.AdamW:
        why = f"megatron built {type(inner).__name__} (fused-step is AdamW with decoupled weight decay only)"
    elif any(
        g.get(k) for g in inner.param_groups for k in ("amsgrad", "maximize", "capturable", "differentiable")
    ):
        why = "a param group sets amsgrad / maximize / capturable / differentiable"
    elif config.use_precision_aware_optimizer or config.optimizer_cpu_offload:
        why = "megatron's precision-aware optimizer (or CPU offload) keeps its own master params"
    elif config.reuse_grad_buf_for_mxfp8_param_ag:
        why = "MXFP8 param-gather buffer reuse copies main params itself"
    elif ddp_config is not None and (
        ddp_config.fp8_param_gather or ddp_config.fp4_param_gather or ddp_config.use_megatron_fsdp
    ):
        why = "FP8 / FP4 param gather and Megatron-FSDP quantize or own the model params"
    else:
        bad = [p for g in inner.param_groups for p in g["params"] if not triton_usable(p)]
        if bad:
            why = (
                f"params on {bad[0].device} (the Triton kernel needs CUDA, or TRITON_INTERPRET=1 on the CPU)"
            )
    if why:
        raise ValueError(f"--optimizer-impl fused-step cannot apply: {why}; use --optimizer-impl auto")


def _distributed_destinations(wrapper) -> dict:
    """id(main shard) -> callable returning its slice of the bucket's ``param_data`` (megatron's copy target),
    cached per bucket ``param_data`` tensor."""
    out = {}
    groups = zip(
        wrapper.shard_fp32_from_float16_groups + wrapper.shard_fp32_groups,
        wrapper.model_float16_groups + wrapper.model_fp32_groups,
        strict=True,
    )
    for shard_group, model_group in groups:
        for shard, model_param in zip(shard_group, model_group, strict=True):
            world = wrapper._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
            gbuf_index, _, bucket_id = wrapper.model_param_gbuf_map[model_param]
            bucket = wrapper.buffers[gbuf_index].buckets[bucket_id]
            out[id(shard)] = _BucketSlice(bucket, world.start, world.end)
    return out


class _BucketSlice:
    """``bucket.param_data.view(-1)[start:end]``, rebuilt when the bucket's ``param_data`` changes."""

    def __init__(self, bucket, start: int, end: int):
        self.bucket, self.start, self.end = bucket, start, end
        self.source: torch.Tensor | None = None
        self.view: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        data = self.bucket.param_data
        if data is not self.source:
            self.source, self.view = data, data.view(-1)[self.start : self.end]
        return self.view


def _destinations(wrapper, inner) -> list:
    """Per main param of ``inner`` (group order): callable giving its model-param destination, or None."""
    by_id: dict = {}
    if hasattr(wrapper, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        by_id = _distributed_destinations(wrapper)
    elif hasattr(wrapper, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        for model_group, main_group in zip(
            wrapper.float16_groups, wrapper.fp32_from_float16_groups, strict=True
        ):
            for model_param, main_param in zip(model_group, main_group, strict=True):
                by_id[id(main_param)] = (lambda mp: lambda: mp.data)(model_param)
    dests = []
    for g in inner.param_groups:
        for p in g["params"]:
            dests.append(by_id.get(id(p)))
    return dests


def _copy_unless_written(wrapper, inner):
    original = type(wrapper)._copy_main_params_to_model_params

    def copy_main_params_to_model_params(self):
        if inner.wrote_model_params:
            inner.wrote_model_params = False  # once per kernel step
            return None
        return original(self)

    return types.MethodType(copy_main_params_to_model_params, wrapper)


def install_fused_step(wrapper) -> None:
    """Turn the fresh torch AdamW inside megatron's ``wrapper`` (a DistributedOptimizer, Float16 or FP32
    optimizer) into :class:`FusedStepAdamW` in place and wire the copy / clip (module doc)."""
    inner = wrapper.optimizer
    check_fresh(inner, "fused-step")
    _refuse_unsupported(wrapper, inner)
    convert_in_place(inner, FusedStepAdamW, MEGATRON_ADAM_FLAGS)
    for g in inner.param_groups:
        for p in g["params"]:
            setattr(p, _OWNER_ATTR, weakref.ref(inner))
    inner.destinations = _destinations(wrapper, inner)
    inner.clip_coefs = {}
    inner.wrote_model_params = False
    if hasattr(type(wrapper), "_copy_main_params_to_model_params"):
        wrapper._copy_main_params_to_model_params = _copy_unless_written(wrapper, inner)
    install_deferred_clip()


__all__ = ["FusedStepAdamW", "install_deferred_clip", "install_fused_step", "remove_deferred_clip"]
