"""Sync-free multi-tensor ops for megatron-core's optimizers when neither transformer-engine nor apex is installed
(issue 34: the optimizer step).

megatron-core 0.19.2 clips gradients and copies parameters through ``multi_tensor_applier(op, noop, lists, ...)``
with apex's / transformer-engine's fused ops. Without either it falls back to ``megatron.core.utils``'
``local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale``:

* the L2 norm calls ``torch.norm`` per tensor and then ``torch.tensor(list_of_cuda_scalars)``, which copies every
  per-tensor norm to the host one at a time: one device -> host synchronisation **per gradient tensor** (hundreds
  per step), each waiting for the norm kernel before it, so the norm of 3 B gradients runs as a serial chain of
  small kernels and host round trips; then ``float(...)`` syncs once more and the result goes back to the device;
* the scale computes ``dst.copy_(src * scale)`` per tensor: a temporary of every tensor's size and a second pass,
  also when ``src`` and ``dst`` are the same tensor (gradient clipping: ``[grads, grads]``).

The replacements compute the same values with torch's multi-tensor (``_foreach``) kernels and no host
synchronisation:

    l2norm:  ||g||_2 = sqrt(sum_i ||g_i||_2^2) = vector_norm(stack(_foreach_norm(g)))        (fp32 for fp32 grads)
    scale:   dst_i = src_i * s   in place (``_foreach_mul_``) when dst is src; else ``_foreach_copy_`` of
             ``_foreach_mul(src, s)`` (``_foreach_copy_`` alone for ``s == 1``): the same fp32 product rounded once
             into ``dst``'s dtype, as the fallback's ``copy_``.

Like the fallbacks (and unlike apex's kernels) neither sets ``noop_flag`` on non-finite values: megatron checks
those separately. Per-tensor norms (``per_tensor=True``) are returned stacked, as apex does.

:func:`install_foreach_multi_tensor_ops` puts them in place of the fallbacks in ``megatron.core.optimizer.clip_grads``
and ``megatron.core.optimizer.optimizer`` (only where the fallback is what megatron picked: transformer-engine's
or apex's ops are never replaced); idempotent, process-wide, undone by :func:`remove_foreach_multi_tensor_ops`.
"""

from __future__ import annotations

import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads as megatron_clip_grads
from megatron.core.optimizer import optimizer as megatron_optimizer


def foreach_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``multi_tensor_l2norm``: ``(total [1] fp32, per-tensor norms [N] or None)`` of
    ``tensor_lists[0]``, on the tensors' device, without a host synchronisation (``chunk_size``, ``noop_flag`` and
    further arguments are accepted for the interface and unused)."""
    tensors = list(tensor_lists[0])
    if not tensors:
        device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else "cpu"
        return torch.zeros(1, dtype=torch.float32, device=device), None
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])  # [N]
    total = torch.linalg.vector_norm(norms).reshape(1)  # [1]
    return total, (norms if per_tensor else None)


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``multi_tensor_scale``: ``dst_i = src_i * scale`` for ``tensor_lists = [src, dst]`` (in place
    when each ``dst_i`` is ``src_i``)."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if len(src) != len(dst):
        raise ValueError(f"multi_tensor_scale: {len(src)} source tensors but {len(dst)} destinations")
    if not src:
        return
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


# (module, attribute, megatron's fallback, replacement)
_SITES = (
    (megatron_clip_grads, "l2_norm_impl", megatron_utils.local_multi_tensor_l2_norm, foreach_l2norm),
    (megatron_clip_grads, "multi_tensor_scale_impl", megatron_utils.local_multi_tensor_scale, foreach_scale),
    (megatron_optimizer, "multi_tensor_scale_impl", megatron_utils.local_multi_tensor_scale, foreach_scale),
)


def install_foreach_multi_tensor_ops() -> list[str]:
    """Replace megatron's local multi-tensor fallbacks by :func:`foreach_l2norm` / :func:`foreach_scale` wherever
    megatron picked the fallback; returns the ``module.attribute`` names replaced by this call (empty when
    transformer-engine / apex ops are in use or the replacement is already installed)."""
    replaced = []
    for module, name, fallback, ours in _SITES:
        if getattr(module, name, None) is fallback:
            setattr(module, name, ours)
            replaced.append(f"{module.__name__}.{name}")
    return replaced


def remove_foreach_multi_tensor_ops() -> None:
    """Put megatron's fallbacks back where :func:`install_foreach_multi_tensor_ops` replaced them."""
    for module, name, fallback, ours in _SITES:
        if getattr(module, name, None) is ours:
            setattr(module, name, fallback)


__all__ = [
    "foreach_l2norm",
    "foreach_scale",
    "install_foreach_multi_tensor_ops",
    "remove_foreach_multi_tensor_ops",
]
