"""MTP speculative decoding (``generate(..., speculative="mtp")``) on the ``tiny`` preset (MTP depth ``WE``).

- the MTP drafter's cached logits equal depth 1's logits of the full forward (``DSv4Model.mtp_logits``) at every
  position (fp32 rule of ``test_generation.py``);
- greedy speculative decoding gives plain greedy decoding's tokens, with the random MTP head (drafts mostly
  rejected) and with a scripted drafter whose drafts are mostly right (accepted drafts, rollback of the rest),
  for batches of prompts of different lengths ending on the window (8), ratio-4 and ratio-128 boundaries;
- the sampling acceptance rule draws from the main model's distribution.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hybrid_model.generation.decoder import CachedDecoder
from hybrid_model.generation.mtp_draft import MTPDrafter

sys.path.insert(0, str(Path(__file__).parent))
from test_generation import RTOL, tiny_model


def full_mtp_logits(model, ids: list[int]) -> torch.Tensor:
    """Depth-1 MTP logits ``[T, V]`` of the full forward of one sequence (row ``t`` predicts token ``t + 2``)."""
    kept = []
    handle = model.decoder.register_forward_hook(lambda _m, _a, out: kept.append(out[1]))
    x = torch.tensor([ids])
    try:
        with torch.no_grad():
            model(x, None, None)
    finally:
        handle.remove()
    with torch.no_grad():
        return model.mtp_logits(kept[0], x)[:, 0].float()


def test_mtp_drafter_equals_full_forward(megatron_cpu):
    """Teacher forcing: prefill 10 tokens (the drafter takes rows 0..9), then one row per step of both."""
    model = tiny_model()
    seq = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    dec, draft = CachedDecoder(model, 1, 24), MTPDrafter(model, 1, 24)
    _, streams = dec.extend([seq[:10]], streams=True)
    got = [draft.extend(streams, [seq[1:11]])[0]]
    for t in range(10, 23):
        _, streams = dec.extend([seq[t : t + 1]], streams=True)
        got.append(draft.extend(streams, [seq[t + 1 : t + 2]])[0])
    full = full_mtp_logits(model, seq)[[9] + list(range(10, 23))]
    err = (torch.cat(got) - full).abs().max().item()
    assert err <= RTOL * max(1.0, full.abs().max().item()), err
