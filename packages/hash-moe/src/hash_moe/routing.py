"""Token-to-expert routing (§7.2): learned top-k with an aux-loss-free selection bias, and hash routing.

Both routers turn gate logits into ``K`` expert ids and ``K`` weights per token:

```
s   = score(logits)                                   # [N, E] fp32 (scores.py)
idx = topk(s + bias, K)          (learned)            # bias changes WHICH experts are picked ...
idx = tid2eid[token_id]          (hash)               # ... or the token id fixes them
w   = s[idx] / Σ_k s[idx_k]      (normalize_topk)     # ... but the weights always come from the unbiased s
w   = w · routed_scaling_factor                       # Σ_k w_k = routed_scaling_factor (oracle E1)
```

Padding tokens (``valid == False``) get all-zero weights; :func:`dense_routing` gives them an all-False routing
map, so a dispatcher never sends them to an expert.

Shape legend: ``N`` tokens, ``E`` routed experts, ``K`` experts per token, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsv4_primitives.dispatch import resolve_backend
from hash_moe.kernels.routing_triton import fused_topk_route
from hash_moe.scores import ScoreFunction, check_score_function, routing_scores

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the fused router's logits (fp32 math)
_IDS_CHECKED = contextvars.ContextVar("hash_moe_token_ids_checked", default=False)


@contextlib.contextmanager
def token_ids_checked() -> Iterator[None]:
    """Inside the block, :func:`hash_route` skips its token-id range check (one host sync per call): for a caller
    that checked every id on the host already (cached decoding feeds host ints it validated)."""
    token = _IDS_CHECKED.set(True)
    try:
        yield
    finally:
        _IDS_CHECKED.reset(token)


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Routing hyper-parameters shared by the learned and the hash router.

    Attributes:
        num_experts: routed experts ``E`` (Flash 256, Pro 384).
        topk: experts per token ``K`` (6).
        score_function: ``"sqrtsoftplus"`` (V4), ``"sigmoid"`` (V3) or ``"softmax"``.
        routed_scaling_factor: multiplies the normalised weights (Flash 1.5, Pro 2.5).
        normalize_topk: divide the chosen scores by their sum (``norm_topk_prob``; true for V4).
    """

    num_experts: int
    topk: int
    score_function: ScoreFunction = "sqrtsoftplus"
    routed_scaling_factor: float = 1.0
    normalize_topk: bool = True

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"topk must be in [1, num_experts={self.num_experts}], got {self.topk}")
        check_score_function(self.score_function)
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(
                f"routed_scaling_factor must be finite and > 0, got {self.routed_scaling_factor}"
            )


@dataclass
class RoutingResult:
    """Routing decision of ``N`` tokens.

    Attributes:
        weights: ``[N, K]`` fp32 combine weights (zero rows for padding tokens).
        experts: ``[N, K]`` int64 expert ids (distinct per token).
        scores: ``[N, E]`` fp32 unbiased affinity scores (used by the balance loss).
        valid: ``[N]`` bool, False for padding tokens; ``None`` means all tokens are valid.
    """

    weights: torch.Tensor
    experts: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor | None = None


def _check_logits(logits: torch.Tensor, cfg: RouterConfig) -> None:
    if logits.dim() != 2 or logits.shape[1] != cfg.num_experts:
        raise ValueError(f"logits must be [N, num_experts={cfg.num_experts}], got {tuple(logits.shape)}")


def _check_valid(valid: torch.Tensor | None, n: int) -> None:
    if valid is not None and (valid.dtype != torch.bool or valid.shape != (n,)):
        raise ValueError(
            f"valid must be a bool tensor of shape [{n}], got {valid.dtype} {tuple(valid.shape)}"
        )


def _weights_from_scores(
    scores: torch.Tensor, experts: torch.Tensor, cfg: RouterConfig, valid: torch.Tensor | None
) -> torch.Tensor:
    chosen = scores.gather(1, experts)  # [N, K]
    if cfg.normalize_topk:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    weights = chosen * cfg.routed_scaling_factor
    if valid is not None:
        weights = weights * valid.unsqueeze(-1)
    return weights


def topk_route(
    logits: torch.Tensor,
    cfg: RouterConfig,
    *,
    selection_bias: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    backend: str = "auto",
) -> RoutingResult:
    """Learned top-k routing with an aux-loss-free selection bias.

    ``idx = topk(s + bias, K)``; ``w = scale · s[idx] / Σ_k s[idx_k]`` from the unbiased scores (oracle E3:
    the bias moves the selection, never the weights; a constant added to every bias entry changes nothing).

    Args:
        logits: ``[N, E]`` gate logits.
        cfg: routing hyper-parameters.
        selection_bias: ``[E]`` fp32 bias added for selection only (no gradient flows into it).
        valid: ``[N]`` bool, False marks padding tokens (zero weights).
        backend: ``"reference"`` (this function's PyTorch ops), ``"triton"``
            (the fused kernel of :mod:`hash_moe.kernels.routing_triton`, fp32 scores) or ``"auto"`` (Triton on CUDA
            for fp32/bf16/fp16 logits, PyTorch otherwise; ``HASH_MOE_BACKEND`` / ``DSV4_BACKEND`` override it, see
            :mod:`dsv4_primitives.dispatch`).
    """
    _check_logits(logits, cfg)
    _check_valid(valid, logits.shape[0])
    if selection_bias is not None and selection_bias.shape != (cfg.num_experts,):
        raise ValueError(
            f"selection_bias must be [num_experts={cfg.num_experts}], got {tuple(selection_bias.shape)}"
        )
    backend = resolve_backend(backend, logits, op="hash_moe.topk_route", triton_dtypes=_TRITON_DTYPES)
    if backend == "triton":
        weights, experts, scores = fused_topk_route(
            logits,
            topk=cfg.topk,
            score_function=cfg.score_function,
            scale=cfg.routed_scaling_factor,
            normalize=cfg.normalize_topk,
            selection_bias=selection_bias,
            valid=valid,
        )
        return RoutingResult(weights, experts, scores, valid)
    scores = routing_scores(logits, cfg.score_function)  # [N, E]
    with torch.no_grad():
        select = scores if selection_bias is None else scores + selection_bias.float()
        experts = select.topk(cfg.topk, dim=-1).indices  # [N, K]
    return RoutingResult(_weights_from_scores(scores, experts, cfg, valid), experts, scores, valid)


def hash_route(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    cfg: RouterConfig,
    *,
    valid: torch.Tensor | None = None,
) -> RoutingResult:
    """Hash routing: the experts of a token are ``tid2eid[token_id]``; the weights come from its gate scores.

    ``idx = tid2eid[id]``; ``w = scale · s[idx] / Σ_k s[idx_k]`` (oracle E2: the ids depend on the token id only,
    not on the context or the gate weights). No selection bias.

    Args:
        logits: ``[N, E]`` gate logits.
        token_ids: ``[N]`` integer token ids in ``[0, V)`` (padding tokens may carry any in-range id).
        tid2eid: ``[V, K]`` integer table of distinct expert ids per token id.
        cfg: routing hyper-parameters (``cfg.topk`` must equal ``K``).
        valid: ``[N]`` bool, False marks padding tokens (zero weights).
    """
    _check_logits(logits, cfg)
    n = logits.shape[0]
    _check_valid(valid, n)
    if tid2eid.dim() != 2 or tid2eid.shape[1] != cfg.topk:
        raise ValueError(f"tid2eid must be [vocab, topk={cfg.topk}], got {tuple(tid2eid.shape)}")
    if token_ids.shape != (n,) or token_ids.dtype.is_floating_point:
        raise ValueError(
            f"token_ids must be an integer tensor of shape [{n}] (one id per token), got "
            f"{token_ids.dtype} {tuple(token_ids.shape)}"
        )
    ids = token_ids.long()
    if not _IDS_CHECKED.get():
        _check_token_id_range(
            ids, tid2eid.shape[0], asynchronous=ids.is_cuda and torch.cuda.is_current_stream_capturing()
        )
    scores = routing_scores(logits, cfg.score_function)  # [N, E]
    experts = tid2eid.to(device=logits.device)[ids].long()  # [N, K]
    return RoutingResult(_weights_from_scores(scores, experts, cfg, valid), experts, scores, valid)


def _check_token_id_range(ids: torch.Tensor, vocab: int, *, asynchronous: bool = False) -> None:
    """``0 <= id < vocab`` for every id: a ValueError naming the range (one host sync), or with ``asynchronous``
    (used while a CUDA graph is captured: no host reads are allowed there and the check must run at every replay)
    an asynchronous device-side assert."""
    if ids.numel() == 0:
        return
    if asynchronous:
        torch._assert_async(
            ((ids >= 0) & (ids < vocab)).all(), f"hash routing: token ids must lie in [0, vocab={vocab})"
        )
        return
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one host sync
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in [0, vocab={vocab}); got range [{lo}, {hi}]")


def dense_routing(result: RoutingResult, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter a routing decision into megatron's dense layout.

    Returns:
        probs: ``[N, E]`` fp32 weights (zero off the chosen experts and on padding rows; differentiable).
        routing_map: ``[N, E]`` bool, True where a token is sent to an expert; all-False rows for padding
        tokens, so they are never dispatched.
    """
    n = result.experts.shape[0]
    probs = result.weights.new_zeros(n, num_experts).scatter(1, result.experts, result.weights)
    routing_map = torch.zeros(n, num_experts, dtype=torch.bool, device=result.experts.device)
    routing_map.scatter_(1, result.experts, True)
    if result.valid is not None:
        routing_map &= result.valid.unsqueeze(-1)
    return probs, routing_map
