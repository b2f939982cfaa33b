"""The keyword arguments shared by every column-parallel linear of DSv4 attention.

``wq_a``, ``wq_b``, ``wkv``, the compressors' ``wkv`` / ``wgate`` and the indexer's ``wq_b`` / ``weights_proj`` are
all built as ``build_module(spec, in_features, out_features, tp_comm_buffer_name=..., **column_parallel_kwargs(...))``.
"""

from __future__ import annotations


def column_parallel_kwargs(config, tp_group) -> dict:
    """No bias, output left sharded over ``tp_group``, not an expert, initialised with ``config.init_method``."""
    return dict(
        config=config,
        init_method=config.init_method,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
        is_expert=False,
        tp_group=tp_group,
    )
