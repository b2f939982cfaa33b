"""Loading a megatron dist checkpoint written at another tensor-parallel size.

DSv4 attention's linears are megatron linear layers at TP 1 and plain ``torch.nn`` modules of one rank's size at
TP > 1 (:mod:`dsv4_attention.megatron`): at TP 1 each contributes an ``_extra_state`` entry (megatron's linears
keep none: it is ``None``, declared for TE compatibility) that a TP > 1 checkpoint does not hold. Every parameter
is stored under its TP 1 key and global shape at every TP size, so a TP 2 checkpoint loads at TP 1 once those empty
entries are left out of the request. :func:`load_across_tp` does that, and only that: a requested parameter or
buffer that the checkpoint lacks is still an error.
"""

from __future__ import annotations

from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling

EXTRA_STATE_SUFFIX = "_extra_state"


class MissingCheckpointEntries(ValueError):
    """The checkpoint lacks entries (other than empty ``_extra_state`` ones) that the model requests."""


def load_across_tp(
    sharded_state_dict: dict[str, Any], path: str, *, model_key: str = "model"
) -> dict[str, Any]:
    """``dist_checkpointing.load(sharded_state_dict, path)``, where the ``_extra_state`` objects of
    ``sharded_state_dict[model_key]`` (a flat dict: state-dict name -> sharded entry) that the checkpoint does not
    hold load as ``None`` (what megatron's linears save). Any other requested entry the checkpoint lacks raises
    :class:`MissingCheckpointEntries` naming the first few."""
    model = sharded_state_dict[model_key]
    extra = {
        sh.key: name
        for name, sh in model.items()
        if isinstance(sh, ShardedObject) and name.endswith(EXTRA_STATE_SUFFIX)
    }
    state, _missing, unexpected = dist_checkpointing.load(
        sharded_state_dict, path, strict=StrictHandling.RETURN_UNEXPECTED
    )
    absent = sorted(k for k in unexpected if k not in extra)
    if absent:
        shown = ", ".join(absent[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
        raise MissingCheckpointEntries(f"the checkpoint holds no {shown}")
    for key in unexpected:
        state[model_key][extra[key]] = None  # megatron's linears: get_extra_state() is None
    return state
