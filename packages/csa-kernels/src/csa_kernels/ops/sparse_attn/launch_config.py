"""Launch configuration of the sparse attention backward's ``dkv`` (:mod:`.dkv_tokenmajor`): which reduction the
deterministic mode uses, the token-major kernel's tiles, and the pair buffer of the inverted-index reduction.

Benchmarks may assign the module attributes (``bench_det_inverted.py`` compares the reductions side by side).
"""

from __future__ import annotations

import torch

from csa_kernels._triton_utils import interpreting

# What ``deterministic=None`` means is one process-wide default for every op: csa_kernels.determinism
# (deterministic unless ``csa_kernels.set_deterministic_default(False)``).

# The deterministic dkv: "inverted" (token-major pair rows + per-row gather-reduce over an inverted index; cost
# proportional to the pairs, independent of collisions) or "keymajor" (the 0.3 key-major pass, kept to compare).
# "inverted" is the faster one wherever the indices scatter (H100, V4-Flash fwd+bwd: 12.85 vs 24.29 ms at S 4096
# random, 53.5 vs 251.8 ms at S 16384 random; key-major wins only at S 4096 window, 10.29 vs 11.21 ms).
DETERMINISTIC_DKV = "inverted"

# (BLOCK_N, BLOCK_DC, num_warps, num_stages) of the token-major dkv kernel on the GPU (bf16).
BWD_DKV_CONFIG: tuple[int, int, int, int] = (64, 128, 8, 1)

# Cap of the pair buffer ``[head blocks, tokens, K, D]`` of the inverted-index dkv: tokens are processed in chunks
# that fit it (each chunk: the token-major kernel, then the gather-reduce into dkv).
PAIR_BYTES = 1 << 30

# dtype of the stored pair rows for bf16 / fp16 inputs: fp32 (exact partial sums, the atomic path's accuracy) or
# the input dtype (half the pair traffic; each row rounded once before the fp32 sum). fp32 inputs always store fp32.
PAIR_DTYPE: torch.dtype = torch.float32

# Pairs per piece of the gather-reduce: a row read by more pairs is summed by several programs and a second,
# fixed-order pass (hot rows never serialise into one program).
PIECE = 256


def dkv_tiles(block_n: int, block_d: int, fp32_d512: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_DC, num_warps, num_stages) of the token-major dkv kernel; ``block_n`` = the dq kernel's
    (interpreter only). fp32 at D > 256: the bf16 tiles would spill 512 B per thread."""
    if interpreting():
        return block_n, min(block_d, 64), 4, 1
    if fp32_d512:
        return 16, 64, 8, 1
    bn, dc, warps, stages = BWD_DKV_CONFIG
    return bn, min(dc, block_d), warps, stages


def pair_dtype(input_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if input_dtype == torch.float32 else PAIR_DTYPE


def piece() -> int:
    """Pairs per piece (3 in the interpreter, so that the tests' hot rows are split)."""
    return 3 if interpreting() else PIECE


def tokens_per_chunk(T: int, row_bytes: int, programs_per_wave: int) -> int:
    """Tokens per chunk of the inverted-index dkv: as many as fit ``PAIR_BYTES`` (``row_bytes`` = the pair bytes
    of one token), a multiple of ``programs_per_wave`` when that many fit (no partly filled last wave per chunk);
    4 in the interpreter (several chunks in the tests)."""
    if interpreting():
        return 4
    tc = max(1, PAIR_BYTES // max(1, row_bytes))
    if tc >= programs_per_wave:
        tc -= tc % programs_per_wave
    return min(tc, max(T, 1))
