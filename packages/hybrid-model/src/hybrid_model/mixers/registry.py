"""Pattern symbol -> :class:`~hybrid_model.mixers.record.SymbolRecord`, and the checks of a pattern that read the
records.

Adding a symbol: its grammar character in :mod:`hybrid_model.symbols`, its record in one module of this package,
and one line in :data:`REGISTRY` (in the order messages list the symbols).
"""

from __future__ import annotations

import torch

from hybrid_model.mixers import attention, csa, dsa, gdn, hca, mamba, mla, mlp, moe, window
from hybrid_model.mixers.record import Layout, SymbolRecord

REGISTRY: dict[str, SymbolRecord] = {
    r.symbol: r
    for r in (
        csa.RECORD,
        hca.RECORD,
        window.RECORD,
        moe.RECORD,
        mlp.RECORD,
        attention.RECORD,
        mla.RECORD,
        dsa.RECORD,
        gdn.RECORD,
        mamba.RECORD,
    )
}


def record(symbol: str) -> SymbolRecord:
    """The record of a layer symbol (``ValueError`` for anything else)."""
    if symbol not in REGISTRY:
        raise ValueError(f"{symbol!r} is not a layer symbol; known: {' '.join(REGISTRY)}")
    return REGISTRY[symbol]


def records_of(symbols: str) -> list[SymbolRecord]:
    """The records of the distinct layer symbols in ``symbols`` (a pattern; ``|`` / ``/`` are skipped), sorted by
    symbol."""
    return [REGISTRY[s] for s in sorted(set(symbols) & REGISTRY.keys())]


def symbols_refusing(layout: Layout) -> frozenset[str]:
    """The symbols whose layer refuses ``layout``."""
    return frozenset(s for s, r in REGISTRY.items() if r.refusal(layout) is not None)


def counted_symbols(what: str) -> str:
    """The symbols with an analytic count, ``"params"`` or ``"flops"``, as messages list them (``C H W E ...``)."""
    return " ".join(s for s, r in REGISTRY.items() if getattr(r, what) is not None)


def require_symbol_dependencies(symbols: str) -> None:
    """Raise ``ImportError`` naming every missing package that the layers of ``symbols`` need."""
    for rec in records_of(symbols):
        rec.require_packages()


def require_symbol_device(symbols: str) -> None:
    """``ValueError`` when ``symbols`` holds a symbol that refuses a machine without CUDA (``G``: fla, whose kernels
    the GDN layer runs, does not even import without one; checked before megatron's GDN module imports it)."""
    if torch.cuda.is_available():
        return
    for rec in records_of(symbols):
        if rec.refusal(Layout.CPU) is not None:
            raise ValueError(rec.message(Layout.CPU))


def check_packed_graph_pattern(pattern: str) -> None:
    """``ValueError`` when ``pattern`` has a symbol whose record refuses CUDA graphs of packed THD batches (only the
    DSv4 symbols ``W C H`` and the MLP / MoE symbols take device-side document boundaries)."""
    refusing = symbols_refusing(Layout.PACKED_CUDA_GRAPH)
    bad = [rec for rec in records_of("".join(sorted(set(pattern)))) if rec.symbol in refusing]
    if bad:
        reason = bad[0].refusal(Layout.PACKED_CUDA_GRAPH).reason
        raise ValueError(
            f"--cuda-graph --packed cannot run the pattern {pattern!r}: its layer(s) "
            f"{', '.join(repr(r.symbol) for r in bad)} (megatron-core's own mixers) {reason}; use a pattern of "
            "W C H E - only, or drop --packed (fixed-length [B, S] batches graph with every symbol) or --cuda-graph"
        )
