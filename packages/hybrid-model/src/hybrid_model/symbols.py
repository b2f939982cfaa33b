"""DSv4 layer-pattern symbols ``C`` / ``H`` / ``W`` (upstream D4) and per-layer compress ratios.

A hybrid layer pattern (megatron-core ``HybridModel``) is one symbol per layer: megatron-core's ``M`` (Mamba),
``G`` (GDN), ``*`` (attention), ``D`` (DSA), ``+`` (MLA), ``-`` (MLP), ``E`` (MoE), plus DSv4's

====== ========================================= =====================
symbol layer                                     compress ratio
====== ========================================= =====================
``C``  compressed sparse attention (CSA)         ``m`` (4)
``H``  heavily compressed attention (HCA)        ``m'`` (128)
``W``  sliding-window-only attention             0
====== ========================================= =====================

Each attention symbol is one :class:`dsv4_attention.LayerKind` (:func:`attention_kind`); the kind, not the ratio,
is what the stack spec, parameter and FLOP counts read. A model parses its pattern once
(:attr:`hybrid_model.config.DSv4ModelConfig.parsed_pattern`).

``|`` cuts pipeline stages, ``/`` starts an MTP depth (each depth repeats the same pattern). A DSv4 block is an
attention symbol followed by ``E`` (``"WEWECEHE…|…/WE"``); any mix of the symbols above builds
(:mod:`hybrid_model.layers`), e.g. upstream's functional pattern ``"WEC-|H-C-/W-"``. ``*`` cannot be mixed with the
MLA family (``+ D C H W``). :func:`parse_pattern` raises :class:`PatternError` pointing at the offending character.

Per-layer compress ratios are accepted in two forms (:func:`normalize_compress_ratios`):

* **compact**: one ratio per ``C``/``H``/``W`` symbol, in pattern order across the main part and every MTP depth;
* **full**: one ratio per layer symbol (``|``/``/`` ignored), with 0 at every non-``C``/``H``/``W`` symbol.

:func:`pattern_from_compress_ratios` builds a pattern from an official / Hugging Face ``compress_ratios`` list
(``L + num_nextn_predict_layers`` entries, one per decoder block, MTP last).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsv4_attention import LayerKind
from hash_moe import hash_moe_layer_numbers

CSA = "C"
HCA = "H"
WINDOW = "W"
MOE = "E"
MLP = "-"
ATTENTION = "*"
DSA = "D"
MLA = "+"
MAMBA = "M"
GDN = "G"
PIPE = "|"
MTP_SEPARATOR = "/"

DSV4_ATTENTION = frozenset({CSA, HCA, WINDOW})
MLA_FAMILY = frozenset({MLA, DSA, CSA, HCA, WINDOW})
LAYER_SYMBOLS = frozenset({MAMBA, GDN, ATTENTION, DSA, MLA, MLP, MOE, CSA, HCA, WINDOW})
#: the token-mixing symbols: one "block" each (``num_layers`` counts them; ``-``/``E`` are channel mixers)
SEQUENCE_MIXERS = frozenset({MAMBA, GDN, ATTENTION, DSA, MLA, CSA, HCA, WINDOW})
KIND_NAMES = {
    CSA: "csa",
    HCA: "hca",
    WINDOW: "window",
    MOE: "moe",
    MLP: "mlp",
    ATTENTION: "attention",
    DSA: "dsa",
    MLA: "mla",
    MAMBA: "mamba",
    GDN: "gdn",
}


def register_dsv4_symbols() -> None:
    """Add ``C``/``H``/``W`` to megatron-core's ``hybrid_layer_allocation.Symbols`` (idempotent).

    megatron-core 0.19.2 validates patterns against ``Symbols.VALID_LAYERS``; upstream D4 adds exactly these three
    symbols (attribute names ``CSA``, ``HCA``, ``WINDOW``), which this reproduces on the released wheel.
    """
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

    Symbols.CSA = CSA
    Symbols.HCA = HCA
    Symbols.WINDOW = WINDOW
    Symbols.MLA_ATTENTION = set(MLA_FAMILY)
    Symbols.VALID_LAYERS = set(Symbols.VALID_LAYERS) | set(DSV4_ATTENTION)


@dataclass(frozen=True)
class ParsedPattern:
    """A validated pattern split into its parts.

    Attributes:
        pattern: the full pattern string.
        segments: main-pattern pipeline segments (``|``-separated; one segment without ``|``).
        mtp_pattern: the pattern of one MTP depth ("" when there is no MTP).
        mtp_num_depths: number of MTP depths.
    """

    pattern: str
    segments: tuple[str, ...]
    mtp_pattern: str
    mtp_num_depths: int

    @property
    def main(self) -> str:
        """Main layer symbols without ``|``."""
        return "".join(self.segments)

    @property
    def all_symbols(self) -> str:
        """Main symbols followed by each MTP depth's symbols (the order of the *full* ratio form)."""
        return self.main + self.mtp_pattern * self.mtp_num_depths


SYMBOL_HELP = (
    "W window, C CSA, H HCA, E MoE, - dense MLP, * attention, + MLA, D DSA, G GDN, M Mamba; "
    "'|' pipeline cut, '/' MTP depth"
)  # (--pattern's help, hybrid_model.model_flags)


class PatternError(ValueError):
    """A pattern that does not parse; ``position`` is the 0-based index of the offending character."""

    def __init__(self, pattern: str, position: int, reason: str) -> None:
        self.pattern, self.position, self.reason = pattern, position, reason
        super().__init__(
            f"invalid hybrid layer pattern at position {position + 1}: {reason}\n"
            f"  {pattern}\n  {' ' * position}^\n"
            f"valid symbols: {SYMBOL_HELP}"
        )


def parse_pattern(pattern: str) -> ParsedPattern:
    """Validate ``pattern`` and split it (raises :class:`PatternError`, a ``ValueError`` pointing at the offending
    character with a caret line and listing the valid symbols)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"hybrid layer pattern must be a non-empty string, got {pattern!r}; valid symbols: {SYMBOL_HELP}"
        )
    first_mtp = pattern.find(MTP_SEPARATOR)
    for i, ch in enumerate(pattern):
        if ch == PIPE and 0 <= first_mtp < i:
            raise PatternError(
                pattern, i, "'|' inside an MTP depth (MTP layers live on the last pipeline stage)"
            )
        if ch not in LAYER_SYMBOLS and ch not in (PIPE, MTP_SEPARATOR):
            raise PatternError(pattern, i, f"{ch!r} is not a layer symbol")
    parts = pattern.split(MTP_SEPARATOR)
    main, mtp_parts = parts[0], parts[1:]
    if not main.replace(PIPE, ""):
        raise PatternError(pattern, 0, "the main pattern (before the first '/') has no layers")
    starts = [len(main) + 1]
    for p in mtp_parts[:-1]:
        starts.append(starts[-1] + len(p) + 1)
    for start, p in zip(starts, mtp_parts):
        if not p:
            raise PatternError(
                pattern, start - 1, "empty MTP depth: remove the '/' or give the depth's layers"
            )
        if p != mtp_parts[0]:
            raise PatternError(
                pattern,
                start,
                f"MTP depth {p!r} differs from the first depth {mtp_parts[0]!r}: every depth repeats it",
            )
    layers = main.replace(PIPE, "") + "".join(mtp_parts)
    if ATTENTION in layers and any(s in layers for s in MLA_FAMILY):
        at = min(i for i, c in enumerate(pattern) if c in MLA_FAMILY and c in layers)
        raise PatternError(
            pattern,
            max(pattern.find(ATTENTION), at),
            "standard attention '*' mixed with the MLA family (+ D C H W); use one attention family per model",
        )
    segments = tuple(main.split(PIPE))
    if len(segments) > 1:
        pos = 0
        for seg in segments:
            if not seg:
                raise PatternError(
                    pattern,
                    min(pos, len(main) - 1),
                    "empty pipeline stage: every '|'-separated stage needs layers",
                )
            pos += len(seg) + 1
    return ParsedPattern(pattern, segments, mtp_parts[0] if mtp_parts else "", len(mtp_parts))


def mixer_ratios(pattern: str | ParsedPattern, csa_ratio: int = 4, hca_ratio: int = 128) -> list[int]:
    """One compress ratio per sequence-mixer symbol (``C H W * + D G M``; the "blocks"), main then every MTP depth:
    ``W``/``*``/``+``/``D``/``G``/``M`` give 0 (no compressor), ``C`` ``csa_ratio``, ``H`` ``hca_ratio``."""
    return [
        ratio_of_symbol(s, csa_ratio, hca_ratio) for s in _parsed(pattern).all_symbols if s in SEQUENCE_MIXERS
    ]


def attention_kind(symbol: str) -> LayerKind | None:
    """The :class:`~dsv4_attention.LayerKind` of ``W`` / ``C`` / ``H`` (``None`` for every other symbol)."""
    return LayerKind.from_symbol(symbol) if symbol in DSV4_ATTENTION else None


def _parsed(pattern: str | ParsedPattern) -> ParsedPattern:
    return pattern if isinstance(pattern, ParsedPattern) else parse_pattern(pattern)


def ratio_of_symbol(symbol: str, csa_ratio: int = 4, hca_ratio: int = 128) -> int:
    """The compress ratio a DSv4 attention symbol implies (``0`` for every other symbol)."""
    return {CSA: csa_ratio, HCA: hca_ratio, WINDOW: 0}.get(symbol, 0)


def _check_ratios(csa_ratio: int, hca_ratio: int) -> None:
    if csa_ratio < 1 or hca_ratio < 1 or csa_ratio == hca_ratio:
        raise ValueError(
            f"need positive, distinct CSA / HCA compress ratios, got csa={csa_ratio}, hca={hca_ratio}"
        )


def normalize_compress_ratios(
    pattern: str | ParsedPattern,
    ratios: Sequence[int] | None = None,
    *,
    csa_ratio: int = 4,
    hca_ratio: int = 128,
) -> list[int]:
    """Per-layer compress ratios in *full* form (one per layer symbol of main + every MTP depth).

    ``ratios`` may be ``None`` (generated from the symbols), compact (one per ``C``/``H``/``W``) or full (one per
    layer symbol, 0 elsewhere). Each ratio is validated against its symbol: ``W``→0, ``C``→``csa_ratio``,
    ``H``→``hca_ratio``.
    """
    _check_ratios(csa_ratio, hca_ratio)
    parsed = _parsed(pattern)
    symbols = parsed.all_symbols
    pattern = parsed.pattern
    expected = [ratio_of_symbol(s, csa_ratio, hca_ratio) for s in symbols]
    if ratios is None:
        return expected
    ratios = [int(r) for r in ratios]
    attn_positions = [i for i, s in enumerate(symbols) if s in DSV4_ATTENTION]
    if len(ratios) == len(symbols):
        full = ratios
        for i, (s, r) in enumerate(zip(symbols, full)):
            if s not in DSV4_ATTENTION and r != 0:
                raise ValueError(
                    f"compress_ratios (full form) entry {i} is {r} at symbol '{s}', which has no compressor: "
                    "non-C/H/W symbols must carry 0"
                )
    elif len(ratios) == len(attn_positions):
        full = [0] * len(symbols)
        for i, r in zip(attn_positions, ratios):
            full[i] = r
    else:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries; pattern {pattern!r} needs {len(attn_positions)} "
            f"(compact: one per C/H/W symbol) or {len(symbols)} (full: one per layer symbol)"
        )
    for i, (s, r, e) in enumerate(zip(symbols, full, expected)):
        if s in DSV4_ATTENTION and r != e:
            raise ValueError(
                f"compress ratio {r} at layer {i} does not match symbol '{s}' ({KIND_NAMES[s]}, ratio {e}); "
                f"use W for 0, C for {csa_ratio}, H for {hca_ratio}"
            )
    return full


def symbol_of_ratio(ratio: int, csa_ratio: int = 4, hca_ratio: int = 128) -> str:
    """``0``→``W``, ``csa_ratio``→``C``, ``hca_ratio``→``H`` (``ValueError`` otherwise)."""
    table = {0: WINDOW, csa_ratio: CSA, hca_ratio: HCA}
    if ratio not in table:
        raise ValueError(
            f"compress ratio {ratio} is neither 0 (window), {csa_ratio} (CSA) nor {hca_ratio} (HCA); "
            "set csa_ratio / hca_ratio to the ratios your config uses"
        )
    return table[ratio]


def split_stages(num_layers: int, pipeline_stages: int | Sequence[int]) -> list[int]:
    """Blocks per pipeline stage: an int splits as evenly as possible (earlier stages get the extra block)."""
    if isinstance(pipeline_stages, int):
        if pipeline_stages < 1 or pipeline_stages > num_layers:
            raise ValueError(f"pipeline_stages must be in [1, {num_layers}], got {pipeline_stages}")
        q, rem = divmod(num_layers, pipeline_stages)
        return [q + (1 if i < rem else 0) for i in range(pipeline_stages)]
    sizes = [int(s) for s in pipeline_stages]
    if sum(sizes) != num_layers or any(s < 1 for s in sizes):
        raise ValueError(f"blocks per stage {sizes} must be positive and sum to {num_layers}")
    return sizes


def pattern_from_compress_ratios(
    compress_ratios: Sequence[int],
    num_layers: int,
    *,
    csa_ratio: int = 4,
    hca_ratio: int = 128,
    pipeline_stages: int | Sequence[int] = 1,
    ffn_symbol: str = MOE,
) -> str:
    """A hybrid pattern from an official / HF ``compress_ratios`` list (one entry per block, MTP blocks last).

    Each block becomes its attention symbol plus ``ffn_symbol``; entries past ``num_layers`` become MTP depths.
    Example: ``[0, 4, 128, 4, 0]``, ``num_layers=4`` → ``"WECEHECE/WE"``.
    """
    _check_ratios(csa_ratio, hca_ratio)
    ratios = list(compress_ratios)
    if len(ratios) < num_layers:
        raise ValueError(f"compress_ratios has {len(ratios)} entries, fewer than num_layers={num_layers}")
    blocks = [symbol_of_ratio(r, csa_ratio, hca_ratio) + ffn_symbol for r in ratios]
    main, mtp = blocks[:num_layers], blocks[num_layers:]
    segs, start = [], 0
    for n in split_stages(num_layers, pipeline_stages):
        segs.append("".join(main[start : start + n]))
        start += n
    pattern = PIPE.join(segs) + "".join(MTP_SEPARATOR + b for b in mtp)
    if len(set(mtp)) > 1:
        raise ValueError(f"every MTP depth must use the same block, got ratios {ratios[num_layers:]}")
    return pattern


def compress_ratios_from_pattern(pattern: str, *, csa_ratio: int = 4, hca_ratio: int = 128) -> list[int]:
    """The official per-block ``compress_ratios`` list (main blocks then MTP depths) of a DSv4 pattern."""
    p = parse_pattern(pattern)
    return [ratio_of_symbol(s, csa_ratio, hca_ratio) for s in p.all_symbols if s in DSV4_ATTENTION]


@dataclass(frozen=True)
class LayerInfo:
    """One layer of a pattern.

    Attributes:
        index: position in the full symbol sequence (main then MTP depths).
        symbol: the pattern symbol.
        kind: readable kind (``csa``, ``hca``, ``window``, ``moe``, ...).
        compress_ratio: compress ratio of an attention layer (0 otherwise).
        stage: pipeline segment index (``-1`` for MTP layers, which live on the last stage).
        mtp_depth: 0 for main layers, ``k >= 1`` for the k-th MTP depth.
        router: ``"hash"``/``"learned"`` for ``E`` layers, ``""`` otherwise.
        layer_number: megatron-core's 1-based hybrid position (main layers; within-depth for MTP layers).
        attention_kind: the :class:`~dsv4_attention.LayerKind` of ``W`` / ``C`` / ``H`` layers (``None`` otherwise).
    """

    index: int
    symbol: str
    kind: str
    compress_ratio: int
    stage: int
    mtp_depth: int
    router: str
    layer_number: int
    attention_kind: LayerKind | None = None


def hash_layer_numbers(pattern: str | ParsedPattern, num_hash_layers: int) -> list[int]:
    """1-based hybrid positions of the hash-routed MoE layers: the first ``num_hash_layers`` ``E`` symbols.

    The count is in **MoE layers**, not hybrid symbols (upstream P4 pitfall). All of them must be on the first
    pipeline stage (the stage holding the embedding and ``input_ids``). The schedule and its checks are hash-moe's
    :func:`hash_moe.hash_moe_layer_numbers` (one rule for the workspace), on the validated pattern.
    """
    return hash_moe_layer_numbers(_parsed(pattern).pattern, num_hash_layers, moe_symbol=MOE)


def layer_infos(
    pattern: str | ParsedPattern, *, num_hash_layers: int = 0, csa_ratio: int = 4, hca_ratio: int = 128
) -> list[LayerInfo]:
    """Per-layer description of a pattern (used by ``dsv4 inspect`` and the stack spec)."""
    p = _parsed(pattern)
    hashed = set(hash_layer_numbers(p, num_hash_layers))
    out: list[LayerInfo] = []
    idx = 0
    for stage, seg in enumerate(p.segments):
        for s in seg:
            router = ("hash" if idx + 1 in hashed else "learned") if s == MOE else ""
            out.append(
                LayerInfo(
                    idx,
                    s,
                    KIND_NAMES[s],
                    ratio_of_symbol(s, csa_ratio, hca_ratio),
                    stage,
                    0,
                    router,
                    idx + 1,
                    attention_kind(s),
                )
            )
            idx += 1
    for depth in range(1, p.mtp_num_depths + 1):
        for j, s in enumerate(p.mtp_pattern):
            router = "learned" if s == MOE else ""
            out.append(
                LayerInfo(
                    idx,
                    s,
                    KIND_NAMES[s],
                    ratio_of_symbol(s, csa_ratio, hca_ratio),
                    -1,
                    depth,
                    router,
                    j + 1,
                    attention_kind(s),
                )
            )
            idx += 1
    return out
