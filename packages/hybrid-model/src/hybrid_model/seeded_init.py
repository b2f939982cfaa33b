"""Layout-independent initialisation: every parameter's initial value is a function of ``(seed, its global name)``.

megatron draws a model's initial weights from one random stream in construction order (on CPU the default
generator, on CUDA the RNG tracker's model-parallel and expert streams). A pipeline stage therefore starts its
first layer from a fresh stream, a second VPP chunk from the first chunk's leftovers and an EP rank's experts from
the same stream as EP rank 0's: the same ``--seed`` gives another model under every layout (measured before this
module: ``dsv4 train --preset tiny --seed 11`` step-1 LM loss 6.2468 in one process, 6.2192 under PP2 x VPP2).

:func:`seed_parameters` re-draws, after construction, every parameter megatron initialised at random from a
generator of its own, seeded by :func:`parameter_seed` ``(seed, global name)``:

* the global name is the parameter's name in the one-process model: decoder layers are numbered by their global
  ``layer_number`` (``decoder.layers.{layer_number - 1}.…``; every PP stage and VPP chunk numbers its layers from 0
  locally), the MTP block, embedding (and the last stage's MTP copy of it) and output layer keep their names;
* routed experts ``[G_local, ...]`` (EP): expert ``e`` of EP rank ``r`` is global expert ``r·G_local + e``, drawn
  from ``(seed, name, global expert)``: EP ranks hold slices of the EP=1 tensor;
* tensor-parallel shards (``partition_dim``, ``partition_stride``): the whole ``[TP=1]`` tensor is drawn and this
  rank's part kept by megatron's stride rule (:func:`~hybrid_model.seeded_draw.tp_shard_draw`), so TP shards are
  parts of the TP=1 tensor.

The distributions are megatron's (the ones each module applied at construction, read from the config, never
re-chosen): ``normal(0, σ)`` with ``σ = config.init_method``'s std, the output projections (``linear_proj``,
``linear_fc2``, the shared experts' ``linear_down``, the routed experts' ``down_proj``, GDN/Mamba ``out_proj``)
``config.output_layer_init_method``'s std (``σ / sqrt(2·num_layers)``), the mHC ``fn`` projections
``MHCConfig.init_std``. Parameters built constant (norm weights 1, biases / attention sinks / mHC ``base`` 0, mHC
``scale`` 0.01, GDN ``dt_bias`` 1) are the same under every layout already and are kept; so are buffers (hash
tables: a function of the vocabulary and seed only; router biases 0). Kept as megatron builds them, and so still
layout-dependent: the non-normal random inits of megatron's GDN/Mamba layers (``A_log``, ``conv1d``,
Mamba's ``dt_bias``), returned by :func:`seed_parameters` by name.

Values are drawn in fp32 on the parameter's device and rounded once to the parameter's dtype (megatron's CPU
initialisation does the same; bf16 params). CPU and CUDA generators give different streams: layouts agree within one
device type. The one-process model changes too (its draws no longer follow construction order).
"""

from __future__ import annotations

import functools
import re

import torch

from hash_moe.megatron import ClampedSwiGLUExperts
from hybrid_model.seeded_draw import group_rank_size, normal_draw, parameter_seed, tp_shard_draw
from mhc import MHCConfig

#: modules whose ``weight`` megatron initialises with ``output_layer_init_method`` (the residual-branch outputs)
OUTPUT_PROJECTIONS = frozenset({"linear_proj", "linear_fc2", "linear_down", "out_proj"})
#: random non-normal inits of megatron's GDN / Mamba layers: kept as built (see the module docstring)
NON_NORMAL = frozenset({"A_log", "dt_bias", "conv1d", "conv1d_weight", "conv1d_bias"})

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def normal_std(init_method, what: str) -> float:
    """The std of megatron's ``init_method_normal`` / ``scaled_init_method_normal`` (``partial(normal_, mean=0,
    std=σ)``); ``ValueError`` for any other initialiser (its distribution cannot be re-drawn here)."""
    fn = init_method
    if isinstance(fn, functools.partial) and fn.func is torch.nn.init.normal_:
        kw = fn.keywords
        if float(kw.get("mean", 0.0)) == 0.0 and "std" in kw:
            return float(kw["std"])
    raise ValueError(
        f"layout-independent initialisation re-draws normal(0, std) initialisers; {what} is {init_method!r}: "
        "use megatron's init_method_normal / scaled_init_method_normal (init_method_std)"
    )


def global_parameter_names(model) -> dict[int, str]:
    """``id(param)`` -> the parameter's name in the one-process model (decoder layers by global ``layer_number``)."""
    local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    out = {}
    for name, p in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            name = f"decoder.layers.{local_to_global[int(m.group(1))]}.{name[m.end() :]}"
        out[id(p)] = name
    return out


def _is_constant(p: torch.Tensor) -> bool:
    flat = p.detach().reshape(-1)
    return flat.numel() <= 1 or bool((flat == flat[0]).all())


def _rule(model, module, module_name: str, attr: str, p: torch.Tensor) -> float | None:
    """The std ``p`` (attribute ``attr`` of ``module``) is re-drawn with; ``None``: kept as built (constant, or a
    non-normal GDN/Mamba init)."""
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf in NON_NORMAL or attr in NON_NORMAL or _is_constant(p):
        return None
    config = model.config
    if isinstance(module, ClampedSwiGLUExperts):
        method = config.output_layer_init_method if attr == "down_proj" else config.init_method
    elif isinstance(getattr(module, "config", None), MHCConfig):
        return float(module.config.init_std)
    elif leaf == "word_embeddings":
        method = getattr(config, "embedding_init_method", None) or config.init_method
    elif leaf in OUTPUT_PROJECTIONS:
        method = config.output_layer_init_method
    else:
        method = config.init_method
    return normal_std(method, f"the initialiser of {module_name}.{attr}")


@torch.no_grad()
def seed_parameters(model, seed: int) -> list[str]:
    """Re-draw the random parameters of ``model`` (a :class:`~hybrid_model.model.DSv4Model`, one PP stage or VPP
    chunk) as functions of ``(seed, global name)`` with megatron's distributions (module docstring). Returns the
    global names kept as built because their init is random but not normal (GDN/Mamba ``A_log``, ``conv1d``,
    Mamba's ``dt_bias``)."""
    names = global_parameter_names(model)
    tp_group = getattr(model.pg_collection, "tp", None)
    kept: list[str] = []
    for module_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            name = names[id(p)]
            std = _rule(model, module, module_name, attr, p)
            if std is None:
                if not _is_constant(p):
                    kept.append(name)
                continue
            if isinstance(
                module, ClampedSwiGLUExperts
            ):  # [G_local, ...]: expert e is global expert first + e
                first = group_rank_size(module.ep_group)[0] * p.shape[0]
                for e in range(p.shape[0]):
                    p[e].copy_(normal_draw(p.shape[1:], std, parameter_seed(seed, name, first + e), p.device))
                continue
            p.copy_(tp_shard_draw(p, std, parameter_seed(seed, name), tp_group))
    return kept


def expected_std(model, name: str) -> float | None:
    """The std :func:`seed_parameters` re-draws parameter ``name`` (a local name of ``model``) with; ``None`` when it
    is kept as built."""
    module_name, attr = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    return _rule(model, module, module_name, attr, getattr(module, attr))


__all__ = [
    "NON_NORMAL",
    "OUTPUT_PROJECTIONS",
    "expected_std",
    "global_parameter_names",
    "normal_std",
    "seed_parameters",
]
