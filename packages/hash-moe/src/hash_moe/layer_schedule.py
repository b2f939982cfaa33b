"""Which MoE layers route by hash: the first ``num_hash_layers`` **MoE layers** (not pattern positions).

Upstream pitfall (P4): megatron's hybrid ``layer_number`` counts every pattern symbol, so ``moe_n_hash_layers=3``
with a pattern starting ``"WEWECE"`` hashed only the first ``E``. Here the count is over MoE symbols only, MTP
layers (after the first ``/``) never hash, and every hash layer must sit on the first pipeline stage (before the
first ``|``: the stage that holds the embedding and ``input_ids``). This is the one schedule of the workspace
(``hybrid_model.symbols.hash_layer_numbers`` uses it).

Pattern syntax (megatron hybrid): one symbol per layer, ``|`` marks a pipeline cut, ``/`` starts the MTP part.
"""

from __future__ import annotations


def hash_moe_layer_flags(pattern: str, num_hash_layers: int, *, moe_symbol: str = "E") -> list[bool]:
    """One flag per main-decoder layer symbol of ``pattern`` (separators skipped): True for a hash-routed MoE layer.

    Raises ``ValueError`` for a negative count, more hash layers than main MoE layers, or a hash layer past the
    first pipeline stage.

    >>> hash_moe_layer_flags("WEWECEHE", 3)
    [False, True, False, True, False, True, False, False]
    """
    if num_hash_layers < 0:
        raise ValueError(f"num_hash_layers must be >= 0, got {num_hash_layers}")
    if len(moe_symbol) != 1:
        raise ValueError(f"moe_symbol must be one character, got {moe_symbol!r}")
    main_with_cuts = pattern.split("/", 1)[0]
    main = main_with_cuts.replace("|", "")
    num_moe = main.count(moe_symbol)
    if num_hash_layers > num_moe:
        raise ValueError(
            f"num_hash_layers={num_hash_layers} but pattern {pattern!r} has only {num_moe} main MoE layers "
            f"('{moe_symbol}'); the count is in MoE layers, not pattern positions"
        )
    flags, seen = [], 0
    for sym in main:
        is_moe = sym == moe_symbol
        flags.append(is_moe and seen < num_hash_layers)
        seen += is_moe
    first_stage = len(main_with_cuts.split("|", 1)[0])
    chosen = [i + 1 for i, f in enumerate(flags) if f]
    if chosen and chosen[-1] > first_stage:
        raise ValueError(
            f"hash-routed MoE layers {chosen} must all live on the first pipeline stage (layers 1..{first_stage} "
            f"of {pattern!r}), which holds the embedding and input_ids; move the first '|' later or lower "
            "num_hash_layers"
        )
    return flags


def hash_moe_layer_numbers(pattern: str, num_hash_layers: int, *, moe_symbol: str = "E") -> list[int]:
    """1-based megatron ``layer_number`` of every hash-routed MoE layer of ``pattern`` (checks as
    :func:`hash_moe_layer_flags`).

    >>> hash_moe_layer_numbers("WEWECEHE", 3)
    [2, 4, 6]
    """
    flags = hash_moe_layer_flags(pattern, num_hash_layers, moe_symbol=moe_symbol)
    return [i + 1 for i, f in enumerate(flags) if f]
