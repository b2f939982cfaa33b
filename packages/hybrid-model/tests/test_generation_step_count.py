"""Regression gate of the device-resident decode step (issue 37): the host syncs / uploads of one eager decode step
of the ``tiny`` preset (W C H C H C + hash / learned MoE), counted on CPU by
:func:`~hybrid_model.generation.step_count.decode_step_counts`.

Gate: no sync and no upload in any attention layer (window, CSA, HCA); the whole step's syncs are megatron's
all-gather token dispatcher's only (``MoEAllGatherTokenDispatcher.dispatch_postprocess``: ``tokens_per_expert
.cpu()`` and a ``masked_select`` of the local probs, 2 per MoE layer) and its one upload the new token ids. Two
steps are counted: one that completes no compressed block (position 9) and one that completes a CSA block
(position 11: (11 + 1) mod 4 = 0).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_model.generation.step_count import decode_step_counts, layers_per_scope
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

ATTENTION = ("window", "csa", "hca")
DISPATCHER_SYNCS_PER_MOE_LAYER = 2


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prompt_length", [8, 10], ids=["no-block", "csa-block"])
def test_decode_step_has_no_attention_sync(megatron_cpu, batch, prompt_length):
    torch.manual_seed(0)
    model = build_model(get_preset("tiny")).eval()
    counts = decode_step_counts(model, batch, prompt_length)
    layers = layers_per_scope(model)
    for kind in ATTENTION:
        assert kind in counts, f"no {kind} layer ran"
        c = counts[kind]
        assert (c.syncs, c.uploads) == (0, 0), (
            f"{kind}: {c.syncs} syncs, {c.uploads} uploads: {dict(c.sites)}"
        )
    syncs = sum(c.syncs for c in counts.values())
    uploads = sum(c.uploads for c in counts.values())
    sites = {name: dict(c.sites) for name, c in counts.items() if c.sites}
    assert syncs <= DISPATCHER_SYNCS_PER_MOE_LAYER * layers["moe"], sites
    assert all("token_dispatcher.py" in site for site in counts["moe"].sites), sites
    assert uploads <= 1, sites  # the token ids
