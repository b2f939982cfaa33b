"""Fused learned top-k routing in one Triton kernel: scores, selection bias, top-k, normalised scaled weights.

Implements, per token row (reference: :func:`hash_moe.routing.topk_route`):

```
s   = score(z)                      # sqrtsoftplus | sigmoid | softmax, fp32
idx = topk(s + bias, K)             # K rounds of argmax (ties: lowest expert index)
w   = scale · s[idx] / Σ_k s[idx_k] # (or scale · s[idx] without normalisation); 0 on padding rows
```

The kernel reads the logits once and writes ``weights [N, K]``, ``experts [N, K]`` and ``scores [N, E]`` (the
balance loss needs them). The backward recomputes the routing in PyTorch from the saved logits and experts (cheap,
elementwise over ``[N, E]``), so gradients equal the reference's by construction of the formula.

Shape legend: ``N`` tokens, ``E`` experts, ``K`` experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hash_moe.scores import routing_scores

_SCORE_IDS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _topk_route_fwd_kernel(
    logits_ptr,
    bias_ptr,
    valid_ptr,
    weights_ptr,
    experts_ptr,
    scores_ptr,
    n_rows,
    n_experts,
    stride_row,
    scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SCORE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_VALID: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.arange(0, BLOCK_E)  # [BE]
    row_ok = rows < n_rows
    col_ok = cols < n_experts
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None].to(tl.int64) * stride_row + cols[None, :]
    z = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BT, BE]
    # s = score(z)
    if SCORE == 0:
        # softplus(z) = max(z, 0) + log(1 + exp(-|z|)), with log1p's series for tiny arguments
        x = tl.exp(-tl.abs(z))
        l1p = tl.where(x < 1e-4, x * (1.0 - 0.5 * x), tl.log(1.0 + x))
        s = tl.sqrt(tl.maximum(tl.maximum(z, 0.0) + l1p, 1.1754943508222875e-38))
    elif SCORE == 1:
        s = 1.0 / (1.0 + tl.exp(-z))
    else:
        # finite fill: rows past the end stay NaN-free
        zm = tl.where(mask, z, -1e30)
        ex = tl.where(mask, tl.exp(zm - tl.max(zm, axis=1)[:, None]), 0.0)
        s = ex / tl.maximum(tl.sum(ex, axis=1), 1e-30)[:, None]
    s = tl.where(mask, s, 0.0)
    tl.store(scores_ptr + rows[:, None].to(tl.int64) * n_experts + cols[None, :], s, mask=mask)
    # idx = topk(s + bias, K)
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sel = tl.where(mask, sel, float("-inf"))
    kcols = tl.arange(0, K_PAD)  # [KP]
    chosen = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.argmax(sel, axis=1)  # [BT]
        hit = cols[None, :] == best[:, None]
        val = tl.sum(tl.where(hit, s, 0.0), axis=1)  # [BT]
        chosen = tl.where(kcols[None, :] == k, val[:, None], chosen)
        ids = tl.where(kcols[None, :] == k, best[:, None].to(tl.int32), ids)
        sel = tl.where(hit, float("-inf"), sel)
    # w = scale * s[idx] / sum_k s[idx_k]
    if NORMALIZE:
        w = chosen / tl.maximum(tl.sum(chosen, axis=1), 1e-20)[:, None] * scale
    else:
        w = chosen * scale
    if HAS_VALID:
        keep = tl.load(valid_ptr + rows, mask=row_ok, other=0)
        w = tl.where(keep[:, None] != 0, w, 0.0)
    out_mask = row_ok[:, None] & (kcols[None, :] < K)
    out_offs = rows[:, None].to(tl.int64) * K + kcols[None, :]
    tl.store(weights_ptr + out_offs, w, mask=out_mask)
    tl.store(experts_ptr + out_offs, ids.to(tl.int64), mask=out_mask)


def _launch(logits, bias, valid, k, score_function, scale, normalize):
    n, e = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(n, k, device=logits.device, dtype=torch.float32)
    experts = torch.empty(n, k, device=logits.device, dtype=torch.int64)
    scores = torch.empty(n, e, device=logits.device, dtype=torch.float32)
    if n == 0:
        return weights, experts, scores
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(64, 4096 // block_e, triton.next_power_of_2(n)))
    grid = (triton.cdiv(n, block_t),)
    _topk_route_fwd_kernel[grid](
        logits,
        bias if bias is not None else logits,
        valid if valid is not None else logits,
        weights,
        experts,
        scores,
        n,
        e,
        logits.stride(0),
        float(scale),
        K=k,
        K_PAD=triton.next_power_of_2(k),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        SCORE=_SCORE_IDS[score_function],
        HAS_BIAS=bias is not None,
        HAS_VALID=valid is not None,
        NORMALIZE=normalize,
        num_warps=4,
    )
    return weights, experts, scores


class _FusedTopKRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, valid, k, score_function, scale, normalize):
        valid_u8 = valid.to(torch.uint8).contiguous() if valid is not None else None
        bias_f = bias.detach().float().contiguous() if bias is not None else None
        weights, experts, scores = _launch(
            logits.detach(), bias_f, valid_u8, k, score_function, scale, normalize
        )
        ctx.save_for_backward(logits, experts, valid)
        ctx.cfg = (score_function, scale, normalize)
        ctx.mark_non_differentiable(experts)
        return weights, experts, scores

    @staticmethod
    def backward(ctx, g_weights, _g_experts, g_scores):
        logits, experts, valid = ctx.saved_tensors
        score_function, scale, normalize = ctx.cfg
        with torch.enable_grad():
            z = logits.detach().float().requires_grad_()
            s = routing_scores(z, score_function)
            chosen = s.gather(1, experts)
            if normalize:
                chosen = chosen / chosen.sum(dim=-1, keepdim=True).clamp_min(1e-20)
            w = chosen * scale
            if valid is not None:
                w = w * valid.unsqueeze(-1)
            outs, grads = [], []
            for out, g in ((w, g_weights), (s, g_scores)):
                if g is not None:
                    outs.append(out)
                    grads.append(g)
            (dz,) = torch.autograd.grad(outs, z, grads) if outs else (torch.zeros_like(z),)
        return dz.to(logits.dtype), None, None, None, None, None, None


def fused_topk_route(
    logits: torch.Tensor,
    *,
    topk: int,
    score_function: str,
    scale: float,
    normalize: bool = True,
    selection_bias: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused routing: ``(weights [N, K] fp32, experts [N, K] int64, scores [N, E] fp32)``; differentiable in logits.

    Inputs are validated by the caller (:func:`hash_moe.routing.topk_route` with ``backend="triton"``).
    """
    return _FusedTopKRoute.apply(logits, selection_bias, valid, topk, score_function, scale, normalize)
