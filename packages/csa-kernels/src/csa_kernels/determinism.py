"""What ``deterministic=None`` means for the backward kernels of csa-kernels: one process-wide default, read by
every op that takes the switch (``sparse_attn(_sbhd)``'s ``dkv``; ``indexer_scores_at`` / ``indexer_topk``'s ``dk``).

The default is **deterministic** (issue 35): the atomic-free reductions, bitwise reproducible run to run.
``set_deterministic_default(False)`` (or ``with deterministic_default_scope(False):``) selects the fp32-atomic
kernels for every call that leaves ``deterministic=None``: they are measurably faster (the sparse attention's
deterministic fwd+bwd costs 0.68-0.84x the atomic one, H100, README "Inverted-index reduction") but their summation
order varies between runs. An explicit ``deterministic=True`` / ``False`` argument always wins, and
``torch.use_deterministic_algorithms(True)`` forces the deterministic kernels whatever this default says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_state = {"deterministic": True}


def deterministic_default() -> bool:
    """The current process-wide default of ``deterministic=None`` (``True`` unless set otherwise)."""
    return _state["deterministic"]


def set_deterministic_default(flag: bool) -> bool:
    """Make ``deterministic=None`` mean ``flag`` in this process (``False``: the fp32-atomic kernels); returns the
    previous default, so a caller can restore it. ``ValueError`` unless ``flag`` is a bool."""
    if not isinstance(flag, bool):
        raise ValueError(
            f"csa_kernels.set_deterministic_default: flag must be True (atomic-free kernels) or False (fp32-atomic "
            f"kernels), got {flag!r} ({type(flag).__name__}); pass a bool"
        )
    previous = _state["deterministic"]
    _state["deterministic"] = flag
    return previous


@contextlib.contextmanager
def deterministic_default_scope(flag: bool) -> Iterator[None]:
    """``with deterministic_default_scope(False): ...``: :func:`set_deterministic_default` for the block, the
    previous default restored after it (also when it raises)."""
    previous = set_deterministic_default(flag)
    try:
        yield
    finally:
        set_deterministic_default(previous)


__all__ = ["deterministic_default", "deterministic_default_scope", "set_deterministic_default"]
