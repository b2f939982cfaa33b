"""MoE token permutation for the expert dispatch: megatron-core's order, without atomics, deterministic.

The routed ``(token, expert)`` pairs of ``routing_map [T, E]`` enumerated **expert-major, then by token** (the
order of megatron-core's unfused ``permute``) give the rows ``r = 0 .. R-1`` of the permuted tensors:

```
(e_r, t_r)         r-th True entry of routing_map.T, row-major          (rows past the routed count: empty)
x_perm[r]     = x[t_r]                       probs_perm[r] = probs[t_r, e_r]        # permute (0 for empty rows)
y[t]          = Σ_{r : t_r = t} y_perm[r]                                           # unpermute (fp32 sum)
backward:  dx[t] = Σ_{r : t_r = t} d x_perm[r]     d probs[t, e] = d probs_perm[row(t, e)]     d y_perm[r] = dy[t_r]
```

Every direction is a gather through a precomputed index map (:class:`PermuteMap`): the per-token sums read the
token's ``≤ K`` rows in expert order (``rows_of_token [T, K]``) and add them in fp32, so no output row is ever
accumulated by atomics. megatron's unfused path instead scatters (``index_add_`` in the backward of its
``index_select``, ``scatter_add_`` in ``unpermute``): atomics in the input dtype, non-deterministic on CUDA.
The forward of :func:`permute` equals megatron's bit for bit; :func:`unpermute` equals it up to the order and
precision of the sum (fp32 here, bf16 atomics there; identical in fp32 on CPU, where megatron adds in row order).
The maps come from running counts of the routing map and scatters to unique positions, without a sort
(:func:`build_permute_map`; two Triton launches on CUDA, :func:`permute_map_torch` as the reference).

Routing weights are *not* applied here: as in megatron's all-to-all dispatcher, ``probs_perm`` travels with the
rows and the experts multiply it in (:class:`hash_moe.megatron.ClampedSwiGLUExperts`, before ``w2``).
Padding tokens (all-False routing rows) get no rows and a zero output.

Shape legend: ``T`` tokens, ``E`` experts, ``K`` most experts per token, ``R`` permuted rows, ``H`` hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hash_moe.kernels.permute_triton import permute_map_triton
from hash_moe.row_gather import RowBackend, resolve_row_backend, row_gather, row_gather_sum

# widest routing map the Triton map kernels take (one row of E pairs per tile; sm_90: 223 registers, no spills, at
# E = 2048); wider maps (and maps of 2^31 pairs or more) take the PyTorch path
_TRITON_MAP_MAX_EXPERTS = 2048


@dataclass(frozen=True)
class PermuteMap:
    """Index maps of one permutation (all int64, ``-1`` = none); built by :func:`build_permute_map`.

    Attributes:
        token_of_row: ``[R]`` the token of each permuted row (megatron's ``sorted_indices``).
        pair_of_row: ``[R]`` the flat routing-map index ``t * E + e`` of each row.
        row_of_pair: ``[T, E]`` the row of each routed pair.
        rows_of_token: ``[T, K]`` each token's rows in expert order, then ``-1``.
    """

    token_of_row: torch.Tensor
    pair_of_row: torch.Tensor
    row_of_pair: torch.Tensor
    rows_of_token: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.token_of_row.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.row_of_pair.shape[0]

    @property
    def num_experts(self) -> int:
        return self.row_of_pair.shape[1]


def _check_routing_map(routing_map: torch.Tensor) -> None:
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
        raise ValueError(
            f"routing_map must be a [T, E] bool tensor, got {tuple(routing_map.shape)} {routing_map.dtype}"
        )


def build_permute_map(
    routing_map: torch.Tensor,
    num_out: int | None = None,
    *,
    max_routes_per_token: int | None = None,
    backend: RowBackend = "auto",
) -> PermuteMap:
    """Index maps of the expert-major permutation of ``routing_map [T, E]`` (no host sync when ``num_out`` is given).

    No sort: with ``c`` the running count of True entries of ``routing_map.T`` in row-major (expert-major) order,

    ```
    row_of_pair[t, e]   = c(e, t) - 1                    routed pairs with c(e, t) <= num_out, else -1
    pair_of_row[r]      = t * E + e  where r = row_of_pair[t, e]       (a scatter, unique rows; -1 elsewhere)
    token_of_row[r]     = pair_of_row[r] // E                          (-1 stays -1)
    rows_of_token[t, j] = row_of_pair[t, e]  where j = Σ_{e' <= e} routing_map[t, e'] - 1 < K   (a scatter; -1)
    ```

    (a token's rows increase with the expert, so its ``j``-th routed expert holds its ``j``-th row, and truncation
    by ``num_out`` drops a suffix of them).

    Args:
        routing_map: ``[T, E]`` bool; True = token ``t`` goes to expert ``e``.
        num_out: rows ``R`` of the permuted tensors (megatron's ``num_out_tokens``): normally the number of True
            entries; fewer drops the last pairs in permuted order (as megatron's truncation), more leaves empty
            rows at the end. ``None``: the number of True entries (one device-to-host sync).
        max_routes_per_token: ``K``, the most True entries in a row (megatron: ``moe_router_topk``); ``None`` = ``E``.
            Rows with more True entries are a ValueError on CPU tensors; on CUDA the check would need a host sync
            and is skipped (their extra pairs would get no gradient / output): pass ``None`` when unsure.
        backend: ``"triton"`` (two launches of :func:`hash_moe.kernels.permute_triton.permute_map_triton`; the
            PyTorch path for ``T * E = 0``, ``E > 2048`` or ``2^31`` pairs), ``"reference"`` (:func:`permute_map_torch`,
            17 small ops) or ``"auto"`` (Triton on CUDA); identical results.
    """
    _check_routing_map(routing_map)
    t, e = routing_map.shape
    if num_out is None:
        num_out = int(routing_map.sum())
    num_out = int(num_out)
    if num_out < 0:
        raise ValueError(f"num_out must be >= 0, got {num_out}")
    k = e if max_routes_per_token is None else int(max_routes_per_token)
    if k < 1:
        raise ValueError(f"max_routes_per_token must be >= 1 (or None = E), got {max_routes_per_token}")
    k = min(k, e)
    # the kernels count rows in int32 and take one row of experts per tile
    fits = t * e > 0 and e <= _TRITON_MAP_MAX_EXPERTS and t * (e + 1) + num_out < 2**31
    if resolve_row_backend(backend, routing_map, "hash_moe.build_permute_map") == "triton" and fits:
        maps = permute_map_triton(routing_map, num_out, k)
    else:
        maps = permute_map_torch(routing_map, num_out, k)
    pmap = PermuteMap(*maps)
    if k < e and not routing_map.is_cuda and bool(((pmap.row_of_pair >= 0).sum(1) > k).any()):
        raise ValueError(
            f"a routing-map row selects more than max_routes_per_token={k} experts; pass the router's top-k "
            "(or None)"
        )
    return pmap


def permute_map_torch(
    routing_map: torch.Tensor, num_out: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch path of :func:`build_permute_map` (the reference of the Triton kernels; no sort, no host sync).

    ``(token_of_row [R], pair_of_row [R], row_of_pair [T, E], rows_of_token [T, K])`` for ``R = num_out`` and
    ``1 <= K <= E`` (``K = 0`` only for ``E = 0``); rows of more than ``K`` routed pairs keep their first ``K``.
    """
    t, e = routing_map.shape
    dev, i64 = routing_map.device, torch.int64
    # running count of routed pairs in expert-major order: one scan over contiguous memory ([E, T] flattened; a
    # dim-0 scan of [T, E] is a slow strided kernel on CUDA). At a routed pair it is the pair's row + 1.
    routed = routing_map.t().reshape(-1)  # [E * T]
    count = routed.cumsum(0)  # [E * T]
    kept = routed & (count <= num_out)  # [E * T]: routed and inside the num_out rows
    row1 = (count * kept).view(e, t)  # [E, T]: row + 1 of each kept pair, 0 = none
    row_of_pair = torch.empty(t, e, device=dev, dtype=i64)
    torch.sub(row1, 1, out=row_of_pair.t())  # [T, E], written through the transposed view: no extra copy
    # pair_of_row: slot 0 of the buffer takes every non-kept pair (discarded); kept rows are unique
    pair_buf = torch.full((num_out + 1,), -1, device=dev, dtype=i64)
    pair_buf.index_put_((row1,), torch.arange(t * e, device=dev, dtype=i64).view(t, e).t())
    pair_of_row = pair_buf[1:]  # [R]
    token_of_row = pair_of_row // max(e, 1)  # [R] (floor division: -1 stays -1)
    # rows_of_token: the j-th routed expert of token t holds its j-th row (j = running count along the row - 1);
    # column 0 of the buffer takes the non-kept pairs and those past K
    slot1 = routing_map.cumsum(1)  # [T, E]: j + 1
    keep = kept.view(e, t).t()  # [T, E]
    if k < e:
        keep = keep & (slot1 <= k)
    rows_buf = torch.full((t, k + 1), -1, device=dev, dtype=i64)
    rows_buf.scatter_(1, slot1 * keep, row_of_pair)
    rows_of_token = rows_buf[:, 1:].contiguous()  # [T, K]
    return token_of_row, pair_of_row, row_of_pair, rows_of_token


def sorted_permute_map_ref(
    routing_map: torch.Tensor, num_out: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort-based oracle of :func:`build_permute_map` (hash-moe 0.3.0's first builder: a row sort and an argsort
    over ``T * E``): ``(token_of_row, pair_of_row, row_of_pair, rows_of_token)``; ``k`` already ``min(K, E)``."""
    t, e = routing_map.shape
    counts = routing_map.sum(0)
    none = t * e + num_out + 1  # sorts last, becomes -1
    before = routing_map.t().contiguous().cumsum(1).t()
    row = (counts.cumsum(0) - counts) + before - 1
    key = torch.where(routing_map & (row < num_out), row, none)
    by_token = key.sort(dim=1).values
    rows_of_token = by_token[:, :k].masked_fill(by_token[:, :k] == none, -1)
    row_of_pair = key.masked_fill(key == none, -1)
    n = min(num_out, t * e)
    flat = key.reshape(-1)
    pair_of_row = flat.argsort()[:n]
    pair_of_row = pair_of_row.masked_fill(flat[pair_of_row] == none, -1)
    pair_of_row = torch.cat([pair_of_row, pair_of_row.new_full((num_out - n,), -1)])
    token_of_row = torch.where(pair_of_row >= 0, pair_of_row // max(e, 1), -1)
    return token_of_row, pair_of_row, row_of_pair, rows_of_token


def permute(
    x: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out: int | None = None,
    *,
    max_routes_per_token: int | None = None,
    backend: RowBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None, PermuteMap]:
    """Expert-major permutation of the tokens (and of their routing weights), atomic-free in both directions.

    Args:
        x: ``[T, H]`` tokens.
        routing_map: ``[T, E]`` bool.
        probs: ``[T, E]`` routing weights or None.
        num_out: rows ``R`` (see :func:`build_permute_map`; None = routed count, with a host sync).
        max_routes_per_token: ``K`` (see :func:`build_permute_map`).
        backend: ``"triton"`` (kernels of :mod:`hash_moe.kernels.permute_triton`, for the map and the rows),
            ``"reference"`` or ``"auto"`` (Triton on CUDA).

    Returns:
        ``(x_perm [R, H], probs_perm [R] or None, PermuteMap)``; ``x_perm`` in ``x.dtype``, ``probs_perm`` in
        ``probs.dtype``; both differentiable (``dx`` summed over each token's rows in fp32).
    """
    _check_routing_map(routing_map)
    if x.dim() != 2 or x.shape[0] != routing_map.shape[0]:
        raise ValueError(
            f"x must be [T, H] with T = routing_map.shape[0] = {routing_map.shape[0]}, got {tuple(x.shape)}"
        )
    if probs is not None and probs.shape != routing_map.shape:
        raise ValueError(f"probs must be [T, E] = {tuple(routing_map.shape)}, got {tuple(probs.shape)}")
    pmap = build_permute_map(routing_map, num_out, max_routes_per_token=max_routes_per_token, backend=backend)
    x_perm = row_gather(x, pmap.token_of_row, pmap.rows_of_token, backend=backend)  # [R, H]
    probs_perm = None
    if probs is not None:
        pairs = probs.reshape(-1, 1)  # [T * E, 1]
        adjoint = pmap.row_of_pair.reshape(-1, 1)  # [T * E, 1]
        probs_perm = row_gather(pairs, pmap.pair_of_row, adjoint, backend=backend).reshape(-1)  # [R]
    return x_perm, probs_perm, pmap


def unpermute(
    y_perm: torch.Tensor,
    permute_map: PermuteMap,
    restore_shape: torch.Size | tuple[int, ...] | None = None,
    *,
    backend: RowBackend = "auto",
) -> torch.Tensor:
    """Inverse of :func:`permute`: each token's rows summed in fp32 (expert order), ``[R, H] -> [T, H]``.

    Args:
        y_perm: ``[R, H]`` rows in permuted order (e.g. the experts' outputs, routing weights already applied).
        permute_map: the map returned by :func:`permute`.
        restore_shape: output shape (``T * H`` elements, last dim ``H``); default ``[T, H]``.
        backend: see :func:`permute`.

    Returns:
        ``y`` in ``y_perm.dtype``; tokens without rows (padding) are zero. Backward: ``d y_perm[r] = dy[t_r]``.
    """
    if y_perm.dim() != 2 or y_perm.shape[0] != permute_map.num_rows:
        raise ValueError(
            f"y_perm must be [R, H] with R = {permute_map.num_rows} rows (the permutation's), got {tuple(y_perm.shape)}"
        )
    y = row_gather_sum(y_perm, permute_map.rows_of_token, permute_map.token_of_row, backend=backend)  # [T, H]
    if restore_shape is None:
        return y
    restore_shape = torch.Size(restore_shape)
    if restore_shape.numel() != y.numel() or restore_shape[-1] != y.shape[1]:
        raise ValueError(
            f"restore_shape {tuple(restore_shape)} does not hold [T, H] = {tuple(y.shape)} (last dim must be H)"
        )
    return y.view(restore_shape)


def permute_ref(
    x: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None, num_out: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference of :func:`permute` (autograd-traced, any dtype): ``x_perm[r] = x[t_r]``, ``probs_perm[r] =
    probs[t_r, e_r]`` for the True entries ``(e_r, t_r)`` of ``routing_map.T`` in row-major order, the first
    ``num_out`` of them, then zero rows up to ``num_out``."""
    experts, tokens = routing_map.t().nonzero(as_tuple=True)  # expert-major, then token order
    n = experts.numel() if num_out is None else num_out
    experts, tokens = experts[:n], tokens[:n]
    pad = n - tokens.numel()
    x_perm = torch.cat([x[tokens], x.new_zeros(pad, x.shape[1])])
    probs_perm = None if probs is None else torch.cat([probs[tokens, experts], probs.new_zeros(pad)])
    return x_perm, probs_perm


def unpermute_ref(y_perm: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`unpermute`: ``y[t] = Σ_{r : t_r = t} y_perm[r]`` over the rows of :func:`permute_ref`'s
    order (rows past the routed count ignored), summed in fp32 (fp64 for fp64) and returned in ``y_perm.dtype``."""
    _, tokens = routing_map.t().nonzero(as_tuple=True)
    n = min(tokens.numel(), y_perm.shape[0])
    acc = torch.promote_types(y_perm.dtype, torch.float32)
    y = torch.zeros(routing_map.shape[0], y_perm.shape[1], dtype=acc, device=y_perm.device)
    return y.index_add(0, tokens[:n], y_perm[:n].to(acc)).to(y_perm.dtype)
