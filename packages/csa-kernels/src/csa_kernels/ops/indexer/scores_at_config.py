"""Launch configuration of the index scores' backward ``dk`` (:mod:`.scores_at_triton`): which reduction the
deterministic mode uses and the pair buffer of the inverted-index reduction. Benchmarks may assign these."""

from __future__ import annotations

from csa_kernels._triton_utils import interpreting

# What ``deterministic=None`` means is one process-wide default for every op: csa_kernels.determinism
# (deterministic unless ``csa_kernels.set_deterministic_default(False)``).

# The deterministic dk: "keymajor" (the key-major pass of scores_at_keymajor) or "inverted" (per-pair dk rows
# stored by the row kernel, summed per key over an inverted index; cost proportional to the pairs). Key-major is
# the default because it is the faster one in the only measurement (H100, 2026-12-05, T 4096, DI 128,
# benchmarks/results/bench_csa_h100_det_inverted.log): fwd+bwd 1.81 ms key-major vs 2.68 ms inverted with
# uniformly random indices (the key-major pass's worst case), 1.54 vs 2.41 ms at a hot key, atomic 0.89 ms; it
# also needs 0.11 GiB instead of 0.63. The per-pair dk rows are small (DI 128), so the inverted path's sort and
# pair-row round trip dominate it. Revisit if longer contexts measure otherwise.
DETERMINISTIC_DK = "keymajor"

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
