"""``C``: DSv4 compressed sparse attention (``LayerKind.CSA``: ratio 4 + lightning indexer); shared parts in
:mod:`hybrid_model.mixers.dsv4_kinds`."""

from __future__ import annotations

from dsv4_attention import LayerKind
from hybrid_model.mixers.dsv4_kinds import kind_record

RECORD = kind_record(LayerKind.CSA, "DSv4 compressed sparse attention")
