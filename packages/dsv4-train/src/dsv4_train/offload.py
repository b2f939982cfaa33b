"""Optimizer CPU offload through megatron-core 0.19.2's ``HybridDeviceOptimizer`` (``dsv4 train
--optimizer-cpu-offload [--optimizer-offload-fraction F]``).

What megatron builds (``megatron/core/optimizer/__init__.py`` and ``cpu_offloading/hybrid_optimizer.py``): with
``OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=F, use_precision_aware_optimizer=True,
use_distributed_optimizer=True)`` the distributed optimizer's inner optimizer is a ``HybridDeviceOptimizer`` over
this rank's param *shards* (bf16 shards of the model's param buffer; native FP32 params' shards). It walks the
shards in group order and moves the first ones, up to ``F`` of the GPU elements, to pinned host memory: an fp32
master copy, Adam's ``exp_avg`` / ``exp_avg_sq`` and a pinned gradient buffer live on the host, and torch's
CPU ``AdamW(fused=True)`` updates them there; the remaining shards get an fp32 master copy on the GPU and torch's
``AdamW(fused=True)`` on the GPU. After each sub-optimizer step the updated fp32 masters are written back into the
model's (bf16) param buffer. Per trained parameter the GPU keeps the bf16 param and the fp32 gradient buffer
(6 bytes) and, for the part not offloaded, 12 bytes of fp32 master + moments; the offloaded part costs 12 bytes of
pinned host memory plus 4 bytes of pinned gradient copy. At ``F = 1`` that is 3.24 B x 12 B = 39 GB less on the
GPU for the flash-smoke model (the whole static 64 GiB becomes ~20 GiB), paid with a host round trip of the
gradients (4 B/param D2H) and params (4 B/param H2D) and a CPU Adam step each step.

Why ``use_precision_aware_optimizer``: the hybrid optimizer keeps the fp32 masters itself
(``param_update_in_fp32``); megatron's own training arguments require the flag with the offload for that reason
(without it the distributed optimizer would also keep its fp32 main shards on the GPU, and the offload would save
only the moments).

Megatron-core 0.19.2 problems with *native FP32 params* (our keep-in-FP32 params: mHC, sinks, router bias) are
fixed by :class:`DistributedOptimizerCpuOffload` (both appear only for models mixing bf16 and FP32 params or FP32
models; megatron's offload was written for all-bf16 models):

1. A native FP32 param's shard is ``model_param.view(-1)[range]``, a non-leaf view of a leaf that requires grad.
   Megatron's ordinary path assigns it into the inner optimizer's groups directly, but the hybrid optimizer is
   *constructed* from the groups, and ``torch.optim.Optimizer`` refuses it ("can't optimize a non-leaf Tensor").
   The subclass uses a detached view instead: the same storage (updates land in the model param), not a leaf of
   the autograd graph, with the same tensor-parallel / optimizer attributes.
2. In precision-aware mode the distributed optimizer hands gradients over as ``shard.decoupled_grad``; the hybrid
   optimizer copies them into its fp32 masters for bf16 shards and into its host buffers for offloaded shards, but
   an FP32 shard that stays on the GPU is its own master and is given no ``.grad``, so torch's Adam would skip it
   silently (no update at ``F < 1``). The subclass sets ``.grad = decoupled_grad`` for those shards.

Two more, in megatron's checkpoint load path of the hybrid optimizer (a class swap of the built
``HybridDeviceOptimizer``, no new state):

3. ``_update_fp32_params_by_new_state`` copies each loaded ``master_param`` into ``param_to_fp32_param[param]``,
   which only bf16 params have (``KeyError`` for a native FP32 param); the fix writes a native FP32 param's loaded
   master into its inner param (its host copy when offloaded, itself otherwise). ``update_fp32_param_by_new_param``
   likewise refreshes the host copies of native FP32 params.
4. ``_move_new_state_to_right_device`` moves the state of every sub-optimizer that ``isinstance`` of the CPU
   optimizer class to the CPU and the rest to CUDA; without transformer-engine/apex both classes are torch's
   ``AdamW``, so after a load the device part's Adam state would land on the host. The fix puts each state tensor
   on its param's device.

5. Its param groups carry its runtime configuration (``fused=True``, the offload fraction, the optimizer *classes*)
   into the checkpoint, and a load adopts the saved groups' ``fused`` / ``foreach``: a checkpoint written
   without the offload would switch the host Adam to torch's unfused kernel. The fix writes the groups as the
   plain optimizer does (those keys dropped, ``fused`` / ``foreach`` ``None``) and keeps its own on load.

And megatron's load allocates the hybrid optimizer's state with ``dummy_step()`` (random gradients, a real step)
whose copy-back writes perturbed values into this rank's shards of the model params: a model loaded before the
optimizer would resume from them. :meth:`DistributedOptimizerCpuOffload.load_state_dict` restores the shards after
that step.

Checkpoints: the same sharded format as without the offload (``param``, ``exp_avg``, ``exp_avg_sq`` per param in
fp32; the step in the param groups, per-param steps not persistent): an offloaded run resumes without the offload
and vice versa (tested, bitwise on CPU).

``--optimizer-offload-overlap`` (:mod:`dsv4_train.offload_pipeline`): the hybrid optimizer's step with its host
part pipelined in chunks (D2H, CPU AdamW and H2D overlapping; the fp32 masters pinned, also after a checkpoint
load rebuilds them), bitwise the same step and checkpoints; :func:`offload_distributed_optimizer` with
``pipeline_chunk_numel`` turns it on (no new state: the pipeline is an attribute of the class-swapped optimizer).

Refused with the reason (:func:`check_cpu_offload`): without the distributed optimizer (megatron's precision-aware
path needs it), with a non-Adam optimizer or without decoupled weight decay (megatron asserts AdamW mode), with
``--optimizer-impl fused|foreach`` (the hybrid optimizer has its own torch AdamW(fused=True) on both sides), with
``--cuda-graph`` (the host step cannot be captured) and with params on the CPU (nothing to offload; megatron's
hybrid optimizer indexes its host copies by GPU param and fails on CPU params).
"""

from __future__ import annotations

import contextlib

import megatron.core.optimizer as mcore_optimizer
import torch
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from dsv4_primitives.megatron.precision import DistributedOptimizerWithNativeFP32Params
from dsv4_train.offload_pipeline import OffloadPipeline

#: what megatron's torch Adam carries in its param groups (the kernel flags are runtime configuration)
MEGATRON_ADAM_FLAGS = {"fused": None, "foreach": None}


def check_cpu_offload(opt_config, *, impl: str, params_on_cuda: bool) -> None:
    """Refuse offload settings megatron-core 0.19.2 cannot run (module doc), one ``ValueError`` with the fix."""
    if not opt_config.optimizer_cpu_offload:
        return
    fraction = opt_config.optimizer_offload_fraction
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be in (0, 1], got {fraction}")
    if not opt_config.use_distributed_optimizer:
        raise ValueError(
            "optimizer CPU offload needs the distributed optimizer (megatron-core's hybrid optimizer runs on its "
            "precision-aware path); set use_distributed_optimizer=True"
        )
    if not opt_config.use_precision_aware_optimizer:
        raise ValueError(
            "optimizer CPU offload runs on megatron-core's precision-aware path (the hybrid optimizer keeps the "
            "fp32 masters); set use_precision_aware_optimizer=True (offload_config_fields does)"
        )
    if opt_config.optimizer != "adam" or not opt_config.decoupled_weight_decay:
        raise ValueError(
            "optimizer CPU offload supports AdamW only (megatron-core asserts decoupled_weight_decay with adam), "
            f"got optimizer={opt_config.optimizer!r}, decoupled_weight_decay={opt_config.decoupled_weight_decay}"
        )
    if impl not in ("auto", "unfused"):
        raise ValueError(
            f"--optimizer-impl {impl} picks the kernel of megatron's torch AdamW, but with --optimizer-cpu-offload "
            "megatron's hybrid optimizer uses its own torch AdamW(fused=True) on the host and on the GPU; "
            "use --optimizer-impl auto"
        )
    if not params_on_cuda:
        raise ValueError(
            "--optimizer-cpu-offload moves optimizer state from the GPU to host memory, but the model is on the "
            "CPU (megatron-core's hybrid optimizer needs CUDA params); drop the flag on CPU"
        )


def offload_config_fields(fraction: float) -> dict:
    """The ``OptimizerConfig`` fields of the offload at ``fraction`` (module doc)."""
    return {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": fraction,
        "use_precision_aware_optimizer": True,  # the hybrid optimizer keeps the fp32 masters itself
        "overlap_cpu_optimizer_d2h_h2d": False,  # one CPU Adam over all offloaded shards (fused kernel)
        "pin_cpu_grads": True,
        "pin_cpu_params": True,
    }


# what megatron's HybridDeviceOptimizer adds to its param groups (its constructor's defaults): runtime
# configuration, not checkpoint state
_HYBRID_ONLY_KEYS = (
    "offload_fraction",
    "cpu_optimizer_cls",
    "gpu_optimizer_cls",
    "param_update_in_fp32",
    "pin_cpu_grads",
    "pin_cpu_params",
    "overlap_cpu_optimizer_d2h_h2d",
    "bias_correction",
)


def _hybrid_device_optimizer_native_fp32():

    class HybridDeviceOptimizerNativeFP32(HybridDeviceOptimizer):
        """megatron's hybrid optimizer with fixes 3, 4 and 5 of the module doc (no new state: a class swap); with
        ``pipeline`` set, its step is :class:`~dsv4_train.offload_pipeline.OffloadPipeline`'s."""

        pipeline: OffloadPipeline | None = None

        def enable_pipeline(self, pipeline: OffloadPipeline) -> None:
            self.pipeline = pipeline
            pipeline.pin_host_masters(self)

        def step(self, closure=None):
            if self.pipeline is None:
                return super().step(closure)
            if closure is not None:
                raise ValueError(
                    "the offload pipeline takes no closure; run without --optimizer-offload-overlap"
                )
            self.pipeline.step(self)
            return None

        def _init_sub_optimizers(self):
            super()._init_sub_optimizers()  # also after a checkpoint load: new host masters
            if self.pipeline is not None:
                self.pipeline.pin_host_masters(self)

        def settle(self) -> None:
            """Wait for a deferred host step (:mod:`dsv4_train.offload_defer`) before the state is read or
            written."""
            if self.pipeline is not None:
                self.pipeline.settle()

        def state_dict(self):
            self.settle()
            sd = super().state_dict()
            sub_defaults = self.sub_optimizers[0].defaults if self.sub_optimizers else {}
            for group in sd["param_groups"]:  # fix 5: the plain optimizer's groups (no runtime configuration)
                for key in _HYBRID_ONLY_KEYS:
                    group.pop(key, None)
                for (
                    key,
                    value,
                ) in sub_defaults.items():  # torch AdamW's own group keys (amsgrad, maximize, ...)
                    group.setdefault(key, value)
                group.update(MEGATRON_ADAM_FLAGS)
            return sd

        def load_state_dict(self, state_dict):
            self.settle()
            own = [
                {k: g[k] for k in (*_HYBRID_ONLY_KEYS, *MEGATRON_ADAM_FLAGS) if k in g}
                for g in self.param_groups
            ]
            groups = [{**saved, **mine} for saved, mine in zip(state_dict["param_groups"], own, strict=True)]
            super().load_state_dict({**state_dict, "param_groups": groups})

        def _update_fp32_params_by_new_state(self):
            if not self.param_update_in_fp32:
                return
            for (
                param,
                v,
            ) in self.state.items():  # fix 3: native FP32 params have no fp32 copy, only a host one
                target = self.param_to_fp32_param.get(param, self.param_to_inner_param[param])
                if target is not v["master_param"]:
                    target.data.copy_(v["master_param"])

        def update_fp32_param_by_new_param(self):
            for param, inner in self.param_to_inner_param.items():
                if inner is not param:
                    inner.data.copy_(param)

        def _move_new_state_to_right_device(self):
            for optimizer in self.sub_optimizers:  # fix 4: each state tensor beside its param
                for param, state in optimizer.state.items():
                    orig = self.inner_param_to_orig_param.get(param, param)
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            self.state[orig][k] = state[k] = v.to(param.device)

    return HybridDeviceOptimizerNativeFP32


class DistributedOptimizerCpuOffload(DistributedOptimizerWithNativeFP32Params):
    """The keep-in-FP32 distributed optimizer over megatron's ``HybridDeviceOptimizer``, with the two native-FP32
    fixes of the module doc; with ``pipeline_chunk_numel`` set (``--optimizer-offload-overlap``), the host step of
    :mod:`dsv4_train.offload_pipeline`."""

    #: chunk size of the pipelined host step; None: megatron's step
    pipeline_chunk_numel: int | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.is_stub_optimizer:
            self.optimizer.__class__ = _hybrid_device_optimizer_native_fp32()
            if self.pipeline_chunk_numel is not None:
                self.optimizer.enable_pipeline(OffloadPipeline(self.pipeline_chunk_numel))

    @classmethod
    def _build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = super()._build_model_and_main_param_groups(
            gbuf_ranges, param_gbuf_map, opt_group_ranges, config
        )
        shard_fp32_groups = groups[3]
        for group_range, shards in zip(opt_group_ranges, shard_fp32_groups, strict=True):
            detached = []
            for shard in shards:  # fix 1: same storage, not a non-leaf view of a grad-requiring leaf
                d = shard.detach()
                d.__dict__.update(shard.__dict__)  # tensor-parallel and optimizer-metadata attributes
                detached.append(d)
            ids = {id(s): d for s, d in zip(shards, detached, strict=True)}
            params = group_range["orig_group"]["params"]
            group_range["orig_group"]["params"] = [ids.get(id(p), p) for p in params]
            shards[:] = detached
        return groups

    def _copy_model_grads_to_main_grads(self):
        super()._copy_model_grads_to_main_grads()
        if self.is_stub_optimizer:
            return
        offloaded = self.optimizer.gpu_params_map_cpu_copy
        for shards in self.shard_fp32_groups:  # fix 2: GPU-resident FP32 shards are their own masters
            for shard in shards:
                if shard not in offloaded:
                    shard.grad = getattr(shard, "decoupled_grad", None)

    def prepare_grads(self) -> bool:
        if not self.is_stub_optimizer:  # a deferred host step still copying the grads down is finished before
            self.optimizer.settle()  # they are read and clipped again (dsv4_train.offload_defer)
        return super().prepare_grads()

    def state_dict(self):
        if not self.is_stub_optimizer:
            self.optimizer.settle()  # a deferred host step (dsv4_train.offload_defer) is finished first
        return super().state_dict()

    def sharded_state_dict(self, *args, **kwargs):
        if not self.is_stub_optimizer:
            self.optimizer.settle()
        return super().sharded_state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict):
        """megatron's load, without its side effect on the model: to allocate the hybrid optimizer's state it runs
        ``dummy_step()`` (random gradients, one real AdamW step) whose copy-back hooks write the stepped masters
        into this rank's shards of the model params, so a model loaded *before* the optimizer (our checkpoint
        order) would start from perturbed weights. The shards are restored right after that step."""
        hdo = self.optimizer
        if not self.is_stub_optimizer:
            hdo.settle()
        if not self.is_stub_optimizer and len(hdo.state) == 0:
            shards = [p for g in hdo.param_groups for p in g["params"]]
            saved = [p.detach().clone() for p in shards]
            hdo.dummy_step()
            hdo.settle()  # a deferred host step (dsv4_train.offload_defer) writes its params now, not later
            with torch.no_grad():
                for p, s in zip(shards, saved, strict=True):
                    p.copy_(s)
        super().load_state_dict(state_dict)


@contextlib.contextmanager
def offload_distributed_optimizer(pipeline_chunk_numel: int | None = None):
    """While active, megatron's ``get_megatron_optimizer`` builds :class:`DistributedOptimizerCpuOffload` where
    it would build ``DistributedOptimizer`` (it looks the class up in its module's namespace); with
    ``pipeline_chunk_numel``, its hybrid optimizer steps through :class:`~dsv4_train.offload_pipeline.OffloadPipeline`
    in chunks of that many elements."""

    cls = DistributedOptimizerCpuOffload
    if pipeline_chunk_numel is not None:
        OffloadPipeline(pipeline_chunk_numel)  # refuse a bad chunk size before megatron builds anything
        cls = type(cls.__name__, (cls,), {"pipeline_chunk_numel": pipeline_chunk_numel})
    saved = mcore_optimizer.DistributedOptimizer
    mcore_optimizer.DistributedOptimizer = cls
    try:
        yield
    finally:
        mcore_optimizer.DistributedOptimizer = saved


def hybrid_optimizers(optimizer) -> list:
    """The ``HybridDeviceOptimizer`` inside each (chained) wrapper of ``optimizer`` (empty without the offload)."""

    wrappers = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [w.optimizer for w in wrappers if isinstance(getattr(w, "optimizer", None), HybridDeviceOptimizer)]


def offloaded_numel(optimizer) -> tuple[int, int]:
    """(elements whose master + Adam state live on the host, elements trained) over ``optimizer``'s shards."""
    host = total = 0
    for hdo in hybrid_optimizers(optimizer):
        host += sum(p.numel() for p in hdo.gpu_params_map_cpu_copy)
        total += sum(p.numel() for g in hdo.param_groups for p in g["params"])
    return host, total


__all__ = [
    "DistributedOptimizerCpuOffload",
    "check_cpu_offload",
    "hybrid_optimizers",
    "offload_config_fields",
    "offload_distributed_optimizer",
    "offloaded_numel",
]
