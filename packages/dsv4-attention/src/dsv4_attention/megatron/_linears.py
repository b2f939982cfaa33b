"""What every megatron-built submodule shares: column-parallel linear keywords, parameter device, initialiser."""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import build_module


def column_parallel_kwargs(config, tp_group) -> dict:
    """No bias, output left sharded over ``tp_group``, not an expert, initialised with ``config.init_method``.

    ``wq_a``, ``wq_b``, ``wkv``, the compressors' ``wkv`` / ``wgate`` and the indexer's ``wq_b`` / ``weights_proj``
    are all built as ``build_module(spec, in_features, out_features, tp_comm_buffer_name=..., **kwargs)``.
    """
    return dict(
        config=config,
        init_method=config.init_method,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
        is_expert=False,
        tp_group=tp_group,
    )


def param_device(config):
    """megatron's placement: the CPU with ``use_cpu_initialization``, else the current CUDA device (meta under a
    meta default device)."""
    if torch.get_default_device().type == "meta":
        return "meta"
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def _skip_init(_tensor: torch.Tensor) -> None:
    """``perform_initialization=False``: leave the tensor as allocated (a checkpoint fills it)."""


def init_method_or_skip(config, init_method=None):
    """``init_method`` (default ``config.init_method``) when ``config.perform_initialization``, else a no-op."""
    if not config.perform_initialization:
        return _skip_init
    return init_method if init_method is not None else config.init_method


def tp_size_of(pg_collection) -> int:
    """The tensor-parallel size of ``pg_collection`` (1 without a TP group)."""
    tp = getattr(pg_collection, "tp", None)
    return 1 if tp is None else tp.size()


def linear_for(
    spec, config, pg_collection, in_features: int, out_features: int, *, name: str, init_method=None
):
    """One bias-free linear ``in_features -> out_features`` of the layer.

    TP size 1: the spec's megatron / transformer-engine linear (column-parallel keywords, ``tp_comm_buffer_name``
    ``name``). TP > 1: a plain ``torch.nn.Linear`` of exactly these sizes (``config.params_dtype``, megatron's
    placement and ``init_method``): under TP the core (:mod:`dsv4_attention.tp`) does its own gathers and
    reduce-scatters, so a megatron TP linear (which would gather the sequence-parallel input or reduce its
    output again) must not run; the caller passes this rank's sizes for the head-split linears and
    :func:`dsv4_attention.tp.mark_tensor_parallel` sets megatron's TP attributes afterwards.
    """
    if tp_size_of(pg_collection) == 1:
        kw = column_parallel_kwargs(config, pg_collection.tp)
        if init_method is not None:
            kw["init_method"] = init_method
        return build_module(spec, in_features, out_features, tp_comm_buffer_name=name, **kw)
    linear = torch.nn.Linear(
        in_features, out_features, bias=False, device=param_device(config), dtype=config.params_dtype
    )
    with torch.no_grad():
        init_method_or_skip(config, init_method)(linear.weight)
    return linear
