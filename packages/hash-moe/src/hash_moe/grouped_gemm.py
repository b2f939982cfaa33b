"""Grouped expert GEMM: rows sorted by expert, one weight matrix per expert.

```
out[rows of group g] = x[rows of group g] @ w[g].T          x: [M, K], w: [G, N, K] (nn.Linear layout), out: [M, N]
```

Backends (forward and backward give the same results):

- ``"grouped_mm"``: ``torch._grouped_mm`` (CUTLASS grouped GEMM on Hopper; bf16 with 16-byte aligned ``K``/``N``;
  on CPU it also runs in fp32). Groups whose row counts are not 16-byte multiples are padded with zero rows.
- ``"loop"``: ``torch.split`` + one matmul per group (any device and dtype), the reference (``"reference"`` is a
  synonym).
- ``"auto"``: ``"grouped_mm"`` on CUDA when the dtype is bf16 and ``K``, ``N`` are multiples of 8, else ``"loop"``.

Row counts may be host values (a list, or a CPU tensor: megatron's dispatcher copies them to the host at its sync
point; they must sum to ``M``) or a tensor on the rows' (CUDA) device. Device counts never reach the host with the
``"grouped_mm"`` backend (no synchronisation, CUDA-graph capturable): it pads into a buffer of the static worst-case size
``M + G·(align − 1)`` and finds the group offsets on the device. Device counts may sum to less than ``M``: the rows
past the last group are filler (a static-size permutation of a batch with padding tokens) and come out as zeros.
Their sum is trusted not to exceed ``M`` (checking would need the host).

Shape legend: ``M`` rows, ``G`` groups (local experts), ``K`` input width, ``N`` output width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from dsv4_primitives.dispatch import normalize_backend
from dsv4_primitives.recompute import discard_derived
from hash_moe.row_gather import row_gather

GroupedBackend = Literal["auto", "grouped_mm", "loop", "reference"]
GROUPED_BACKENDS = ("auto", "grouped_mm", "loop")


def _counts_list(tokens_per_group: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(tokens_per_group, torch.Tensor):
        return [int(c) for c in tokens_per_group.tolist()]
    return [int(c) for c in tokens_per_group]


def resolve_backend(backend: GroupedBackend, x: torch.Tensor, w: torch.Tensor) -> str:
    """The backend :func:`grouped_mm` uses for these operands."""
    backend = normalize_backend(
        backend,
        "hash_moe.grouped_mm",
        GROUPED_BACKENDS,
        aliases={"reference": "loop"},
    )
    if backend != "auto":
        return backend
    aligned = x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0  # 16-byte rows in bf16
    if x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and aligned:
        return "grouped_mm"
    return "loop"


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Reference grouped GEMM: one ``x_g @ w[g].T`` per group (``torch.split``).

    The per-group weights come from ``w.unbind(0)``, whose backward stacks the ``G`` weight gradients once. Indexing
    ``w[g]`` instead would make every group's backward allocate and accumulate a zero-filled gradient of the whole
    ``[G, N, K]`` tensor: ``O(G·|w|)`` memory traffic (seconds per backward at 256 experts of DSv4 size).
    """
    outs = [xg @ wg.t() for xg, wg in zip(torch.split(x, counts), w.unbind(0))]
    if not outs:
        return x.new_zeros(0, w.shape[1])
    return torch.cat(outs, dim=0)


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_group: torch.Tensor | Sequence[int],
    *,
    backend: GroupedBackend = "auto",
) -> torch.Tensor:
    """Grouped GEMM ``[M, K] x [G, N, K] -> [M, N]``; rows ``[o_g, o_g + c_g)`` use ``w[g]``.

    Args:
        x: ``[M, K]`` rows sorted by group.
        w: ``[G, N, K]`` per-group weights in ``nn.Linear`` layout (out x in).
        tokens_per_group: ``[G]`` row counts ``c_g`` (summing to ``M``; zeros allowed). A tensor on ``x``'s CUDA
            device may sum to less than ``M`` (filler rows at the end, zero output); with the ``"grouped_mm"`` backend it
            stays on the device (no host sync; the sum is trusted).
        backend: see the module docstring.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"expected x [M, K] and w [G, N, K] with equal K; got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    device_counts = (
        isinstance(tokens_per_group, torch.Tensor)
        and tokens_per_group.device == x.device
        and x.device.type != "cpu"
    )
    if device_counts and resolve_backend(backend, x, w) == "grouped_mm":
        return grouped_mm_device_counts(x, w, tokens_per_group)
    counts = _counts_list(tokens_per_group)
    if (
        device_counts
        and len(counts) == w.shape[0]
        and all(c >= 0 for c in counts)
        and sum(counts) < x.shape[0]
    ):
        routed = sum(counts)  # filler rows past the last group: zeros
        out = grouped_mm(x[:routed], w, counts, backend=backend)
        return torch.cat([out, out.new_zeros(x.shape[0] - routed, out.shape[1])])
    if len(counts) != w.shape[0]:
        raise ValueError(f"tokens_per_group has {len(counts)} entries for {w.shape[0]} weight groups")
    if any(c < 0 for c in counts) or sum(counts) != x.shape[0]:
        raise ValueError(f"tokens_per_group must be non-negative and sum to M={x.shape[0]}, got {counts}")
    if resolve_backend(backend, x, w) == "loop":
        return grouped_mm_loop(x, w, counts)
    _check_torch_operands(x, w)
    return _grouped_mm_aligned(x.contiguous(), w, counts)


def _check_torch_operands(x: torch.Tensor, w: torch.Tensor) -> None:
    """The ``"grouped_mm"`` backend's operand rules: equal fp32/bf16/fp16 dtypes, 16-byte aligned rows."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise ValueError(
            f"backend 'grouped_mm' needs equal fp32/bf16/fp16 operands, got {x.dtype} and {w.dtype}; use 'loop'"
        )
    if (x.shape[1] * x.element_size()) % 16 or (w.shape[1] * w.element_size()) % 16:
        raise ValueError(
            f"backend 'grouped_mm' needs 16-byte aligned rows (K={x.shape[1]}, N={w.shape[1]} in {x.dtype}); use 'loop'"
        )


def _grouped_mm_aligned(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``torch._grouped_mm`` with host row counts: one call when every group starts on a 16-byte row boundary, else
    the padded path of :func:`_padded_grouped_mm` with the counts uploaded.

    The backward's weight gradient contracts over the token dimension, so a group boundary that is not a multiple
    of ``16 / element_size`` rows gives misaligned TMA loads.
    """
    if x.shape[0] == 0:
        return _no_rows_mm(x, w)
    align = 16 // x.element_size()
    if all(c % align == 0 for c in counts):
        offs = _upload(torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32), x.device)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return _padded_grouped_mm(x, w, _upload(torch.tensor(counts, dtype=torch.int64), x.device))


def _no_rows_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[0, K] x [G, N, K] -> [0, N]`` with zero gradients for ``w`` (CUDA's ``_grouped_mm`` backward rejects an
    empty ``x`` for some widths: "Invalid strides/sizes")."""
    if w.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    return x @ w[0].t()


def grouped_mm_device_counts(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` with the row counts on the device: no host sync, static shapes (CUDA-graph safe).

    The padded path of :func:`_padded_grouped_mm`, so the results are bit-identical to the host-count path
    (``grouped_mm`` takes this path for CUDA counts; it also runs on CPU in fp32). The counts may sum to less than
    ``M`` (the rows past the last group are filler: zero output, zero gradient, no GEMM work); more than ``M`` is not
    checked (it would need the host).
    """
    if counts.dim() != 1 or counts.shape[0] != w.shape[0] or counts.dtype.is_floating_point:
        raise ValueError(
            f"tokens_per_group must be an integer [G={w.shape[0]}] tensor, got {counts.dtype} {tuple(counts.shape)}"
        )
    _check_torch_operands(x, w)
    if x.shape[0] == 0:  # no rows (a static shape)
        return _no_rows_mm(x, w)
    return _padded_grouped_mm(x.contiguous(), w, counts.to(torch.int64))


def _padded_grouped_mm(x: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor) -> torch.Tensor:
    """Every group padded to a multiple of ``align = 16 / element_size`` rows inside a buffer of the worst-case size
    ``M_max = M + G·(align − 1)``, the offsets computed on the device from ``cnt [G]`` (int64, on ``x``'s device).

    Rows are spread into the buffer and gathered back as row gathers through an index map whose backward is the
    gather through the inverse map (:func:`hash_moe.row_gather.row_gather`): every row is moved by one write, no
    zero-fill + copy forward and no atomic ``index_add_`` backward (PyTorch's ``index_select`` gradient); the
    results are bit-identical to gathering with ``index_select`` / ``index_copy``. Rows past the last offset are
    never read back (forward) and get zero gradients (backward); rows of ``x`` past ``Σ cnt`` are filler (zeros).
    """
    align = 16 // x.element_size()
    m, g, dev = x.shape[0], w.shape[0], x.device
    m_max = m + g * (align - 1)
    pad = (cnt + (align - 1)) // align * align  # [G] padded group sizes
    ends = cnt.cumsum(0)  # [G]
    shift = (pad.cumsum(0) - pad) - (ends - cnt)  # [G] destination minus source start
    r = torch.arange(m, device=dev)  # [M]
    group = torch.searchsorted(ends, r, right=True)  # [M] group of each row; G for filler rows
    shift = torch.cat([shift, shift.new_zeros(1)])  # [G + 1]
    rows = torch.where(group < g, r + shift[group], -1)  # [M] padded row of x[i], -1 = filler
    source = torch.full((m_max + 1,), -1, dtype=torch.int64, device=dev).index_copy_(
        0, torch.where(rows >= 0, rows, m_max), r
    )[:m_max]  # [M_max] row of x in each padded row, -1 = padding or past the last group (slot M_max: filler)
    xp = row_gather(x, source, rows.unsqueeze(1))  # [M_max, K]
    # an x discarded by selective recompute (moe_act) is saved as its padded copy: discard that copy too
    discard_derived(xp, x, lambda xr: row_gather(xr, source, rows.unsqueeze(1)))
    offs = pad.cumsum(0).to(torch.int32)  # [G] group ends
    out = torch._grouped_mm(xp, w.transpose(-2, -1), offs=offs)  # [M_max, N] (rows past offs[-1] unset)
    return row_gather(out, rows, source.unsqueeze(1))  # [M, N]


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a stream synchronisation (a pageable source is staged by the driver
    before the call returns, so the temporary may be freed right away)."""
    return host.to(device, non_blocking=True)
