"""``RecomputeConfig``: which activations a DSv4 model recomputes in backward instead of keeping (megatron's vocabulary).

Granularities (megatron-core ``TransformerConfig.recompute_granularity``):

* ``"selective"``: the sub-modules named in ``modules`` keep only their inputs (and, where marked, not even their
  outputs) and run again in backward:

  ===============  ======================================================================================
  module           what is recomputed (the tensors it stops keeping)
  ===============  ======================================================================================
  ``mhc``          the mHC residual streams inside groups of ``mhc_layer_num`` layers (P2): the
                   ``[s, b, n·d]`` fp32 streams between the layers of a group are rebuilt in backward from
                   the group's input, every sub-layer output and its ``post``/``comb`` coefficients
  ``layernorm``    the ``attn_norm`` / ``ffn_norm`` outputs (saved by the projections that read them)
  ``mla_up_proj``  the query up-projection + per-head norm + RoPE and the KV projection + norm + RoPE; their
                   outputs ``q [T, n_h, c]`` / ``kv [T, c]`` are not kept either (upstream D8's KV
                   reconstruction): the core attention's backward gets them recomputed
  ``compressor``   the KV compressor (its projections, gates and pooling)
  ``indexer``      the lightning indexer's query / weight projections and its compressor
  ``core_attn``    the core sparse attention: indices, top-k, the attention itself and the indexer KL
  ``moe_act``      the clamped-SwiGLU activation of the routed and shared experts (its output, kept by the
                   down projection, is recomputed from the up projection's output)
  ``moe``          the whole MoE layer (megatron's own ``moe`` recompute of ``MoELayer``)
  ===============  ======================================================================================

* ``"full"``: whole hybrid layers keep only their input streams; ``method`` ``"uniform"`` checkpoints every chunk
  of ``num_layers`` consecutive layers of a pipeline stage, ``"block"`` the first ``num_layers`` layers of each
  stage (the rest keep everything), as megatron's ``TransformerBlock`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

GRANULARITIES = ("selective", "full")
METHODS = ("uniform", "block")
SELECTIVE_MODULES = (
    "mhc",
    "layernorm",
    "mla_up_proj",
    "compressor",
    "indexer",
    "core_attn",
    "moe_act",
    "moe",
)
# the modules megatron-core 0.19.2 implements itself (passed on in TransformerConfig.recompute_modules)
MEGATRON_MODULES = ("moe",)


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute of one model (see the module docstring).

    Attributes:
        granularity: ``None`` (keep every activation), ``"selective"`` or ``"full"``.
        modules: selective: the recomputed sub-modules (:data:`SELECTIVE_MODULES`).
        method: full: ``"uniform"`` or ``"block"``.
        num_layers: full: layers per checkpointed chunk (uniform) or checkpointed layers per stage (block).
        mhc_layer_num: selective ``mhc``: layers per mHC recompute group (upstream ``mhc_recompute_layer_num``);
            ``None`` = one group per pipeline stage. A group keeps its input streams; the streams between its
            layers are rebuilt in backward, one group at a time.
    """

    granularity: str | None = None
    modules: tuple[str, ...] = ()
    method: str | None = None
    num_layers: int | None = None
    mhc_layer_num: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        g = self.granularity
        if g is not None and g not in GRANULARITIES:
            raise ValueError(f"recompute granularity must be one of {GRANULARITIES} or None, got {g!r}")
        unknown = sorted(set(self.modules) - set(SELECTIVE_MODULES))
        if unknown:
            raise ValueError(f"unknown recompute modules {unknown}; choose from {list(SELECTIVE_MODULES)}")
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"recompute modules are listed twice: {list(self.modules)}")
        if self.modules and g != "selective":
            raise ValueError(
                f"recompute modules {list(self.modules)} need granularity 'selective' (got {g!r}): full recompute "
                "always recomputes whole layers"
            )
        if g == "selective" and not self.modules:
            raise ValueError("selective recompute needs at least one module (--recompute-modules)")
        if g == "full":
            if self.method not in METHODS:
                raise ValueError(f"full recompute needs a method in {METHODS}, got {self.method!r}")
            if self.num_layers is None or self.num_layers < 1:
                raise ValueError(f"full recompute needs num_layers >= 1, got {self.num_layers}")
        elif self.method is not None or self.num_layers is not None:
            raise ValueError(
                "--recompute-method / --recompute-num-layers apply to --recompute-granularity full only"
            )
        if self.mhc_layer_num is not None:
            if "mhc" not in self.modules:
                raise ValueError(
                    "mhc_recompute_layer_num applies to selective recompute with module 'mhc' only"
                )
            if isinstance(self.mhc_layer_num, bool) or self.mhc_layer_num < 1:
                raise ValueError(
                    f"mhc_recompute_layer_num must be a positive integer, got {self.mhc_layer_num}"
                )
        if "moe" in self.modules and "moe_act" in self.modules:
            raise ValueError(
                "recompute modules 'moe' and 'moe_act' overlap: 'moe' already recomputes the whole MoE layer"
            )

    def selects(self, module: str) -> bool:
        """Whether selective recompute covers ``module`` (one of :data:`SELECTIVE_MODULES`)."""
        if module not in SELECTIVE_MODULES:
            raise ValueError(f"unknown recompute module {module!r}")
        return self.granularity == "selective" and module in self.modules

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    def full_chunks(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """Full recompute of a stage of ``num_layers`` layers: ``[(start, end, checkpointed)]`` covering them in
        order (uniform: chunks of :attr:`num_layers`; block: the first :attr:`num_layers` layers one by one, then
        the rest unchekpointed). Empty for other granularities."""
        if not self.full or num_layers == 0:
            return [(0, num_layers, False)] if num_layers else []
        n = self.num_layers
        if self.method == "uniform":
            return [(s, min(s + n, num_layers), True) for s in range(0, num_layers, n)]
        chunks = [(i, i + 1, True) for i in range(min(n, num_layers))]
        if n < num_layers:
            chunks.append((n, num_layers, False))
        return chunks

    def mhc_group_ends(self, num_layers: int) -> list[bool]:
        """Per layer of a stage: whether its output streams are kept (the end of an mHC recompute group).

        Without ``mhc`` recompute every layer keeps its output."""
        if not self.selects("mhc"):
            return [True] * num_layers
        g = self.mhc_layer_num or num_layers
        return [(i + 1) % g == 0 or i == num_layers - 1 for i in range(num_layers)]

    def megatron_fields(self) -> dict:
        """The megatron ``TransformerConfig`` recompute fields of this setting: full recompute as is; selective with
        only the modules megatron implements itself (:data:`MEGATRON_MODULES`; ours are wired in our modules)."""
        if self.granularity is None:
            return {}
        if self.full:
            return dict(
                recompute_granularity="full",
                recompute_method=self.method,
                recompute_num_layers=self.num_layers,
            )
        return dict(
            recompute_granularity="selective",
            recompute_modules=[m for m in self.modules if m in MEGATRON_MODULES],
        )


NO_RECOMPUTE = RecomputeConfig()


def recompute_config_of(config) -> RecomputeConfig:
    """The :class:`RecomputeConfig` a module built from the megatron ``config`` follows: its ``dsv4_recompute``
    field (hybrid-model sets it), else no recompute. Plain ``TransformerConfig``s carry none."""
    rc = getattr(config, "dsv4_recompute", None)
    return rc if rc is not None else NO_RECOMPUTE
