"""The static-shape decode step (``StaticDecodeStep``; ``generate(decode="static" | "graph")``) on the ``tiny``
preset: teacher-forced logits equal the full forward's (fp32 rule of ``test_generation.py``), greedy tokens equal the
eager decode path's; the CUDA graph (GPU only) replays the static step exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hash_moe.megatron import ClampedSwiGLUExperts
from hybrid_model.generation import CachedDecoder, StaticDecodeStep, generate
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

sys.path.insert(0, str(Path(__file__).parent))
from test_generation import assert_close, full_logits, tiny_model


def test_static_steps_equal_the_full_forward(megatron_cpu):
    """Ragged prompts (1 token; inside / on the window of 8; ratio-4 boundary; crossing the first 128 block),
    prefilled together, then 6 static steps in lockstep (teacher forcing)."""
    model = tiny_model()
    g = torch.Generator().manual_seed(5)
    prompts = [1, 8, 13, 124, 127]
    seqs = [torch.randint(0, 512, (p + 6,), generator=g).tolist() for p in prompts]
    dec = CachedDecoder(model, len(seqs), max(prompts) + 6)
    dec.extend([s[:p] for s, p in zip(seqs, prompts)])
    step = StaticDecodeStep(dec)
    rows = [[] for _ in seqs]
    for i in range(6):
        logits = step(torch.tensor([s[p + i] for s, p in zip(seqs, prompts)]))  # [B, V]
        for b in range(len(seqs)):
            rows[b].append(logits[b].clone())
    assert dec.lengths == tuple(p + 6 for p in prompts)
    for b, (seq, p) in enumerate(zip(seqs, prompts)):
        assert_close(f"static, prompt {p}", torch.stack(rows[b]), full_logits(model, seq)[p:])
    with pytest.raises(ValueError, match="more than the decoder's max_length"):
        step(torch.zeros(len(seqs), dtype=torch.long))
    with pytest.raises(ValueError, match="one token per sequence"):
        step(torch.zeros(2, dtype=torch.long))


def test_static_generate_equals_eager_generate(megatron_cpu):
    model = tiny_model()
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (125, 3, 8)]
    eager = generate(model, prompts, 5)
    assert generate(model, prompts, 5, decode="static") == eager
    stop = eager[1][2]  # a sequence that stops early keeps being fed in lockstep, the others are unaffected
    assert generate(model, prompts, 5, decode="static", eos_token_id=stop) == generate(
        model, prompts, 5, eos_token_id=stop
    )
    with pytest.raises(ValueError, match="decode must be one of 'eager', 'static', 'graph'"):
        generate(model, prompts, 2, decode="fast")
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        generate(model, prompts, 2, decode="graph")
    with pytest.raises(ValueError, match=r"call decoder\.extend"):
        StaticDecodeStep(CachedDecoder(model, 1, 8))


@pytest.mark.gpu
def test_cuda_graph_decode_replays_the_static_step(megatron_cpu):
    """bf16 on CUDA: the graphed step gives the static eager step's tokens and logits (the same kernels)."""
    from hybrid_model.model import build_model
    from hybrid_model.presets import get_preset

    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), params_dtype=torch.bfloat16, bf16=True).cuda().eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (125, 3, 8, 64)]
    static = generate(model, prompts, 12, decode="static")
    assert generate(model, prompts, 12, decode="graph") == static
    seqs = [p + s for p, s in zip(prompts, static)]
    runs = []
    for cuda_graph in (False, True):
        dec = CachedDecoder(model, len(seqs), max(map(len, seqs)))
        dec.extend(prompts)
        step = StaticDecodeStep(dec, cuda_graph=cuda_graph)
        runs.append(
            [
                step(torch.tensor([s[len(p) + i - 1] for s, p in zip(seqs, prompts)], device="cuda")).clone()
                for i in range(1, 12)
            ]
        )
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_decode_steps_run_the_routed_expert_kernels(megatron_cpu):
    """bf16 on CUDA: decode steps (few rows) take hash-moe's routed-expert kernels, a long prefill the grouped GEMM;
    the first step's logits meet the tolerance rule against the same weights in fp32, with the grouped GEMM's bf16
    step (``routed_max_rows = 0``) as the yardstick."""
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), params_dtype=torch.bfloat16, bf16=True).cuda().eval()
    experts = [m for m in model.modules() if isinstance(m, ClampedSwiGLUExperts)]
    taken: list[tuple[int, bool]] = []
    for m in experts:
        m.register_forward_pre_hook(
            lambda mod, inp: taken.append((inp[0].shape[0], mod._takes_routed_path(inp[0])))
        )
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (125, 3, 8, 64)]
    logits = []
    for max_rows in (256, 0):
        for m in experts:
            m.routed_max_rows = max_rows
        dec = CachedDecoder(model, len(prompts), 140)
        taken.clear()
        dec.extend(prompts)
        prefill = list(taken)
        taken.clear()
        logits.append(dec.step(torch.tensor([1, 2, 3, 4], device="cuda")).float())
        if max_rows:
            assert prefill and not any(t for _, t in prefill), prefill  # 200 tokens x top-k rows: grouped
            assert taken and all(t for _, t in taken), taken
    routed, grouped = logits
    # the tolerance rule: the same weights in fp32 (grouped path) are the reference, the grouped bf16 path (what
    # plain megatron computes in bf16) the yardstick
    model32 = build_model(get_preset("tiny"), params_dtype=torch.float32).cuda().eval()
    model32.load_state_dict(
        {
            k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in model.state_dict().items()
        }
    )
    for m in model32.modules():
        if isinstance(m, ClampedSwiGLUExperts):
            m.routed_max_rows = 0  # the reference: megatron's grouped GEMM
    dec = CachedDecoder(model32, len(prompts), 140)
    dec.extend(prompts)
    ref = dec.step(torch.tensor([1, 2, 3, 4], device="cuda")).float()
    assert_close_to_ref("routed decode logits", routed, ref, grouped)


def test_last_only_logits_are_the_last_rows(megatron_cpu):
    """``extend(last_only=True)`` runs the output layer on each sequence's last new row only (ragged, a 0 count)."""
    model = tiny_model()
    full, last = CachedDecoder(model, 3, 20), CachedDecoder(model, 3, 20)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    for a, b in zip(full.extend(prompts), last.extend(prompts, last_only=True)):
        assert b.shape == (1, 512)
        assert_close("last_only prefill", b, a[-1:])  # the head's GEMM on fewer rows: rounding only
    feed = [[10, 11], [], [12]]
    got = last.extend(feed, last_only=True)
    assert [tuple(g.shape) for g in got] == [(1, 512), (0, 512), (1, 512)]
    for a, b in zip(full.extend(feed), got):
        if len(a):
            assert_close("last_only step", b, a[-1:])
