"""What every megatron-built submodule shares: column-parallel linear keywords, parameter device, initialiser."""

from __future__ import annotations

import torch


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
