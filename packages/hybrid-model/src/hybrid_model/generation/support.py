"""What cached generation supports, checked once at the boundary (:func:`check_generation_support`).

Supported: a whole :class:`~hybrid_model.model.DSv4Model` on one process (one pipeline stage, no context or expert
parallelism; DSv4 attention is TP = 1 anyway) whose main pattern holds only the DSv4 attention symbols ``W`` / ``C`` /
``H`` and the MoE symbol ``E`` (hash or learned routing), with mHC or with the plain residual (mHC off). MTP depths
are not run (plain next-token decoding). megatron-core's own layers (``-`` dense MLP, ``*`` attention, ``+`` MLA,
``D`` DSA, ``G`` GDN, ``M`` Mamba) have no decode cache here: a pattern holding one is refused, naming it.
"""

from __future__ import annotations

from dsv4_attention import LayerKind
from hybrid_model.symbols import MOE

#: the main-pattern symbols cached decoding runs: DSv4 attention (W / C / H) and the MoE (E)
SUPPORTED_SYMBOLS = frozenset({kind.symbol for kind in LayerKind} | {MOE})


def check_generation_support(model) -> None:
    """``ValueError`` (what, and how to fix it) unless ``model`` can be decoded with a cache (module docstring)."""
    cfg = getattr(model, "model_config", None)
    if cfg is None or not hasattr(model, "decoder"):
        raise ValueError(
            f"generation needs a hybrid_model DSv4Model (hybrid_model.model.build_model or "
            f"hybrid_model.hf.load_hf_checkpoint), got {type(model).__name__}"
        )
    if not (model.pre_process and model.post_process):
        raise ValueError(
            "generation needs the whole model on one pipeline stage (pre_process and post_process); build it "
            "without pipeline parallelism"
        )
    unsupported = sorted(set(cfg.parsed_pattern.main) - SUPPORTED_SYMBOLS)
    if unsupported:
        names = ", ".join(repr(s) for s in unsupported)
        raise ValueError(
            f"pattern {cfg.parsed_pattern.pattern!r} holds megatron-core layer symbol(s) {names}, which cached "
            f"generation does not support (no decode cache for them); it supports the main symbols "
            f"{''.join(sorted(SUPPORTED_SYMBOLS))} (DSv4 window / CSA / HCA attention and MoE)"
        )
    if model.context_parallel_group is not None:
        raise ValueError(
            "generation runs without context parallelism: build the model with context parallel size 1"
        )
    ep = getattr(model.pg_collection, "ep", None)
    if ep is not None and ep.size() > 1:
        raise ValueError(
            f"generation runs without expert parallelism (expert parallel size {ep.size()}): build the model with "
            "expert_model_parallel_size=1"
        )
