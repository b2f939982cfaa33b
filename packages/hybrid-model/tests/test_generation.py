"""Cached generation (``hybrid_model.generation``) on the ``tiny`` preset (W C H C H C, window 8, CSA ratio 4 with a
top-4 indexer, HCA ratio 128, mHC n = 4, hash + learned MoE).

Exactness rule (fp32): with teacher forcing, the logits of cached decoding at every position equal the full
(training) forward's logits of the whole sequence within ``max|cached - full| <= 1e-5 * max(1, max|full|)``. The
compressors' ``ape`` and the attention sinks are drawn at random (their initial value 0 would hide a missing term).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_model.generation import CachedDecoder, generate, generation_cache_bytes
from hybrid_model.presets import get_preset

RTOL = 1e-5


def tiny_model(**changes):
    from hybrid_model.model import build_model

    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = build_model(cfg.replace(**changes) if changes else cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".ape") or name.endswith("attn_sink"):
                p.normal_(0.0, 0.5)
    return model


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` of the full forward (no cache) of one whole sequence."""
    return model.compute_logits(torch.tensor([ids]))[0]


def teacher_forced(model, seqs: list[list[int]], prompts: list[int]) -> list[torch.Tensor]:
    """Prefill ``seqs[b][:prompts[b]]`` together, then feed the rest one token per step; every position's logits."""
    dec = CachedDecoder(model, len(seqs), max(len(s) for s in seqs))
    logits = [[rows] for rows in dec.extend([s[:p] for s, p in zip(seqs, prompts)])]
    while any(n < len(s) for n, s in zip(dec.lengths, seqs)):
        feed = [s[n : n + 1] for n, s in zip(dec.lengths, seqs)]
        for b, rows in enumerate(dec.extend(feed)):
            logits[b].append(rows)
    assert dec.lengths == tuple(len(s) for s in seqs)
    return [torch.cat(rows) for rows in logits]


def assert_close(name: str, cached: torch.Tensor, full: torch.Tensor) -> None:
    err = (cached - full).abs().max().item()
    bound = RTOL * max(1.0, full.abs().max().item())
    assert err <= bound, f"{name}: max|cached - full| = {err:.3e} > {bound:.3e}"


def test_teacher_forced_decoding_equals_full_forward(megatron_cpu):
    """A batch of prompts of different lengths (1 token; inside / exactly on the window of 8; on a ratio-4
    boundary; just before, on and after the first ratio-128 block) continued to 140-150 tokens."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompts = [1, 7, 8, 12, 127, 128, 129]
    totals = [140, 150, 141, 145, 140, 147, 142]
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in totals]
    for b, (seq, got) in enumerate(zip(seqs, teacher_forced(model, seqs, prompts))):
        assert got.shape == (len(seq), 512)
        assert_close(f"sequence {b} (prompt {prompts[b]})", got, full_logits(model, seq))


def test_teacher_forced_without_mhc(megatron_cpu):
    """The plain pre-norm residual (mHC off) decodes through the same per-layer caches."""
    model = tiny_model(enable_mhc_connections=False)
    seq = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    (got,) = teacher_forced(model, [seq], [9])
    assert_close("mHC off", got, full_logits(model, seq))


def test_teacher_forced_bf16(megatron_cpu):
    """A bf16 model decodes in bf16 (caches in the parameter dtype): within bf16 rounding of its full forward
    (rule: ``max|cached - full| <= 1e-2 * max(1, max|full|)``, about two bf16 ulps of the logits)."""
    from hybrid_model.model import build_model

    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), params_dtype=torch.bfloat16, bf16=True).eval()
    seq = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    (got,) = teacher_forced(model, [seq], [9])
    full = full_logits(model, seq)
    assert (got - full).abs().max().item() <= 1e-2 * max(1.0, full.abs().max().item())


def test_greedy_generate_equals_argmax_of_repeated_full_forwards(megatron_cpu):
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (125, 3)]  # the first crosses 128
    streamed = []
    out = generate(model, prompts, 6, on_token=lambda b, tok: streamed.append((b, tok)))
    for b, prompt in enumerate(prompts):
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(full_logits(model, ids)[-1].argmax()))
        assert out[b] == ids[len(prompt) :], b
    assert streamed == [(b, out[b][i]) for i in range(6) for b in range(2)]


def test_sampling_seed_top_p_and_eos(megatron_cpu):
    model = tiny_model()
    prompts = [[1, 2, 3], [7]]
    a = generate(model, prompts, 5, temperature=1.0, seed=7)
    assert a == generate(model, prompts, 5, temperature=1.0, seed=7)  # same seed, same tokens
    assert {len(x) for x in a} == {5}
    greedy = generate(model, prompts, 5)
    # a nucleus of mass 1e-9 keeps only the most probable token: sampling is then greedy
    assert generate(model, prompts, 5, temperature=2.0, top_p=1e-9, seed=1) == greedy
    stop = greedy[0][1]
    stopped = generate(model, prompts, 5, eos_token_id=stop)
    assert stopped[0] == greedy[0][: greedy[0].index(stop) + 1]  # ends with eos, nothing after it
    assert stopped[1] == greedy[1][: len(stopped[1])] and (len(stopped[1]) == 5 or stopped[1][-1] == stop)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_ids=[]), "non-empty list of prompts"),
        (dict(prompt_ids=[[1], []]), r"prompt_ids\[1\] is empty"),
        (dict(prompt_ids=[[1, 512]]), r"prompt_ids\[0\]\[1\] = 512 is not a token id"),
        (dict(prompt_ids=[[1] * 4097]), "longer than the model's max_position_embeddings=4096"),
        (dict(prompt_ids=[[1] * 4090], max_new_tokens=7), "lower max_new_tokens to at most 6"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        (dict(seed=-3), "seed must be None or an int >= 0"),
        (dict(eos_token_id=600), "eos_token_id must be None or a token id"),
    ],
)
def test_generate_rejects_bad_inputs(megatron_cpu, kwargs, match):
    model = tiny_model()
    args = dict(prompt_ids=[[1, 2]], max_new_tokens=2) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(model, **args)


def test_megatron_symbols_are_refused(megatron_cpu):
    from hybrid_model.model import build_model

    model = build_model(get_preset("tiny").with_pattern("WEC-/W-"))
    with pytest.raises(ValueError, match=r"symbol\(s\) '-'"):
        generate(model, [[1, 2]], 2)


def test_cache_bytes_formula(megatron_cpu):
    model = tiny_model()
    dec = CachedDecoder(model, 3, 300)
    assert dec.nbytes == generation_cache_bytes(model.model_config, 300, batch=3)
    # V4-Flash, bf16, per sequence of 1M tokens: the compressed entries dominate (6,880 B per token)
    flash = get_preset("v4-flash")
    per_token = generation_cache_bytes(flash, 2**20, itemsize=2) - generation_cache_bytes(
        flash, 2**20 - 128, itemsize=2
    )
    assert per_token == 128 * 6880
