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

import pytest
import torch

from hybrid_model.generation import SamplingConfig, SpeculationStats, generate
from hybrid_model.generation.decoder import CachedDecoder
from hybrid_model.generation.mtp_draft import MTPDrafter
from hybrid_model.generation.spec_sampling import accept_drafts
from hybrid_model.generation.speculative import speculative_generate

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


# prompts ending inside / on the window (8), on a ratio-4 boundary, just before the ratio-128 boundary; 1 token
PROMPT_LENGTHS = (1, 8, 12, 126)


def prompts_of(lengths, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


class ScriptedDrafter:
    """A draft model that knows the greedy continuation ``expected[b]`` (prompt + tokens) and drafts it, except at
    positions ``t % 3 == 0`` where it drafts a wrong token (so drafts are both accepted and rolled back)."""

    def __init__(self, expected: list[list[int]]) -> None:
        self.expected = expected
        self.lengths = [0] * len(expected)

    def extend(self, streams, next_ids):
        out = []
        for b, ids in enumerate(next_ids):
            self.lengths[b] += len(ids)
            if not ids:
                out.append(torch.zeros(0, 512))
                continue
            t = self.lengths[b] - 1  # the last row fed: the draft is the token at t + 2
            seq = self.expected[b]
            tok = seq[t + 2] if t + 2 < len(seq) else 0
            tok = (tok + 1) % 512 if t % 3 == 0 else tok
            out.append(torch.nn.functional.one_hot(torch.tensor([tok]), 512).float() * 10)
        return out


def test_greedy_speculative_equals_plain_greedy(megatron_cpu):
    """The random MTP head (drafts mostly rejected) and a scripted drafter (2 of 3 drafts right): both give
    plain greedy decoding's tokens for a batch of prompts of different lengths (crossing 128)."""
    model = tiny_model()
    prompts = prompts_of(PROMPT_LENGTHS)
    plain = generate(model, prompts, 5)
    stats = SpeculationStats()
    streamed = []
    mtp = generate(
        model, prompts, 5, speculative="mtp", stats=stats, on_token=lambda b, t: streamed.append((b, t))
    )
    assert mtp == plain
    assert sorted(streamed) == sorted((b, t) for b, seq in enumerate(plain) for t in seq)
    assert 0 < stats.drafted <= 4 * 4 and 1 <= stats.steps <= 4
    scripted_stats = SpeculationStats()
    expected = [p + o for p, o in zip(prompts, plain)]
    got = speculative_generate(
        model,
        prompts,
        5,
        SamplingConfig(),
        eos_token_id=None,
        on_token=None,
        stats=scripted_stats,
        drafter=ScriptedDrafter(expected),
    )
    assert got == plain
    assert scripted_stats.accepted > 0 and scripted_stats.accepted < scripted_stats.drafted
    assert scripted_stats.steps < 4  # accepted drafts save main-model steps


def test_acceptance_rule_samples_the_target_distribution():
    """20,000 rows of one (p, q) pair over 5 tokens: the tokens that come out follow p (not q)."""
    n = 20_000
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.4, 0.1, 0.0, 0.4])
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q.expand(n, 5), 1, generator=g)[:, 0]
    accepted, tokens = accept_drafts(p.expand(n, 5), q.expand(n, 5), drafts, g)
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert (freq - p).abs().max() < 0.015, freq  # 4.5 standard errors at p = 0.5
    # acceptance probability sum_x min(p, q) = 0.1 + 0.2 + 0.1 + 0 + 0.05
    assert abs(accepted.float().mean().item() - 0.45) < 0.015


def test_speculative_sampling_seed_top_p_and_refusals(megatron_cpu):
    model = tiny_model()
    prompts = [[1, 2, 3], [7]]
    a = generate(model, prompts, 4, temperature=1.0, seed=3, speculative="mtp")
    assert [len(x) for x in a] == [4, 4]
    # a nucleus of one token: p and q one-hot, sampling is greedy
    greedy = generate(model, prompts, 4)
    assert generate(model, prompts, 4, temperature=2.0, top_p=1e-9, seed=1, speculative="mtp") == greedy
    stop = greedy[0][1]
    stopped = generate(model, prompts, 4, eos_token_id=stop, speculative="mtp")
    assert stopped[0] == greedy[0][: greedy[0].index(stop) + 1]
    with pytest.raises(ValueError, match="speculative must be None or 'mtp'"):
        generate(model, prompts, 2, speculative="eagle")
    with pytest.raises(ValueError, match="pass it with speculative='mtp'"):
        generate(model, prompts, 2, stats=SpeculationStats())
    no_mtp = tiny_model(num_nextn_predict_layers=0, compress_ratios=(0, 4, 128, 4, 128, 4))
    with pytest.raises(ValueError, match="has none: use a model with num_nextn_predict_layers >= 1"):
        generate(no_mtp, prompts, 2, speculative="mtp")
