"""The aux-loss-free selection-bias step for a whole model, run **after** ``optimizer.step()``.

```python
loss.backward(); optimizer.step()
update_selection_biases(model, group=pg_collection.tp_dp_cp)   # sign(mean load - load) x speed, loads summed over group
```

``group`` must hold every rank that routed *different* tokens through the same routers (megatron: the tensor x
data x context parallel group, ``ProcessGroupCollection.tp_dp_cp``); pass ``None`` in a single process.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from hash_moe.balance import update_selection_bias_
from hash_moe.megatron.router import LearnedTopKRouter


def _routers(model: torch.nn.Module | Iterable[torch.nn.Module]) -> list[LearnedTopKRouter]:
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    return [
        m
        for c in chunks
        for m in c.modules()
        if isinstance(m, LearnedTopKRouter) and m.count_loads and m.training
    ]


@torch.no_grad()
def update_selection_biases(
    model: torch.nn.Module | Iterable[torch.nn.Module],
    *,
    group: dist.ProcessGroup | None,
    speed: float | None = None,
) -> int:
    """Update every learned router's ``e_score_correction_bias`` from its loads, then zero the loads.

    One all-reduce for all routers. Routers in eval mode, hash routers and routers built without
    ``moe_router_enable_expert_bias`` are left alone.

    Args:
        model: a module or a list of model chunks (virtual pipeline).
        group: process group over which the loads are summed (see the module docstring); None = no reduction.
        speed: update speed γ; default each router's ``moe_router_bias_update_rate``.

    Returns:
        The number of routers updated.
    """
    routers = _routers(model)
    if not routers:
        return 0
    speeds = {speed if speed is not None else r.bias_update_speed for r in routers}
    if len(speeds) != 1:
        raise ValueError(
            f"routers disagree on the bias update speed {sorted(speeds)}; pass speed= explicitly"
        )
    bias = torch.stack([r.e_score_correction_bias.float() for r in routers])  # [R, E]
    loads = torch.stack([r.local_tokens_per_expert.float() for r in routers])  # [R, E]
    update_selection_bias_(bias, loads, speeds.pop(), group=group)
    for r, b in zip(routers, bias):
        r.e_score_correction_bias.copy_(b)
        r.local_tokens_per_expert.zero_()
    return len(routers)
