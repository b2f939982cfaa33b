"""The checkpoint side of ``--optimizer-impl``: a torch Adam / AdamW whose kernel is runtime configuration.

:class:`KernelChoice` (a mixin before ``torch.optim.Adam`` / ``AdamW``) writes megatron's format whatever kernel
runs: its ``state_dict()`` gives the param groups megatron's ``foreach`` / ``fused`` entries (``None``) and Adam's
``step`` as a CPU tensor (torch's fused kernel keeps it on the params' device); its ``load_state_dict()`` keeps the
subclass's ``kernel_flags`` over the saved ones (torch's ``Optimizer.load_state_dict`` would adopt the saved groups'
flags, and moves ``step`` to the params' device only for ``fused`` / ``capturable`` groups).
"""

from __future__ import annotations

import torch

from dsv4_train.offload import MEGATRON_ADAM_FLAGS


class KernelChoice:
    """Mixin for torch Adam / AdamW: the kernel flags are runtime configuration, not checkpoint state."""

    kernel_flags: dict

    def state_dict(self):
        sd = super().state_dict()
        for group in sd["param_groups"]:  # fresh dicts (torch packs them per call)
            group.update(MEGATRON_ADAM_FLAGS)
        # the fused kernel keeps Adam's step on the params' device: write it where torch's default keeps it (CPU)
        sd["state"] = {
            i: {**st, "step": st["step"].detach().cpu()} if torch.is_tensor(st.get("step")) else st
            for i, st in sd["state"].items()
        }
        return sd

    def load_state_dict(self, state_dict):
        groups = [{**g, **self.kernel_flags} for g in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})


def check_fresh(inner: torch.optim.Optimizer, impl: str) -> None:
    """``ValueError`` unless ``inner`` has no Adam state yet (a kernel choice converts a freshly built optimizer)."""
    if inner.state:
        raise ValueError(
            f"--optimizer-impl {impl} must be set on a freshly built optimizer (its Adam state is not empty)"
        )


def convert_in_place(inner: torch.optim.Optimizer, cls: type, flags: dict) -> None:
    """Make ``inner`` a ``cls`` (a :class:`KernelChoice` subclass) in place, its defaults and every param group
    carrying ``flags`` (the same object and group dicts: megatron keeps references to them)."""
    inner.__class__ = cls
    inner.defaults.update(flags)
    for g in inner.param_groups:
        g.update(flags)
    inner.kernel_flags = dict(flags)


__all__ = ["KernelChoice", "check_fresh", "convert_in_place"]
