"""Plain per-token reference of one DeepSeek-V4 MoE block (§7.2-§7.3), used as the test oracle.

```
s   = score(u @ gate.T)                                          # [N, E] fp32 or fp64
idx = tid2eid[id]  (hash)   |   topk(s + bias, K)  (learned)
w   = scale · s[idx] / Σ_k s[idx_k];   w = 0 on padding tokens
y_t = Σ_k w_k · Expert_{idx_k}(u_t) + Shared(u_t)                 # Expert(u) = (silu(min(u w1ᵀ, L)) · clamp(u w3ᵀ, ±L)) w2ᵀ
```

Written as a loop over tokens with no grouped GEMM and no dispatch, so that it shares nothing with the fast path
but the formula. Runs in the dtype of its inputs (use float64 for oracles).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hash_moe.routing import RouterConfig


def _expert(u: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None) -> torch.Tensor:
    f = down.shape[1]
    a = u @ gate_up[:f].t()
    b = u @ gate_up[f:].t()
    if limit is not None:
        a = a.clamp(max=limit)
        b = b.clamp(min=-limit, max=limit)
    return (F.silu(a) * b) @ down.t()


def moe_reference(
    u: torch.Tensor,
    *,
    gate_weight: torch.Tensor,
    expert_gate_up: torch.Tensor,
    expert_down: torch.Tensor,
    cfg: RouterConfig,
    limit: float | None,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    selection_bias: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE output ``[N, H]`` for tokens ``u [N, H]`` (hash routing iff ``tid2eid`` is given).

    Args:
        gate_weight: ``[E, H]``; expert_gate_up: ``[E, 2F, H]``; expert_down: ``[E, H, F]``;
        shared_gate_up: ``[2F_s, H]``; shared_down: ``[H, F_s]`` (no shared expert when None).
        selection_bias: ``[E]`` learned-routing bias; token_ids ``[N]`` and tid2eid ``[V, K]`` for hash routing;
        valid: ``[N]`` bool padding mask (False = padding: no routed contribution).
    """
    logits = u @ gate_weight.t()
    if cfg.score_function == "sqrtsoftplus":
        s = F.softplus(logits).sqrt()
    elif cfg.score_function == "sigmoid":
        s = torch.sigmoid(logits)
    else:
        s = torch.softmax(logits, dim=-1)
    out = []
    for t in range(u.shape[0]):
        if tid2eid is not None:
            idx = tid2eid[int(token_ids[t])].long()
        else:
            sel = s[t] if selection_bias is None else s[t] + selection_bias.to(s.dtype)
            idx = sel.topk(cfg.topk).indices
        w = s[t, idx]
        if cfg.normalize_topk:
            w = w / w.sum()
        w = w * cfg.routed_scaling_factor
        y = torch.zeros_like(u[t])
        if valid is None or bool(valid[t]):
            for k in range(idx.numel()):
                e = int(idx[k])
                y = y + w[k] * _expert(u[t], expert_gate_up[e], expert_down[e], limit)
        if shared_gate_up is not None:
            y = y + _expert(u[t], shared_gate_up, shared_down, limit)
        out.append(y)
    return torch.stack(out) if out else u.new_zeros(0, u.shape[1])
