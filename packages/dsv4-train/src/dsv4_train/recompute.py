"""Activation recompute of ``dsv4 train``: the ``--recompute-*`` flags and their :class:`RecomputeConfig`.

megatron's vocabulary (``--recompute-granularity selective|full``, ``--recompute-modules``, ``--recompute-method
uniform|block``, ``--recompute-num-layers``) plus upstream P2's ``--mhc-recompute-layer-num``; what each module
recomputes is in :mod:`dsv4_primitives.recompute.config`. Gradients are those of a run without recompute (bit for
bit with deterministic kernels: the recomputed activations are the forward's). Works with ``--pp`` (each stage
recomputes its own layers) and ``--cuda-graph`` (megatron allows both granularities with a full-iteration graph;
the DSv4 layers draw no random numbers, so graphed recompute needs no RNG replay).
"""

from __future__ import annotations

from dsv4_primitives.recompute import METHODS, SELECTIVE_MODULES, RecomputeConfig

# the "long context on one GPU" recipe of the README (TrainConfig fields): every selective module but megatron's
# whole-MoE ``moe`` (``moe_act`` covers the expert activations), the mHC streams rebuilt in groups of two layers
LONG_CONTEXT_SELECTIVE: dict = {
    "recompute_granularity": "selective",
    "recompute_modules": [m for m in SELECTIVE_MODULES if m != "moe"],
    "mhc_recompute_layer_num": 2,
}


def recompute_config(tc) -> RecomputeConfig:
    """The :class:`RecomputeConfig` of a :class:`~dsv4_train.config.TrainConfig` (``ValueError`` naming
    the flag when the combination is invalid)."""
    try:
        return RecomputeConfig(
            granularity=tc.memory.recompute_granularity,
            modules=tuple(tc.memory.recompute_modules),
            method=tc.memory.recompute_method,
            num_layers=tc.memory.recompute_num_layers,
            mhc_layer_num=tc.memory.mhc_recompute_layer_num,
        )
    except ValueError as e:
        raise ValueError(f"--recompute-* flags: {e}") from e


def add_recompute_flags(p, d) -> None:
    """The ``--recompute-*`` flags of ``dsv4 train`` (``d(field, text)`` adds the field's default to the help)."""
    p.add_argument(
        "--recompute-granularity",
        choices=("selective", "full"),
        help=d(
            "recompute_granularity",
            "activation recompute: selective (the --recompute-modules) or full (whole layers, "
            "--recompute-method/--recompute-num-layers); less memory for more compute, same gradients",
        ),
    )
    p.add_argument(
        "--recompute-modules",
        nargs="+",
        choices=SELECTIVE_MODULES,
        metavar="MODULE",
        help=d(
            "recompute_modules",
            "selective: mhc (residual streams inside groups of --mhc-recompute-layer-num layers), layernorm "
            "(attn/ffn/q norm outputs), mla_up_proj (q up-projection + kv projection with norms and RoPE; q and kv "
            "themselves rebuilt), compressor, indexer, core_attn (top-k, sparse attention, indexer KL), moe_act "
            "(expert SwiGLU output), moe (whole MoE layer)",
        ),
    )
    p.add_argument(
        "--recompute-method",
        choices=METHODS,
        help=d(
            "recompute_method",
            "full: uniform (checkpoint every chunk of --recompute-num-layers layers of a stage) or block "
            "(the first --recompute-num-layers layers of each stage)",
        ),
    )
    p.add_argument(
        "--recompute-num-layers",
        type=int,
        help=d("recompute_num_layers", "full: layers per chunk (uniform) or per stage (block)"),
    )
    p.add_argument(
        "--mhc-recompute-layer-num",
        type=int,
        help=d(
            "mhc_recompute_layer_num",
            "selective mhc: layers per mHC recompute group (the group's input streams are kept, the streams "
            "inside it rebuilt in backward one group at a time); null = one group per stage",
        ),
    )
