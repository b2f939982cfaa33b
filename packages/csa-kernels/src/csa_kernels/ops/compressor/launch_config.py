"""Launch configuration of the compressor pooling kernel (:mod:`csa_kernels.ops.compressor.triton`): which
schedule (held or streamed), the unroll, the channel block and the warps for a shape, and the device limits the
choice reads."""

from __future__ import annotations

import functools

import torch

from csa_kernels._triton_utils import interpreting, next_pow2

HELD_MAX_SLOTS = 8  # slots per entry (2m with overlap) up to which the held schedule is used


def launch_config(ratio: int, overlap: bool, c: int, tc: int, sms: int) -> tuple[bool, int, int, int]:
    """(HELD, UNROLL, BLOCK_C, num_warps).

    Channels per thread (cpt <= 4: 8-byte bf16 / 16-byte fp32 vectors, one layout for every load) shrink when
    there are too few (entry, channel) pairs to give every SM ~16 warps; the streamed schedule unrolls
    ``32 / cpt`` slots per step (about 32 loads of kv and score in flight per thread).
    """
    held = ratio * (2 if overlap else 1) <= HELD_MAX_SLOTS
    if interpreting():  # small unroll: several (masked) streamed steps
        return held, min(4, next_pow2(ratio)), min(next_pow2(c), 64), 1
    cpt = 4
    while cpt > 1 and tc * c < sms * 16 * 32 * cpt:
        cpt //= 2
    block_c = min(next_pow2(c), 32 * cpt * 4)
    return held, min(next_pow2(ratio), 32 // cpt), block_c, max(1, block_c // (32 * cpt))


@functools.cache
def device_limits(index: int) -> tuple[int, int, int]:
    """(SM count, registers per SM, threads per SM) of CUDA device ``index``."""
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count, p.regs_per_multiprocessor, p.max_threads_per_multi_processor
