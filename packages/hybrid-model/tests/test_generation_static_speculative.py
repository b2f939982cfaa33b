"""The static speculative step (``StaticSpeculativeStep``; ``generate(speculative="mtp", decode="static" |
"graph")``) on the ``tiny`` preset (MTP depth ``WE``; window 8, ratios 4 and 128).

- teacher forcing with scripted acceptance (both the kept second row and the on-device rollback of a rejected one,
  per sequence, main and drafter caches): the verify logits equal the full forward's, the draft logits depth 1's
  logits of the full forward (fp32 rule of ``test_generation.py``), for prompts ending on the window / ratio-4 /
  ratio-128 boundaries;
- greedy: the tokens of plain greedy decoding and of the eager speculative loop, with its acceptance counters;
  sampling (one sequence: the same generator draws in the same order): the eager loop's tokens;
- the CUDA graphs (GPU only) replay the static step's tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.generation import (
    CachedDecoder,
    MTPDrafter,
    SamplingConfig,
    SpeculationStats,
    StaticSpeculativeStep,
    generate,
)
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

sys.path.insert(0, str(Path(__file__).parent))
from test_generation import assert_close, tiny_model
from test_generation_speculative import PROMPT_LENGTHS, prompts_of


@pytest.fixture(scope="module")
def model():
    with megatron_cpu_context():
        yield tiny_model()


def full_forward(model, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One full forward (no cache) of the whole sequences ``seqs [B, T]``: the main logits ``[B, T, V]`` and depth
    1's MTP logits ``[B, T, V]`` (row ``t`` predicts token ``t + 2``)."""
    kept = []
    handle = model.decoder.register_forward_hook(lambda _m, _a, out: kept.append(out[1]))
    try:
        with torch.no_grad():
            logits = model.compute_logits(seqs)  # [B, T, V]
    finally:
        handle.remove()
    with torch.no_grad():
        mtp = model.mtp_logits(kept[0], seqs).float()  # [T, B, V]
    return logits, mtp.transpose(0, 1)


class ScriptedStep(StaticSpeculativeStep):
    """Teacher forcing: every draft is the sequence's true next token; ``accept`` decides which drafts are kept
    (a rejected one is dropped although right: the rollback must still give the 1-row cache)."""

    def __init__(self, *args, seqs: torch.Tensor, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seqs = seqs  # [B, T] the token ids
        self.accept = torch.zeros(self.batch, dtype=torch.bool)

    def _at(self, offset: int) -> torch.Tensor:
        return self.seqs.gather(1, (self.lengths + offset)[:, None])[:, 0]  # [B]

    def _decide(self) -> None:
        self.record.copy_(torch.stack([self._at(1), self._at(2), self.accept.long()], dim=1))

    def _draw_draft(self) -> None:
        self.tokens[self.batch :].copy_(self._at(1))


def test_scripted_steps_equal_the_full_forward(model):
    prompts = list(PROMPT_LENGTHS)
    steps, bsz = 4, len(prompts)
    g = torch.Generator().manual_seed(2)
    seqs = torch.randint(0, 512, (bsz, max(prompts) + 2 * steps + 2), generator=g)  # [B, T]
    max_length = max(prompts) + 2 * steps + 2
    dec, drafter = CachedDecoder(model, bsz, max_length), MTPDrafter(model, bsz, max_length)
    _, streams = dec.extend([seqs[b, :p].tolist() for b, p in enumerate(prompts)], streams=True)
    draft = drafter.extend(streams, [seqs[b, 1 : p + 1].tolist() for b, p in enumerate(prompts)])
    step = ScriptedStep(dec, drafter, SamplingConfig(), seqs=seqs)
    step.start(seqs[torch.arange(bsz), torch.tensor(prompts)], torch.cat(draft))
    full, full_mtp = full_forward(model, seqs)  # [B, T, V] each
    accept = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.bool)
    for i in range(steps):
        n = step.lengths.clone()  # [B] the position of t
        step.accept = accept[:, i]
        record = step().tolist()
        step.advance([r[2] for r in record])
        for b in range(bsz):
            pos = int(n[b])
            assert_close(
                f"verify, prompt {prompts[b]}, step {i}", step.logits[[b, bsz + b]], full[b][pos : pos + 2]
            )
            kept = pos + int(accept[b, i])  # the drafter's last kept row
            assert_close(f"draft, prompt {prompts[b]}, step {i}", step.draft_logits[b], full_mtp[b][kept])
        assert step.lengths.tolist() == (n + 1 + accept[:, i].long()).tolist()
    assert dec.lengths == drafter.lengths == tuple(step.lengths.tolist())


def test_greedy_static_speculative_equals_plain_and_eager(model):
    prompts = prompts_of(PROMPT_LENGTHS)
    plain = generate(model, prompts, 5)
    eager_stats, static_stats = SpeculationStats(), SpeculationStats()
    eager = generate(model, prompts, 5, speculative="mtp", stats=eager_stats)
    streamed = []
    static = generate(
        model,
        prompts,
        5,
        speculative="mtp",
        decode="static",
        stats=static_stats,
        on_token=lambda b, t: streamed.append((b, t)),
    )
    assert static == eager == plain
    assert static_stats == eager_stats and static_stats.drafted > 0
    assert sorted(streamed) == sorted((b, t) for b, seq in enumerate(plain) for t in seq)
    # a zero head: every logit 0, the main model's and the MTP head's argmax token 0 (ties: the first), so every
    # draft is accepted (2 tokens per step; the last step's bonus dropped at max_new_tokens = 4)
    saved = model.output_layer.weight.detach().clone()
    with torch.no_grad():
        model.output_layer.weight.zero_()
    try:
        eager_stats, static_stats = SpeculationStats(), SpeculationStats()
        eager = generate(model, prompts, 4, speculative="mtp", stats=eager_stats)
        assert generate(model, prompts, 4, speculative="mtp", decode="static", stats=static_stats) == eager
        assert eager == [[0] * 4] * len(prompts)
        assert static_stats == eager_stats == SpeculationStats(drafted=4, accepted=4, steps=2)
    finally:
        with torch.no_grad():
            model.output_layer.weight.copy_(saved)
    # the longest prompt stops at its first token and keeps being fed (up to its length cap, max_length - 2) while
    # the others run on, unaffected
    stop = plain[3][0]
    assert generate(model, prompts, 5, speculative="mtp", decode="static", eos_token_id=stop) == generate(
        model, prompts, 5, speculative="mtp", eos_token_id=stop
    )


def test_sampling_static_speculative_equals_eager(model):
    prompt = prompts_of([12], seed=9)
    kwargs = dict(temperature=1.0, top_p=0.9, seed=4, speculative="mtp")
    eager_stats, static_stats = SpeculationStats(), SpeculationStats()
    eager = generate(model, prompt, 6, stats=eager_stats, **kwargs)
    assert generate(model, prompt, 6, decode="static", stats=static_stats, **kwargs) == eager
    assert static_stats == eager_stats
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        generate(model, prompt, 2, speculative="mtp", decode="graph")
    dec, drafter = CachedDecoder(model, 1, 8), MTPDrafter(model, 1, 8)
    dec.extend([[1, 2]])
    with pytest.raises(ValueError, match="prefill both"):
        StaticSpeculativeStep(dec, drafter, SamplingConfig())


def test_static_speculative_refusals(model):
    # decode="graph" off CUDA: refused before the prefill (no token streamed), even when one token is asked for
    streamed = []
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        generate(
            model, [[1, 2, 3]], 1, speculative="mtp", decode="graph", on_token=lambda b, t: streamed.append(t)
        )
    assert streamed == []
    # a step writes positions n and n + 1 < max_length: a sequence of 7 rows does not fit max_length 8
    dec, drafter = CachedDecoder(model, 2, 8), MTPDrafter(model, 2, 8)
    _, streams = dec.extend([[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]], streams=True)
    drafter.extend(streams, [[2, 3, 4], [2, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(ValueError, match="at most 6 rows"):
        StaticSpeculativeStep(dec, drafter, SamplingConfig())


@pytest.mark.gpu
def test_cuda_graph_speculative_replays_the_static_step():
    """bf16 on CUDA: the graphed speculative steps (greedy: one graph; sampling: two) give the static eager
    step's tokens and counters."""
    with megatron_cpu_context():
        torch.manual_seed(0)
        gpu = build_model(get_preset("tiny"), params_dtype=torch.bfloat16, bf16=True).cuda().eval()
        prompts = prompts_of((125, 3, 8, 64), seed=7)
        for kwargs in (dict(), dict(temperature=0.8, seed=1)):
            runs = []
            for decode in ("static", "graph"):
                stats = SpeculationStats()
                runs.append(
                    (
                        generate(gpu, prompts, 12, speculative="mtp", decode=decode, stats=stats, **kwargs),
                        stats,
                    )
                )
            assert runs[0] == runs[1], kwargs
