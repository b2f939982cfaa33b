"""``W``: DSv4 sliding-window attention (``LayerKind.WINDOW``, ratio 0); shared parts in
:mod:`hybrid_model.mixers.dsv4_kinds`."""

from __future__ import annotations

from dsv4_attention import LayerKind
from hybrid_model.mixers.dsv4_kinds import kind_record

RECORD = kind_record(LayerKind.WINDOW, "DSv4 sliding-window attention")
