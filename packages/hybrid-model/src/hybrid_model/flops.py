"""FLOP accounting of a DSv4 model (upstream D9): per layer kind, SBHD or packed THD, forward and training.

One multiply-add = 2 FLOPs; only matrix products are counted (norms, softmax, Sinkhorn's ``n_hc×n_hc`` iterations
and the compressor's per-channel pooling are below 1% and left out). Per token (``d`` hidden, ``c`` head dim,
``n_h`` heads, ``d_c`` q rank, ``g·d_g`` output rank, ``n_I``/``c_I`` indexer heads/dim, ``n`` mHC streams)::

    projections  2·(d·d_c + d_c·n_h·c + d·c + n_h·c·d_g + g·d_g·d)
    compressor   CSA 2·2·(2c)·d        HCA 2·2·c·d
    indexer      2·(d_c·n_I·c_I + d·n_I) + 2·2·(2c_I)·d
    mHC          2·n·d·(2+n)·n (coefficients) + 2·n·d (collapse) + 2·n·d + 2·n²·d (post + combᵀ mix)
    MoE          2·d·E (router) + (K + shared)·2·3·d·f
    dense MLP -  2·3·d·f
    attention *  2·(3·d·d + d·d) (QKV, output; n_h heads of d/n_h dims) + 4·d per causal (query, key) pair
    MLA +        2·(d·d_c + d_c·n_h·c + d·c + L·n_h·(2c - r) + n_h·c·d)   (L = c - r: kv rank = q/k nope dim)
                 + 4·n_h·c per causal (query, key) pair
    DSA D        the same projections (the absorbed q·W_UK and ·W_UV einsums cost what the kv up-projection
                 does) + indexer 2·(d_c·n_I·c_I + d·c_I + d·n_I) + 2·n_h·(2c - r) per selected pair
                 (q·k over L + r latent dims, p·v over L) + 2·n_I·c_I + 2·n_I per causal indexer pair
    GDN G        2·d·(2·Hk·dk + 2·Hv·dv + 2·Hv) + 2·Hv·dv·d (projections) + 6·Hv·dk·dv (gated delta rule,
                 recurrent form; :mod:`hybrid_model.gated_delta_net`)
    head         2·d·V  (+ HyperHead 2·n·d·n + 2·n·d)
    MTP          2·d·d (e_proj) + n·2·d·d (h_proj per stream) + its block + HyperHead + head
    mHC off      no mHC / HyperHead terms, n = 1

Attention cores cost ``4·n_h·c`` per (query, key) pair (``q·k`` and ``p·v``) and the indexer ``2·n_I·c_I + 2·n_I``
per (query, visible compressed entry) pair. For a document of length ``L`` (query ``t = 0..L-1``):

    window pairs   Σ_t min(t+1, n_win)
    DSA pairs      Σ_t min(t+1, k)      (megatron's top-k over the causal keys; indexer pairs: Σ_t (t+1))
    CSA pairs      Σ_t min(k, ⌊(t+1)/m⌋)         (top-k of the visible entries; dense phase: all visible)
    HCA pairs      Σ_t ⌊(t+1)/m'⌋
    indexer pairs  Σ_t ⌊(t+1)/m⌋

:func:`forward_flops` sums these exactly over documents (SBHD = ``B`` documents of length ``S``).
:func:`forward_flops_cp_rank` is the exact share of one context-parallel rank (its rows of a pack).
:func:`forward_flops_from_stats` is the closed form from ``Σ len`` and ``Σ len²`` that a packed-THD scheduler
knows (as in upstream D9): window ``n_win`` keys per token, CSA ``k`` entries per token, HCA ``Σ len²/(2m')`` and
indexer ``Σ len²/(2m)`` pairs (``D``: ``k`` selected keys per token) — an upper bound that is within a few percent for ``len ≫ m·k``.
Training = 3 × forward (backward is twice the forward). MFU = achieved FLOP/s ÷ peak.

Each layer's terms are its record's (``flops`` per token and ``core_flops`` per visited pair, :mod:`hybrid_model.mixers`);
this module adds mHC, the heads, the MTP projections and the pair counts (:class:`~hybrid_model.mixers.record.Pairs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from dsv4_attention import LayerKind
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.record import Pairs
from hybrid_model.mixers.registry import REGISTRY, counted_symbols
from hybrid_model.symbols import KIND_NAMES


# ----------------------------------------------------------------------------------------- pair counts
def window_pairs(length: int, window: int) -> int:
    """``Σ_{t<L} min(t+1, W)`` in closed form."""
    if length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def visible_entries_sum(length: int, ratio: int) -> int:
    """``Σ_{t<L} ⌊(t+1)/m⌋`` in closed form (visible compressed entries summed over queries)."""
    q, r = divmod(
        length, ratio
    )  # t+1 = 1..L; value w holds for m positions, w = 0..q-1, then q for r+1 positions
    return ratio * q * (q - 1) // 2 + q * (r + 1)


def selected_entries_sum(length: int, ratio: int, topk: int) -> int:
    """``Σ_{t<L} min(k, ⌊(t+1)/m⌋)`` in closed form."""
    t_sat = topk * ratio  # first t+1 at which k entries are visible
    if length < t_sat:
        return visible_entries_sum(length, ratio)
    return visible_entries_sum(t_sat - 1, ratio) + topk * (length - t_sat + 1)


# ----------------------------------------------------------------------------------------- per-token terms
def _mhc(cfg: DSv4ModelConfig) -> int:
    if not cfg.enable_mhc_connections:  # plain residual: an add (not a matrix product)
        return 0
    n, d = cfg.hc_mult, cfg.hidden_size
    return 2 * n * d * (2 + n) * n + 2 * n * d + 2 * n * d + 2 * n * n * d


def _hyper_head(cfg: DSv4ModelConfig) -> int:
    if not cfg.enable_mhc_connections:
        return 0
    n, d = cfg.hc_mult, cfg.hidden_size
    return 2 * n * d * n + 2 * n * d


def _layers(cfg: DSv4ModelConfig) -> list[tuple[str, str]]:
    """``(symbol, component prefix)`` of every layer, main then each MTP depth."""
    p = cfg.parsed_pattern
    return [(s, "") for s in p.main] + [(s, "mtp.") for _ in range(p.mtp_num_depths) for s in p.mtp_pattern]


@dataclass
class FlopBreakdown:
    """Forward FLOPs by component (``fwd``), ``total``, ``training`` (3×) and the token count."""

    tokens: int
    components: dict[str, float] = field(default_factory=dict)

    @property
    def forward(self) -> float:
        return float(sum(self.components.values()))

    @property
    def training(self) -> float:
        return 3.0 * self.forward

    def add(self, key: str, value: float) -> None:
        self.components[key] = self.components.get(key, 0.0) + float(value)

    def mfu(self, step_seconds: float, peak_flops: float, *, training: bool = True) -> float:
        """Model FLOPs utilisation of one step of these tokens that took ``step_seconds`` on ``peak_flops``."""
        if step_seconds <= 0 or peak_flops <= 0:
            raise ValueError("step_seconds and peak_flops must be positive")
        return (self.training if training else self.forward) / step_seconds / peak_flops

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(forward=self.forward, training=self.training)
        return d


def _add_linear_terms(br: FlopBreakdown, cfg: DSv4ModelConfig, tokens: float) -> None:
    p = cfg.parsed_pattern

    def layer(symbol: str, prefix: str) -> None:
        flops = REGISTRY[symbol].flops
        if flops is None:
            raise ValueError(
                f"FLOP accounting covers the symbols {counted_symbols('flops')} ; {symbol!r} (megatron-core's "
                f"{KIND_NAMES[symbol]} layer) is not counted: use a pattern without it"
            )
        for key, per_token in flops(cfg).items():
            br.add(prefix + key, per_token * tokens)
        if cfg.enable_mhc_connections:
            br.add(prefix + "mhc", _mhc(cfg) * tokens)

    for s in p.main:
        layer(s, "")
    br.add("head", (2 * cfg.hidden_size * cfg.vocab_size + _hyper_head(cfg)) * tokens)
    d, n = cfg.hidden_size, cfg.num_streams
    for _ in range(p.mtp_num_depths):
        br.add("mtp.projections", (2 * d * d + n * 2 * d * d) * tokens)
        for s in p.mtp_pattern:
            layer(s, "mtp.")
        br.add("mtp.head", (2 * d * cfg.vocab_size + _hyper_head(cfg)) * tokens)


def _add_cores(br: FlopBreakdown, cfg: DSv4ModelConfig, pairs: Pairs) -> None:
    """The attention cores of every layer, pass by pass (:attr:`~hybrid_model.mixers.record.SymbolRecord.core_pass`;
    pattern order within a pass)."""
    layers = [(REGISTRY[s], prefix) for s, prefix in _layers(cfg) if REGISTRY[s].core_flops is not None]
    for record, prefix in sorted(layers, key=lambda layer: layer[0].core_pass):
        for key, value in record.core_flops(cfg, pairs).items():
            br.add(prefix + key, value)


def forward_flops(cfg: DSv4ModelConfig, lengths: Sequence[int], *, dense: bool = False) -> FlopBreakdown:
    """Exact forward FLOPs of one micro-batch of documents with the given ``lengths`` (SBHD: ``[S] * B``).

    ``dense=True`` counts the dense-attention warm-up (CSA attends to every visible entry, §5).
    """
    lengths = [int(x) for x in lengths]
    if any(x < 0 for x in lengths):
        raise ValueError(f"document lengths must be >= 0, got {lengths}")
    tokens = sum(lengths)
    br = FlopBreakdown(tokens=tokens)
    _add_linear_terms(br, cfg, tokens)
    m, mh = (
        LayerKind.CSA.compress_ratio,
        LayerKind.HCA.compress_ratio,
    )  # = cfg.csa/hca_compress_ratio (validated)
    k, W = cfg.index_topk, cfg.sliding_window
    win = sum(window_pairs(L, W) for L in lengths)
    csa = sum((visible_entries_sum(L, m) if dense else selected_entries_sum(L, m, k)) for L in lengths)
    hca = sum(visible_entries_sum(L, mh) for L in lengths)
    idx = sum(visible_entries_sum(L, m) for L in lengths)
    causal = sum(L * (L + 1) // 2 for L in lengths)
    dsa = sum(window_pairs(L, k) for L in lengths)
    _add_cores(br, cfg, Pairs(causal=causal, dsa=dsa, window=win, csa=csa, hca=hca, indexer=idx))
    return br


def forward_flops_sbhd(
    cfg: DSv4ModelConfig, seq_len: int, batch: int = 1, *, dense: bool = False
) -> FlopBreakdown:
    """Forward FLOPs of ``batch`` sequences of length ``seq_len``."""
    if seq_len < 1 or batch < 1:
        raise ValueError(f"seq_len and batch must be >= 1, got {seq_len}, {batch}")
    return forward_flops(cfg, [seq_len] * batch, dense=dense)


def forward_flops_from_stats(
    cfg: DSv4ModelConfig, sum_len: int, sum_len_sq: int, *, dense: bool = False
) -> FlopBreakdown:
    """Forward FLOPs of packed THD documents from ``Σ len`` and ``Σ len²`` only (closed form, see module doc)."""
    if sum_len < 0 or sum_len_sq < sum_len:
        raise ValueError(f"need sum_len >= 0 and sum_len_sq >= sum_len, got {sum_len}, {sum_len_sq}")
    br = FlopBreakdown(tokens=int(sum_len))
    _add_linear_terms(br, cfg, sum_len)
    m, mh = (
        LayerKind.CSA.compress_ratio,
        LayerKind.HCA.compress_ratio,
    )  # = cfg.csa/hca_compress_ratio (validated)
    k, W = cfg.index_topk, cfg.sliding_window
    pairs = Pairs(
        causal=(sum_len_sq + sum_len) / 2,  # Σ_t (t + 1) = (Σ len² + Σ len) / 2, exact
        dsa=k * sum_len,  # DSA: k keys per token, upper bound
        window=W * sum_len,
        csa=sum_len_sq / (2 * m) if dense else k * sum_len,
        hca=sum_len_sq / (2 * mh),
        indexer=sum_len_sq / (2 * m),
    )
    _add_cores(br, cfg, pairs)
    return br


def forward_flops_cp_rank(
    cfg: DSv4ModelConfig,
    lengths: Sequence[int],
    padded_lengths: Sequence[int],
    *,
    total_tokens: int,
    cp_rank: int,
    cp_size: int,
    dense: bool = False,
) -> FlopBreakdown:
    """Exact forward FLOPs of CP rank ``cp_rank``'s rows of one packed THD micro-batch under static contiguous
    context parallelism (rank ``r`` holds the pack's rows ``[r·L, (r+1)·L)``, ``L = total_tokens / cp_size``).

    Document ``i`` occupies the padded rows ``[o_i, o_i + padded_lengths[i])``, its ``lengths[i]`` real tokens first.
    A rank is charged the linear terms of its real rows and the attention pairs of its real queries: every pair count
    above is a sum over queries ``t`` of a per-query count, so the queries ``[a, b)`` of a document cost
    ``F(b) - F(a)`` with ``F(n)`` the closed form for length ``n``. The ranks' values add up to
    :func:`forward_flops` of the whole pack; later ranks pay more attention (causal). Boundary work the CP attention
    repeats (halo rows' projections, compressed entries of groups straddling a rank edge) is not model work and is
    not counted (as MFU conventions do)."""
    if len(lengths) != len(padded_lengths) or any(
        not 0 <= n <= p for n, p in zip(lengths, padded_lengths, strict=True)
    ):
        raise ValueError(
            f"need 0 <= lengths[i] <= padded_lengths[i], got {list(lengths)}, {list(padded_lengths)}"
        )
    if cp_size < 1 or not 0 <= cp_rank < cp_size or total_tokens % cp_size:
        raise ValueError(
            f"need 0 <= cp_rank < cp_size and total_tokens a multiple of cp_size, got cp_rank={cp_rank}, "
            f"cp_size={cp_size}, total_tokens={total_tokens}"
        )
    if sum(int(p) for p in padded_lengths) > total_tokens:
        raise ValueError(
            f"the padded documents ({sum(padded_lengths)} rows) exceed total_tokens={total_tokens}"
        )
    local = total_tokens // cp_size
    start, stop = cp_rank * local, (cp_rank + 1) * local
    m, mh = LayerKind.CSA.compress_ratio, LayerKind.HCA.compress_ratio
    k, W = cfg.index_topk, cfg.sliding_window
    counts = {
        "win": lambda n: window_pairs(n, W),
        "csa": (lambda n: visible_entries_sum(n, m)) if dense else (lambda n: selected_entries_sum(n, m, k)),
        "hca": lambda n: visible_entries_sum(n, mh),
        "idx": lambda n: visible_entries_sum(n, m),
        "causal": lambda n: n * (n + 1) // 2,  # '*', '+' and the DSA indexer
        "dsa": lambda n: window_pairs(n, k),  # DSA: min(t+1, k) selected keys
    }
    pairs = dict.fromkeys(counts, 0)
    tokens, offset = 0, 0
    for n, padded in zip(lengths, padded_lengths, strict=True):
        a = min(max(start - offset, 0), n)  # this rank's real queries of the document: [a, b)
        b = min(max(stop - offset, 0), n)
        tokens += b - a
        for key, f in counts.items():
            pairs[key] += f(b) - f(a)
        offset += int(padded)
    br = FlopBreakdown(tokens=tokens)
    _add_linear_terms(br, cfg, tokens)
    _add_cores(
        br,
        cfg,
        Pairs(
            causal=pairs["causal"],
            dsa=pairs["dsa"],
            window=pairs["win"],
            csa=pairs["csa"],
            hca=pairs["hca"],
            indexer=pairs["idx"],
        ),
    )
    return br


def summarize_by_kind(br: FlopBreakdown) -> dict[str, float]:
    """Group components into attention / moe / mhc / head / mtp totals."""
    out: dict[str, float] = {}
    for key, v in br.components.items():
        group = "mtp" if key.startswith("mtp.") else key.split(".")[0]
        out[group] = out.get(group, 0.0) + v
    return out
