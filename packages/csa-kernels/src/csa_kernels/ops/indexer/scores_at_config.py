"""Launch configuration of the index scores' backward ``dk`` (:mod:`.scores_at_triton`): which reduction the
deterministic mode uses and the pair buffer of the inverted-index reduction. Benchmarks may assign these."""

from __future__ import annotations

from csa_kernels._triton_utils import interpreting

# What ``deterministic=None`` means when torch's flag is off (``indexer_scores_at`` / ``indexer_topk``'s gradient):
# ``True`` makes the atomic-free dk the default (one line to flip once the GPU numbers say so).
DETERMINISTIC_DEFAULT = False

# The deterministic dk: "inverted" (per-pair dk rows stored by the row kernel, summed per key over an inverted
# index; cost proportional to the pairs) or "keymajor" (the 0.3 key-major pass, kept to compare).
DETERMINISTIC_DK = "inverted"

# Cap of the fp32 pair buffer ``[head blocks, rows, K, DI]``: query rows are processed in chunks that fit it.
PAIR_BYTES = 512 << 20

# Pairs per piece of the gather-reduce (a key read by more pairs is split; see csa_kernels._inverted).
PIECE = 256


def piece() -> int:
    """Pairs per piece (3 in the interpreter, so that the tests' repeated keys are split)."""
    return 3 if interpreting() else PIECE


def rows_per_chunk(T: int, row_bytes: int, programs_per_wave: int) -> int:
    """Query rows per chunk: as many as fit ``PAIR_BYTES``, a multiple of ``programs_per_wave`` when that many fit;
    3 in the interpreter (several chunks in the tests)."""
    if interpreting():
        return 3
    tc = max(1, PAIR_BYTES // max(1, row_bytes))
    if tc >= programs_per_wave:
        tc -= tc % programs_per_wave
    return min(tc, max(T, 1))
