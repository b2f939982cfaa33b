"""Host side of the fused AdamW step: validation, the pointer / block / scalar tables, one launch per dtype class.

Why a pointer table and not flat buffers: the tensors are owned elsewhere. megatron-core's optimizers allocate each
fp32 main param (or the distributed optimizer's shard of it) separately, torch's AdamW state holds one
``exp_avg`` / ``exp_avg_sq`` per param (the checkpoint format, replaced wholesale by ``load_state_dict``), and the
bf16 model copies are views into megatron's param buffers at their own offsets. Laying all of that out contiguously
would change who owns the memory and the optimizer's state format; a table of int64 addresses reads every tensor
where it lives, and costs ``5 * 8`` bytes per tensor and ``12`` bytes per block of ``BLOCK`` elements.

Tensors whose five addresses are 16-byte aligned and whose sizes are multiples of 8 (megatron pads params in its
buffers to 64 elements; torch's allocations are aligned) run in a launch of their own with alignment hints, which
turn the kernel's element-wise loads and stores into 16-byte vector accesses; the others in a plain launch.

The block table depends only on the tensors' sizes and is cached; the address and scalar tables are rebuilt per
call (gradients may be fresh tensors every step, ``lr`` and the bias corrections change) and reach the device
through pinned memory without a host synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton.language as tl

from dsv4_primitives.dispatch import triton_usable
from dsv4_primitives.fused_adamw.kernel import adamw_pointer_table_kernel

DEFAULT_BLOCK = 4096
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_BLOCK_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_BLOCK_TABLES_MAX = 16


@dataclass(frozen=True)
class AdamWHyper:
    """One param group's AdamW scalars (torch's names)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def row(self, step: int) -> list[float]:
        """The kernel's scalar row (:data:`~dsv4_primitives.fused_adamw.kernel.HYPER_COLUMNS`) at ``step`` (>= 1),
        computed in float64 as torch's single-tensor AdamW computes its Python scalars."""
        if step < 1:
            raise ValueError(f"fused AdamW: step must be >= 1 (the step being taken), got {step}")
        bc1 = 1 - self.beta1**step
        bc2 = 1 - self.beta2**step
        return [
            1 - self.lr * self.weight_decay,
            1 - self.beta1,
            self.beta2,
            1 - self.beta2,
            self.lr / bc1,
            math.sqrt(bc2),
            self.eps,
            0.0,
        ]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``; for CUDA through pinned memory, without a host sync."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _block_table(
    numels: tuple[int, ...], block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor index [B] int32, first element [B] int64) of every ``block``-element block; cached by sizes."""
    key = (numels, block, str(device))
    hit = _BLOCK_TABLES.get(key)
    if hit is not None:
        return hit
    counts = torch.tensor([-(-n // block) for n in numels], dtype=torch.int64)  # [N]
    tensor_idx = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)  # [B]
    first = torch.cumsum(counts, 0) - counts  # [N] index of each tensor's first block
    start = (torch.arange(int(counts.sum()), dtype=torch.int64) - first[tensor_idx.long()]) * block  # [B]
    if len(_BLOCK_TABLES) >= _BLOCK_TABLES_MAX:
        _BLOCK_TABLES.clear()
    _BLOCK_TABLES[key] = (tensor_idx.to(device), start.to(device))
    return _BLOCK_TABLES[key]


def _check(name: str, i: int, t: torch.Tensor, ref: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    if t.dtype not in dtypes or t.device != ref.device or t.numel() != ref.numel() or not t.is_contiguous():
        raise ValueError(
            f"fused AdamW: {name}[{i}] must be a contiguous {'/'.join(map(str, dtypes))} tensor of "
            f"{ref.numel()} elements on {ref.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


def fused_adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[int],
    hypers: Sequence[AdamWHyper],
    model_params: Sequence[torch.Tensor | None] | None = None,
    clip_coef: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
) -> None:
    """One AdamW step over many tensors in one pass per class (grad dtype, model-param dtype, alignment), in place (math: module doc of
    :mod:`dsv4_primitives.fused_adamw.kernel`; :func:`~dsv4_primitives.fused_adamw.reference.fused_adamw_ref`).

    ``params`` / ``exp_avgs`` / ``exp_avg_sqs``: contiguous fp32 tensors (main params and torch AdamW's moments);
    ``grads``: contiguous fp32 / bf16 / fp16 of the same sizes, multiplied by ``clip_coef`` (a one-element fp32
    device tensor, no host sync; ``None``: 1); ``steps[i]``: the step being taken (torch's ``state["step"]`` after
    its increment); ``hypers[i]``: tensor ``i``'s group scalars; ``model_params[i]``: a contiguous bf16 / fp16 /
    fp32 tensor that receives the new param rounded to its dtype, or ``None``. Runs on CUDA, or on the CPU under
    ``TRITON_INTERPRET=1``.
    """
    n = len(params)
    model_params = [None] * n if model_params is None else list(model_params)
    lists = {
        "grads": grads,
        "exp_avgs": exp_avgs,
        "exp_avg_sqs": exp_avg_sqs,
        "steps": steps,
        "hypers": hypers,
    }
    for name, seq in {**lists, "model_params": model_params}.items():
        if len(seq) != n:
            raise ValueError(f"fused AdamW: {len(params)} params but {len(seq)} {name}; pass one per param")
    if n == 0:
        return
    device = params[0].device
    if not triton_usable(params[0]):
        raise ValueError(
            f"fused AdamW: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got {device}"
        )
    if block < 16 or block & (block - 1):
        raise ValueError(f"fused AdamW: block must be a power of two >= 16, got {block}")
    if clip_coef is None:
        clip_coef = torch.ones(1, dtype=torch.float32, device=device)
    if clip_coef.dtype != torch.float32 or clip_coef.numel() != 1 or clip_coef.device != device:
        raise ValueError(f"fused AdamW: clip_coef must be a one-element fp32 tensor on {device}")
    classes: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.device != device:
            raise ValueError(
                f"fused AdamW: params[{i}] is on {p.device}, params[0] on {device}; use one device"
            )
        _check("params", i, p, p, (torch.float32,))
        _check("grads", i, grads[i], p, tuple(_TL_DTYPES))
        _check("exp_avgs", i, exp_avgs[i], p, (torch.float32,))
        _check("exp_avg_sqs", i, exp_avg_sqs[i], p, (torch.float32,))
        dst = model_params[i]
        if dst is not None:
            _check("model_params", i, dst, p, tuple(_TL_DTYPES))
            if dst.data_ptr() == p.data_ptr() and dst.dtype == p.dtype:
                model_params[i] = dst = None  # the model param is the main param
        if p.numel():
            ptrs = [t.data_ptr() for t in (p, grads[i], exp_avgs[i], exp_avg_sqs[i], dst) if t is not None]
            aligned = p.numel() % 8 == 0 and all(a % 16 == 0 for a in ptrs)
            classes.setdefault((grads[i].dtype, None if dst is None else dst.dtype, aligned), []).append(i)
    for (g_dtype, d_dtype, aligned), idx in classes.items():
        rows = [hypers[i].row(int(steps[i])) for i in idx]
        addr = [params[i].data_ptr() for i in idx]
        addr += [grads[i].data_ptr() for i in idx]
        addr += [exp_avgs[i].data_ptr() for i in idx]
        addr += [exp_avg_sqs[i].data_ptr() for i in idx]
        addr += [0 if model_params[i] is None else model_params[i].data_ptr() for i in idx]
        numels = tuple(params[i].numel() for i in idx)
        block_tensor, block_start = _block_table(numels, block, device)
        adamw_pointer_table_kernel[(block_tensor.numel(),)](
            _to_device(addr, torch.int64, device),  # [5, N]
            len(idx),
            _to_device(list(numels), torch.int64, device),  # [N]
            _to_device(rows, torch.float32, device),  # [N, 8]
            block_tensor,
            block_start,
            clip_coef,
            G_DTYPE=_TL_DTYPES[g_dtype],
            DST_DTYPE=_TL_DTYPES[d_dtype or torch.float32],
            HAS_DST=d_dtype is not None,
            DST_BF16=d_dtype == torch.bfloat16,
            ALIGNED=aligned,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )


__all__ = ["DEFAULT_BLOCK", "AdamWHyper", "fused_adamw_step"]
