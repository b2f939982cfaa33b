"""``H``: DSv4 heavily compressed attention (``LayerKind.HCA``, ratio 128); shared parts in
:mod:`hybrid_model.mixers.dsv4_kinds`."""

from __future__ import annotations

from dsv4_attention import LayerKind
from hybrid_model.mixers.dsv4_kinds import kind_record

RECORD = kind_record(LayerKind.HCA, "DSv4 heavily compressed attention")
