"""Which model sizes ``--tp N`` splits, checked on the config before any model is built.

Under ``tensor_model_parallel_size = N`` each TP rank holds ``1/N`` of (the sizes the model's TP-split parameters
carry along their partition axis, :mod:`hybrid_model.hf.megatron_tp`):

* ``o_groups``: DSv4 attention ``W C H`` splits its output-projection groups and their heads (``g / N`` groups,
  ``n_h / N`` heads and sinks per rank; ``o_groups`` divides ``num_attention_heads``);
* ``num_attention_heads``: megatron's ``*`` attention splits its heads;
* ``vocab_size``: the vocab-parallel embedding and output head;
* ``moe_intermediate_size``: megatron's ``-`` MLP and the shared experts of ``E`` are column- / row-parallel over
  their intermediate size (the routed experts stay whole: expert TP 1).

:func:`check_tensor_parallel_sizes` refuses an ``N`` that does not divide one of them in one line: the size, the
``--tp`` values that fit, and the ``model_overrides`` that make ``N`` fit. Not covered: the head counts of
megatron's ``+`` / ``D`` (TE spec; refused under TP on the local spec) and ``M`` (TE only), which megatron checks
when their layers are built.
"""

from __future__ import annotations

import json
import math

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.symbols import ATTENTION, DSV4_ATTENTION, MLP, MOE


def split_sizes(cfg: DSv4ModelConfig) -> dict[str, tuple[int, str]]:
    """``field -> (size, what splits it)`` of every size of ``cfg`` that tensor parallelism divides (module
    docstring), for the symbols its pattern uses."""
    symbols = set(cfg.parsed_pattern.all_symbols)
    sizes: dict[str, tuple[int, str]] = {}
    if symbols & DSV4_ATTENTION:
        sizes["o_groups"] = (
            cfg.o_groups,
            "each TP rank holds whole groups of DSv4 attention's grouped output projection, and their heads",
        )
    if ATTENTION in symbols:
        sizes["num_attention_heads"] = (cfg.num_attention_heads, "megatron's '*' attention splits its heads")
    sizes["vocab_size"] = (
        cfg.vocab_size,
        "the vocab-parallel embedding and output head split the vocabulary",
    )
    if MLP in symbols or (MOE in symbols and cfg.n_shared_experts):
        sizes["moe_intermediate_size"] = (
            cfg.moe_intermediate_size,
            "megatron's '-' MLP and the shared experts split their intermediate size",
        )
    return sizes


def fitting_overrides(cfg: DSv4ModelConfig, tp: int) -> dict[str, int]:
    """The smallest changes of :func:`split_sizes` that ``tp`` divides: each size that ``tp`` does not divide
    rounded up to a multiple of it (``lcm``), and ``num_attention_heads`` raised with ``o_groups`` where the groups
    must hold whole heads."""
    changes = {name: math.lcm(size, tp) for name, (size, _) in split_sizes(cfg).items() if size % tp}
    groups = changes.get("o_groups", cfg.o_groups)
    heads = changes.get("num_attention_heads", cfg.num_attention_heads)
    if heads % groups:
        changes["num_attention_heads"] = math.lcm(heads, groups)
    return changes


def check_tensor_parallel_sizes(cfg: DSv4ModelConfig, tp: int) -> None:
    """``ValueError`` (one line) when ``tp`` does not divide a size of ``cfg`` that tensor parallelism splits: the
    size and why it is split, the ``--tp`` values that fit, and the ``model_overrides`` that make ``tp`` fit."""
    if tp <= 1:
        return
    sizes = split_sizes(cfg)
    bad = [(name, size, why) for name, (size, why) in sizes.items() if size % tp]
    if not bad:
        return
    name, size, why = bad[0]
    g = math.gcd(*(size for size, _ in sizes.values()))
    fits = [t for t in range(1, g + 1) if g % t == 0]
    text = json.dumps(fitting_overrides(cfg, tp))
    raise ValueError(
        f"--tp {tp}: {name}={size} is not divisible by {tp} ({why}); --tp {', '.join(map(str, fits))} "
        f"fit{'s' if len(fits) == 1 else ''} this model, or give it sizes TP {tp} splits: model_overrides {text} in "
        f"the --config file (or --model-overrides '{text}')"
    )


__all__ = ["check_tensor_parallel_sizes", "fitting_overrides", "split_sizes"]
