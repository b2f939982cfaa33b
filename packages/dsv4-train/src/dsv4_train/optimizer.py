"""The trainer's optimizer: megatron-core's (distributed) mixed-precision optimizer on a fused torch AdamW.

What megatron-core 0.19.2 builds without transformer-engine or apex (``megatron/core/optimizer/__init__.py``: the
import of ``FusedAdam`` fails, ``USING_PYTORCH_OPTIMIZER = True``): for ``optimizer="adam"``,
``torch.optim.AdamW(param_groups, lr, weight_decay, betas, eps, capturable=config.optimizer_cuda_graph)``
(``torch.optim.Adam`` when ``decoupled_weight_decay=False``) with ``foreach`` and ``fused`` left ``None``, wrapped in
``DistributedOptimizer`` / ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer`` (and a ``ChainedOptimizer``).
torch then picks, per step, its multi-tensor ``foreach`` kernels on CUDA (about ten passes over params, grads and
moments; ~115 ms of a flash-smoke step at 3.24 B params) and the single-tensor loop on CPU. The wrappers only use
the inner optimizer through ``param_groups``, ``state``, ``step()``, ``state_dict()`` and ``load_state_dict()``.

:func:`build_optimizer` builds megatron's optimizer through its public API (with dsv4-primitives' keep-in-FP32
fix-ups) and :func:`set_adam_impl` pins the kernel of each wrapper's inner torch Adam:

    impl="fused"    torch's fused AdamW kernel (``fused=True``): one pass per tensor list (CUDA; CPU too)
    impl="foreach"  torch's multi-tensor kernels (``foreach=True``)
    impl="unfused"  megatron's optimizer untouched (torch's default: foreach on CUDA, single-tensor on CPU)
    impl="fused-step"  clip + AdamW + main -> bf16 model copy in one Triton pass (:mod:`dsv4_train.fused_step`;
                    CUDA, or the CPU under ``TRITON_INTERPRET=1``)
    impl="auto"     "fused" when the params live on CUDA, else "unfused" (CPU runs keep their exact numbers)

The inner optimizer is converted in place (its class becomes a kernel-pinned subclass, its groups' ``fused`` /
``foreach`` flags are set), right after megatron built it and before any state exists: every reference megatron
holds (the group dicts of ``opt_group_ranges``, the shards of native FP32 params) stays valid.

Checkpoint format: unchanged. The kernel choice is runtime configuration, not checkpoint state: the replacement's
``state_dict()`` writes the ``foreach`` / ``fused`` entries of its param groups as megatron's optimizer does
(``None``) and Adam's ``step`` as a CPU tensor (the fused kernel keeps it on the params' device), and its
``load_state_dict()`` keeps its own kernel choice over the saved one (torch's
``Optimizer.load_state_dict`` would otherwise adopt the saved groups' flags) and so moves the ``step`` tensors to
the params' device as the fused kernel needs. A checkpoint written with one impl loads into another.

Numerics: the same AdamW update, rounded differently. torch's single-tensor path computes ``p *= 1 - lr wd``,
``m = lerp(m, g, 1 - b1)``, ``v = b2 v + (1 - b2) g^2``, ``p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)`` as
separate fp32 tensor ops; the fused kernel evaluates the same expressions per element in fp32 registers in another
order (``b1 m + (1 - b1) g``, ``p -= lr wd p``, contracted multiply-adds). Each step's update therefore differs by a
few fp32 roundings of its own magnitude (``|u| <= lr * R``, ``R = |m_hat| / (sqrt(v_hat) + eps)`` is O(1) for
Adam), and the moments by a few roundings of theirs; nothing is amplified (the moments are contractions), so after
``N`` steps with the same gradients ``|p_fused - p_unfused| <= N * (c * eps32 * lr * R + ulp(p))`` elementwise
(``eps32 = 2**-23``; the tests use ``c = 32``; measured on CPU: below 6, ulps included). bf16 model params are the
rounding of those fp32 main params and may differ by one bf16 ulp where the main params straddle a rounding tie.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import ChainedOptimizer

from dsv4_primitives.megatron.multi_tensor import install_foreach_multi_tensor_ops
from dsv4_primitives.megatron.precision import get_megatron_optimizer_keep_fp32
from dsv4_train.config.sections import OPTIMIZER_IMPLS
from dsv4_train.fused_step import FusedStepAdamW, install_fused_step
from dsv4_train.kernel_choice import KernelChoice, check_fresh, convert_in_place
from dsv4_train.offload import check_cpu_offload, offload_distributed_optimizer

_KERNEL_FLAGS = {"fused": {"fused": True, "foreach": False}, "foreach": {"fused": False, "foreach": True}}


class KernelChoiceAdamW(KernelChoice, torch.optim.AdamW):
    """``torch.optim.AdamW`` with a pinned kernel (``fused`` / ``foreach``) and megatron's checkpoint format."""


class KernelChoiceAdam(KernelChoice, torch.optim.Adam):
    """``torch.optim.Adam`` (``decoupled_weight_decay`` as built) with a pinned kernel and megatron's format."""


def resolve_impl(impl: str, device: torch.device) -> str:
    """``impl`` with ``"auto"`` resolved for params on ``device`` (``"fused"`` on CUDA, else ``"unfused"``)."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"--optimizer-impl must be one of {OPTIMIZER_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "fused" if torch.device(device).type == "cuda" else "unfused"
    return impl


def _inner_wrappers(optimizer) -> list:

    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _pin_kernel(inner: torch.optim.Optimizer, impl: str) -> None:
    """Turn the fresh torch Adam ``inner`` into its kernel-pinned subclass in place (same object, same groups).

    In place, because megatron's groups hold tensors torch's constructor refuses (the distributed optimizer's
    shards of native FP32 params are views of leaves) and megatron keeps references to the group dicts."""
    check_fresh(inner, impl)
    flags = _KERNEL_FLAGS[impl]
    params = [p for g in inner.param_groups for p in g["params"]]
    if flags["fused"]:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        if inner.defaults["differentiable"]:
            raise ValueError("the fused Adam kernel does not support differentiable=True")
        supported = _get_fused_kernels_supported_devices()
        bad = [p for p in params if p.device.type not in supported or not p.is_floating_point()]
        if bad:
            raise ValueError(
                f"--optimizer-impl fused needs floating-point params on {supported}, got {bad[0].dtype} on "
                f"{bad[0].device}; use --optimizer-impl foreach or unfused"
            )
    convert_in_place(
        inner, KernelChoiceAdamW if type(inner) is torch.optim.AdamW else KernelChoiceAdam, flags
    )
    if flags["fused"]:
        inner._step_supports_amp_scaling = True  # what torch's constructor sets for fused=True


def set_adam_impl(optimizer, impl: str):
    """Give every torch Adam/AdamW inside megatron's ``optimizer`` the kernel ``impl`` (module doc); returns it.

    ``impl`` is ``"fused"``, ``"foreach"``, ``"fused-step"`` (:func:`dsv4_train.fused_step.install_fused_step`) or
    ``"unfused"`` (no change; resolve ``"auto"`` with :func:`resolve_impl` first). Wrappers whose inner optimizer is
    not torch's Adam (transformer-engine / apex ``FusedAdam``: fused already; SGD; the CPU-offload hybrid) are refused for an explicit kernel.
    """
    kernels = tuple(i for i in OPTIMIZER_IMPLS if i != "auto")
    if impl not in kernels:
        raise ValueError(f"optimizer impl must be one of {kernels} (resolve 'auto' first), got {impl!r}")
    if impl == "unfused":
        return optimizer
    for wrapper in _inner_wrappers(optimizer):
        inner = getattr(wrapper, "optimizer", None)
        if inner is None or getattr(wrapper, "is_stub_optimizer", False):
            continue  # a rank without trainable params of this kind
        if impl == "fused-step":
            install_fused_step(wrapper)
            continue
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            raise ValueError(
                f"--optimizer-impl {impl} selects a torch Adam kernel, but megatron built {type(inner).__name__} "
                "(transformer-engine/apex FusedAdam is fused already, other optimizers have no such kernel); "
                "use --optimizer-impl auto or unfused"
            )
        _pin_kernel(inner, impl)
    return optimizer


def build_optimizer(
    opt_config, model_chunks: list, *, impl: str = "auto", offload_chunk_numel: int | None = None, **kwargs
):
    """megatron-core's optimizer for ``model_chunks`` (``get_megatron_optimizer`` with the keep-in-FP32 fix-ups of
    dsv4-primitives) on the torch Adam kernel ``impl`` (``"auto"`` resolved from the first param's device).

    With ``opt_config.optimizer_cpu_offload`` (fields from :func:`dsv4_train.offload.offload_config_fields`)
    megatron's ``HybridDeviceOptimizer`` inside :class:`~dsv4_train.offload.DistributedOptimizerCpuOffload`
    (validated by :func:`~dsv4_train.offload.check_cpu_offload`; ``impl`` must be auto / unfused);
    ``offload_chunk_numel`` set: its host step pipelined in chunks of that many elements
    (:mod:`dsv4_train.offload_pipeline`, ``--optimizer-offload-overlap``).

    Installs :func:`dsv4_primitives.megatron.multi_tensor.install_foreach_multi_tensor_ops` (process-wide): without
    transformer-engine / apex, megatron's gradient norm synchronised with the host once per gradient tensor."""
    first = next((p for m in model_chunks for p in m.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    # gradient-norm / clipping / copies without a host sync per tensor (megatron's fallback without TE / apex)
    install_foreach_multi_tensor_ops()
    if opt_config.optimizer_cpu_offload:  # megatron's HybridDeviceOptimizer (dsv4_train.offload)
        check_cpu_offload(opt_config, impl=impl, params_on_cuda=first is not None and first.is_cuda)
        with offload_distributed_optimizer(offload_chunk_numel):
            return get_megatron_optimizer_keep_fp32(opt_config, model_chunks, **kwargs)
    if offload_chunk_numel is not None:
        raise ValueError(
            "--optimizer-offload-overlap only applies with --optimizer-cpu-offload; add that flag"
        )
    optimizer = get_megatron_optimizer_keep_fp32(opt_config, model_chunks, **kwargs)
    return set_adam_impl(optimizer, resolve_impl(impl, device))


__all__ = [
    "OPTIMIZER_IMPLS",
    "FusedStepAdamW",
    "KernelChoiceAdam",
    "KernelChoiceAdamW",
    "build_optimizer",
    "resolve_impl",
    "set_adam_impl",
]
