"""The three DSv4 attention layer kinds (paper names) and what each one implies.

==========  ======  ============  =====================================  ==========  =======
kind        symbol  compress      keys of a query                        compressor  indexer
                    ratio
==========  ======  ============  =====================================  ==========  =======
``WINDOW``  ``W``   0             the last ``n_win`` raw tokens          no          no
``CSA``     ``C``   ``m`` = 4     window + indexer top-k of the          overlapping yes
                                  overlapping 4:1 entries                (2 series)
``HCA``     ``H``   ``m'`` = 128  window + every visible 128:1 entry     plain       no
==========  ======  ============  =====================================  ==========  =======

The kind is what travels between packages (specs, configs, parameter and FLOP counts); the ratio, the compressor's
overlap and the presence of an indexer follow from it (``compress_ratio == 4`` is never decoded elsewhere).
"""

from __future__ import annotations

import enum


class LayerKind(enum.Enum):
    """Sliding-window (``W``), compressed sparse (``C``) or heavily compressed (``H``) attention."""

    WINDOW = "window"
    CSA = "csa"
    HCA = "hca"

    @property
    def compress_ratio(self) -> int:
        """Tokens per compressed entry: 0 (no compressor), 4 (``m``) or 128 (``m'``)."""
        return _RATIO[self]

    @property
    def has_compressor(self) -> bool:
        return self is not LayerKind.WINDOW

    @property
    def overlap(self) -> bool:
        """The compressor pools overlapping windows of two series (CSA only, spec §3.2)."""
        return self is LayerKind.CSA

    @property
    def has_indexer(self) -> bool:
        """A lightning indexer selects the compressed entries (CSA only, spec §4)."""
        return self is LayerKind.CSA

    @property
    def symbol(self) -> str:
        """The hybrid-pattern symbol (upstream D4): ``W``, ``C`` or ``H``."""
        return _SYMBOL[self]

    @property
    def paper_name(self) -> str:
        """``"sliding_window"``, ``"csa"`` or ``"hca"`` (the 0.2 ``layer_kind`` strings)."""
        return "sliding_window" if self is LayerKind.WINDOW else self.value

    @classmethod
    def from_ratio(cls, compress_ratio: int) -> LayerKind:
        """The kind of a compress ratio (``ValueError`` unless 0, 4 or 128)."""
        for kind, ratio in _RATIO.items():
            if compress_ratio == ratio and not isinstance(compress_ratio, bool):
                return kind
        raise ValueError(
            f"compress_ratio must be one of {VALID_COMPRESS_RATIOS} (0 = window only, 4 = CSA, 128 = HCA), "
            f"got {compress_ratio!r}"
        )

    @classmethod
    def from_symbol(cls, symbol: str) -> LayerKind:
        """The kind of a pattern symbol ``W`` / ``C`` / ``H`` (``ValueError`` otherwise)."""
        for kind, s in _SYMBOL.items():
            if symbol == s:
                return kind
        raise ValueError(f"{symbol!r} is not a DSv4 attention symbol (W, C or H)")

    @classmethod
    def coerce(cls, kind: LayerKind | int) -> LayerKind:
        """``kind`` itself, or the kind of a compress ratio (the 0.2 API took ratios)."""
        return kind if isinstance(kind, LayerKind) else cls.from_ratio(kind)


_RATIO = {LayerKind.WINDOW: 0, LayerKind.CSA: 4, LayerKind.HCA: 128}
_SYMBOL = {LayerKind.WINDOW: "W", LayerKind.CSA: "C", LayerKind.HCA: "H"}

#: the compress ratios this package accepts (one per kind)
VALID_COMPRESS_RATIOS = tuple(_RATIO.values())
#: compress ratio -> paper name (0.2 API; prefer :class:`LayerKind`)
LAYER_KINDS = {kind.compress_ratio: kind.paper_name for kind in LayerKind}


def check_compress_ratio(compress_ratio: int) -> int:
    """Return ``compress_ratio`` or raise ``ValueError`` if it is not 0, 4 or 128."""
    return LayerKind.from_ratio(compress_ratio).compress_ratio
