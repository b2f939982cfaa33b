"""The record of one pattern symbol (:class:`SymbolRecord`) and the checks that read it.

A record holds, as data, everything the model, its counts and its refusals need to know about one layer symbol: its
spec builder, how the stack builds its layer, the optional packages it needs (:class:`Dependency`), the layouts it
refuses with their reasons (:class:`Refusal`), its analytic parameter count and its FLOPs. The checks below raise
the record's own reason strings, so the record is the one place where a symbol's refusals are written.

Message forms (``R`` = a refusal's ``reason``):

* :attr:`Layout.CP`, :attr:`Layout.TP`, :attr:`Layout.PACKED`, :attr:`Layout.CPU`: ``pattern symbol 'S' R``
  (:meth:`SymbolRecord.message`), raised when the layer is built (or, for ``PACKED``, runs);
* :attr:`Layout.CUDA_GRAPH`: ``--cuda-graph cannot run the pattern 'P': R`` (before training);
* :attr:`Layout.PACKED_CUDA_GRAPH`: ``--cuda-graph --packed cannot run the pattern 'P': ... R ...``
  (:func:`hybrid_model.mixers.registry.check_packed_graph_pattern`, called by the trainer before training);
* ``*``'s context-parallel refusal is its core attention's whole message
  (:data:`hybrid_model.standard_attention.CP_REFUSAL`).
"""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.spec_utils import build_module


class Layout(enum.Enum):
    """A way of running a layer that a symbol may refuse."""

    CP = "context parallelism"
    TP = "tensor parallelism"
    PACKED = "packed THD batches"
    CUDA_GRAPH = "CUDA graphs"
    PACKED_CUDA_GRAPH = "CUDA graphs of packed THD batches"
    CPU = "a machine without a CUDA GPU"


@dataclass(frozen=True)
class Refusal:
    """``layout`` is refused with ``reason``; ``condition`` says when, if not always (e.g. "without
    transformer-engine")."""

    layout: Layout
    reason: str
    condition: str = ""


@dataclass(frozen=True)
class Dependency:
    """An optional package a symbol's layer needs: the Python ``module`` and the ``package`` text (pip name and the
    extra that installs it) that the ``ImportError`` names."""

    module: str
    package: str

    def installed(self) -> bool:
        """Whether ``module`` can be imported (without importing it)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # a parent that fails to import, or sys.modules[m] = None
            return False


#: the reason of megatron's layers that refuse tensor parallelism here (their local spec / torch rule has no TP path)
TP_REASON = "runs with tensor_model_parallel_size=1 only here: use --tp 1 or a pattern without it"
#: megatron-core's own layers read THD document boundaries on the host (``cu_seqlens.tolist()``, ``max_seqlen`` from
#: the batch), which a captured step would bake in
HOST_BOUNDARIES = Refusal(
    Layout.PACKED_CUDA_GRAPH,
    "read the packed document boundaries on the host, so a captured step would replay the first pack's boundaries",
)

TRANSFORMER_ENGINE = Dependency(
    "transformer_engine", "transformer-engine (the `hybrid-model[gpu]` extra; its spec builds the layer)"
)


def is_local(backend) -> bool:
    """Whether the local (no transformer-engine) spec is wanted: megatron's ``LocalSpecProvider``, or no backend
    and transformer-engine not importable."""
    return (
        isinstance(backend, LocalSpecProvider) if backend is not None else not TRANSFORMER_ENGINE.installed()
    )


@dataclass(frozen=True)
class LayerParams:
    """The analytic parameters of one layer: ``parts`` (component -> count, in the order they are reported; the
    ``attention*`` parts are the layer's attention parameters) and ``inactive``, the parameters a token does not
    activate (the routed experts beyond its top-k)."""

    parts: Mapping[str, int]
    inactive: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def attention(self) -> int:
        return sum(v for k, v in self.parts.items() if k.startswith("attention"))


@dataclass(frozen=True)
class Pairs:
    """The (query, key) pairs one micro-batch's attention cores visit (exact sums, or the closed forms of
    :func:`hybrid_model.flops.forward_flops_from_stats`): ``causal`` every causally visible key, ``dsa`` DSA's
    selected keys, ``window`` the sliding window's keys, ``csa`` CSA's selected (dense phase: visible) compressed
    entries, ``hca`` HCA's visible entries, ``indexer`` the CSA indexer's visible entries."""

    causal: float
    dsa: float
    window: float
    csa: float
    hca: float
    indexer: float


@dataclass(frozen=True)
class LayerSite:
    """Where the stack builds one layer: megatron's ``config``, the 1-based ``layer_number``, the process groups and
    the pipeline / MTP position."""

    config: Any
    layer_number: int
    pg_collection: Any
    is_mtp_layer: bool
    pp_layer_offset: int


#: the keywords :meth:`SymbolRecord.build_inner` may pass beyond ``config``, ``layer_number`` and ``pg_collection``
BUILD_KEYWORDS = frozenset({"is_mtp_layer", "pp_layer_offset", "add_layer_offset"})


@dataclass(frozen=True)
class SymbolRecord:
    """Everything about one pattern symbol (see the module doc).

    Attributes:
        symbol: the pattern character.
        layer: what the layer is, as messages name it.
        spec: ``spec(model_config, backend, is_mtp) -> ModuleSpec`` of the layer (``E``: the learned router's).
        build_keywords: which of :data:`BUILD_KEYWORDS` megatron's module takes (``add_layer_offset`` is passed as
            ``False``: the stack numbers the layers).
        mixer: the layer is a megatron mixer (``MambaLayer``), not a ``TransformerLayer`` (its mHC / residual wrapper
            differs).
        dependencies: optional packages the layer needs.
        refusals: the layouts the layer refuses, each with its reason.
        params: ``params(model_config, hashed) -> LayerParams`` (the layer's input norm included), or ``None``: not
            counted analytically.
        flops: ``flops(model_config) -> {component: FLOPs per token}`` of the layer's matrix products outside the
            attention core, or ``None``: not counted.
        core_flops: ``core_flops(model_config, pairs) -> {component: FLOPs}`` of its attention core, or ``None``.
        core_pass: the FLOP accounting adds the attention cores pass by pass (``*``, ``+``, ``D``, then ``W C H`` in
            pattern order): D9's order, which keeps its sums bit for bit.
    """

    symbol: str
    layer: str
    spec: Callable[..., Any]
    build_keywords: frozenset[str] = frozenset({"add_layer_offset"})
    mixer: bool = False
    dependencies: tuple[Dependency, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    params: Callable[..., LayerParams] | None = None
    flops: Callable[..., dict[str, int]] | None = None
    core_flops: Callable[..., dict[str, float]] | None = None
    core_pass: int = 0

    def __post_init__(self) -> None:
        if not self.build_keywords <= BUILD_KEYWORDS:
            raise ValueError(f"build_keywords {sorted(self.build_keywords)} not in {sorted(BUILD_KEYWORDS)}")
        if len({r.layout for r in self.refusals}) != len(self.refusals):
            raise ValueError(f"symbol {self.symbol!r}: one refusal per layout")

    def refusal(self, layout: Layout) -> Refusal | None:
        """The refusal of ``layout`` (``None``: supported)."""
        return next((r for r in self.refusals if r.layout is layout), None)

    def message(self, layout: Layout, **details: str) -> str:
        """``pattern symbol 'S' <reason>`` of a refused ``layout`` (``details`` fill the reason's ``{fields}``)."""
        refusal = self.refusal(layout)
        if refusal is None:
            raise ValueError(f"pattern symbol {self.symbol!r} does not refuse {layout.value}")
        return f"pattern symbol '{self.symbol}' {refusal.reason.format(**details)}"

    def check_single_rank(self, config, pg_collection) -> None:
        """``ValueError`` with the record's reason for context parallelism (``pg_collection.cp`` larger than one)
        and tensor parallelism (``config.tensor_model_parallel_size``) where the record refuses them."""
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.refusal(Layout.CP) and cp is not None and cp.size() > 1:
            raise ValueError(self.message(Layout.CP))
        if self.refusal(Layout.TP) and config.tensor_model_parallel_size != 1:
            raise ValueError(self.message(Layout.TP))

    def missing_packages(self) -> list[str]:
        """The ``package`` text of every dependency that is not installed."""
        return [dep.package for dep in self.dependencies if not dep.installed()]

    def require_packages(self) -> None:
        """``ImportError`` naming every missing package the layer needs."""
        missing = self.missing_packages()
        if missing:
            raise ImportError(
                f"pattern symbol '{self.symbol}' builds megatron-core's {self.layer} layer, which needs "
                f"{' and '.join(missing)} (and a CUDA GPU): install them, or use a pattern without '{self.symbol}' "
                "('+' MLA and 'D' DSA run without any optional package)"
            )

    def build_inner(self, spec, site: LayerSite):
        """The layer (without the mHC / residual wrapper) of ``spec`` at ``site``."""
        keywords = {
            "is_mtp_layer": site.is_mtp_layer,
            "pp_layer_offset": site.pp_layer_offset,
            "add_layer_offset": False,
        }
        return build_module(
            spec,
            config=site.config,
            layer_number=site.layer_number,
            pg_collection=site.pg_collection,
            **{k: v for k, v in keywords.items() if k in self.build_keywords},
        )
