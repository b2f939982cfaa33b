"""Compressor reference: oracles C1-C4, a loop oracle written from spec §3.2/§3.3, THD vs SBHD, gradients."""

import pytest
import torch

from csa_kernels import (
    CompressorState,
    compress,
    compress_ref,
    compress_sbhd,
    compressor_pool,
    compressor_pool_ref,
)
from dsv4_primitives import RopeConfig, YarnConfig, apply_rope_ref, rms_norm_ref
from dsv4_primitives.varlen import SeqBoundaries, cu_seqlens_from_lengths

LENGTHS = [1, 3, 7, 8, 16, 37, 64, 100]
ROPE = RopeConfig(rope_dim=4, base=160000.0, yarn=YarnConfig(factor=4, original_max_position_embeddings=32))
# (ratio, overlap): CSA ratio 4 overlapping, HCA-like large non-overlapping ratios
LAYOUTS = [(4, True), (8, False), (32, False), (2, True), (1, False)]


def _pool_loop_oracle(kv, score, ape, ratio, overlap, lengths):
    """Entry-by-entry, slot-by-slot pooling straight from the spec text (float64)."""
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    out, start = [], 0
    for n in lengths:
        for w in range(n // ratio):
            slots_kv, slots_logit = [], []
            if overlap:
                for j in range(ratio):  # previous block, P-half [0, c)
                    tok = (w - 1) * ratio + j
                    if w == 0:
                        slots_kv.append(torch.zeros(c, dtype=kv.dtype))
                        slots_logit.append(torch.full((c,), float("-inf"), dtype=kv.dtype))
                    else:
                        slots_kv.append(kv[start + tok, :c])
                        slots_logit.append(score[start + tok, :c] + ape[j, :c])
                for j in range(ratio):  # own block, Q-half [c, 2c)
                    tok = w * ratio + j
                    slots_kv.append(kv[start + tok, c:])
                    slots_logit.append(score[start + tok, c:] + ape[j, c:])
            else:
                for j in range(ratio):
                    tok = w * ratio + j
                    slots_kv.append(kv[start + tok])
                    slots_logit.append(score[start + tok] + ape[j])
            sk, sl = torch.stack(slots_kv), torch.stack(slots_logit)  # [slots, c]
            wts = torch.exp(sl - sl.max(0).values)
            wts = wts / wts.sum(0)
            out.append((wts * sk).sum(0))
        start += n
    return torch.stack(out) if out else torch.zeros(0, c, dtype=kv.dtype)


def _pool_inputs(lengths, ratio, overlap, c=6, dtype=torch.float64):
    t = sum(lengths)
    dk = 2 * c if overlap else c
    kv = torch.randn(t, dk, dtype=dtype)
    score = torch.randn(t, dk, dtype=dtype) * 2
    ape = torch.randn(ratio, dk, dtype=dtype)
    return kv, score, ape


def _compress_params(ratio, overlap, d=10, c=8, dtype=torch.float64):
    dk = 2 * c if overlap else c
    return dict(
        wkv=torch.randn(dk, d, dtype=dtype) / d**0.5,
        wgate=torch.randn(dk, d, dtype=dtype) / d**0.5,
        ape=torch.randn(ratio, dk, dtype=dtype),
        norm_weight=1 + 0.1 * torch.randn(c, dtype=dtype),
        ratio=ratio,
        overlap=overlap,
        rope_cfg=ROPE,
    )


@pytest.mark.parametrize(("ratio", "overlap"), LAYOUTS, ids=lambda v: str(v))
def test_pool_matches_loop_oracle_packed(ratio, overlap):
    lengths = [*LENGTHS, 0, 5]
    kv, score, ape = _pool_inputs(lengths, ratio, overlap)
    pooled, cu_c = compressor_pool_ref(kv, score, ape, ratio, overlap, SeqBoundaries.from_lengths(lengths))
    ref = _pool_loop_oracle(kv, score, ape, ratio, overlap, lengths)
    torch.testing.assert_close(pooled, ref, rtol=1e-12, atol=1e-12)
    # C4: floor(len / ratio) entries per document, tails dropped
    assert cu_c.cu_seqlens.dtype == torch.int32
    assert cu_c.cu_seqlens.tolist() == cu_seqlens_from_lengths([n // ratio for n in lengths]).tolist()


def test_pool_ratio_128_non_overlapping():
    lengths = [127, 128, 300]
    kv, score, ape = _pool_inputs(lengths, 128, False, c=3)
    pooled, cu_c = compressor_pool(kv, score, ape, 128, False, SeqBoundaries.from_lengths(lengths))
    assert cu_c.cu_seqlens.tolist() == [0, 0, 1, 3]
    torch.testing.assert_close(pooled, _pool_loop_oracle(kv, score, ape, 128, False, lengths))


@pytest.mark.parametrize(("ratio", "overlap"), [(4, True), (8, False)], ids=["csa4", "hca8"])
@pytest.mark.parametrize("length", LENGTHS)
def test_c1_streaming_equals_batched(ratio, overlap, length):
    p = _compress_params(ratio, overlap)
    batch = 2
    x = torch.randn(length, batch, 10, dtype=torch.float64)
    batched = compress_sbhd(x, **p)  # [Sc, B, c]
    state = CompressorState(**p, batch=batch)
    streamed = [e for e in (state.step(x[t]) for t in range(length)) if e is not None]
    assert len(streamed) == length // ratio  # C4
    if streamed:
        torch.testing.assert_close(torch.stack(streamed), batched, rtol=1e-13, atol=1e-13)


def test_c2_locality():
    lengths = [37]
    for ratio, overlap, c in [(4, True, 5), (8, False, 5)]:
        kv, score, ape = _pool_inputs(lengths, ratio, overlap, c=c)
        cu = SeqBoundaries.from_lengths(lengths)
        base, _ = compressor_pool_ref(kv, score, ape, ratio, overlap, cu)
        n = base.shape[0]
        for j in range(37):
            kv2, sc2 = kv.clone(), score.clone()
            kv2[j] += 1.0
            sc2[j] -= 0.7
            pert, _ = compressor_pool_ref(kv2, sc2, ape, ratio, overlap, cu)
            changed = {w for w in range(n) if not torch.equal(pert[w], base[w])}
            expect = {j // ratio, j // ratio + 1} if overlap else {j // ratio}
            assert changed == {w for w in expect if w < n}, (ratio, j)


def test_c3_weights_sum_to_one_and_mean_pooling():
    # constant kv rows: any convex per-channel weighting returns the row itself
    lengths = [16, 9]
    for ratio, overlap in [(4, True), (8, False)]:
        kv, score, ape = _pool_inputs(lengths, ratio, overlap, c=4)
        v = torch.randn(kv.shape[1], dtype=torch.float64)
        pooled, _ = compressor_pool_ref(
            v.expand_as(kv), score, ape, ratio, overlap, SeqBoundaries.from_lengths(lengths)
        )
        c = pooled.shape[1]
        if overlap:
            # entry 0 uses only its own block's Q-half; later entries mix the P-half of the previous block
            torch.testing.assert_close(pooled[0], v[c:])
        else:
            torch.testing.assert_close(pooled, v.expand_as(pooled))
    # wgate = 0, ape = 0: an HCA entry is RMSNorm(mean of C over the block), then RoPE at w*m
    p = _compress_params(8, False)
    p["wgate"] = torch.zeros_like(p["wgate"])
    p["ape"] = torch.zeros_like(p["ape"])
    x = torch.randn(20, 10, dtype=torch.float64)
    out, _ = compress_ref(x, **p, bounds=SeqBoundaries.from_lengths([20]))
    mean = (x @ p["wkv"].T)[:16].view(2, 8, -1).mean(1)
    expect = apply_rope_ref(rms_norm_ref(mean, p["norm_weight"]), torch.tensor([0, 8]), ROPE)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    # CSA entry 0 with gate 0: mean of its own block's Q-half only
    p = _compress_params(4, True)
    p["wgate"] = torch.zeros_like(p["wgate"])
    p["ape"] = torch.zeros_like(p["ape"])
    x = torch.randn(4, 10, dtype=torch.float64)
    out, _ = compress_ref(x, **p, bounds=SeqBoundaries.from_lengths([4]))
    q_half = (x @ p["wkv"].T)[:, 8:].mean(0, keepdim=True)
    expect = apply_rope_ref(rms_norm_ref(q_half, p["norm_weight"]), torch.tensor([0]), ROPE)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("ratio", "overlap"), [(4, True), (8, False)], ids=["csa4", "hca8"])
def test_thd_equals_per_document_and_sbhd(ratio, overlap):
    lengths = [*LENGTHS[:4], 0, *LENGTHS[4:]]
    p = _compress_params(ratio, overlap)
    xs = [torch.randn(n, 10, dtype=torch.float64) for n in lengths]
    packed, cu_c = compress(torch.cat(xs), **p, bounds=SeqBoundaries.from_lengths(lengths))
    # fp64 GEMMs of different row counts may take different BLAS paths (1-ulp differences), hence atol 1e-12
    for i, x in enumerate(xs):
        alone = compress_sbhd(x[:, None], **p)[:, 0]  # B = 1 SBHD
        torch.testing.assert_close(
            packed[cu_c.cu_seqlens_host[i] : cu_c.cu_seqlens_host[i + 1]], alone, rtol=0, atol=1e-12
        )
    # SBHD batch of equal lengths == each sequence alone
    xb = torch.randn(37, 3, 10, dtype=torch.float64)
    sb = compress_sbhd(xb, **p)
    for b in range(3):
        one, _ = compress(xb[:, b], **p, bounds=SeqBoundaries.from_lengths([37]))
        torch.testing.assert_close(sb[:, b], one, rtol=0, atol=1e-12)


def test_short_and_empty_documents_give_no_entries():
    p = _compress_params(4, True)
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    out, cu_c = compress(x, **p, bounds=SeqBoundaries.from_lengths([0, 3, 0]))
    assert out.shape == (0, 8) and cu_c.cu_seqlens.tolist() == [0, 0, 0, 0]
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    out, cu_c = compress(x[:0], **p, bounds=SeqBoundaries.from_lengths([]))
    assert out.shape == (0, 8) and cu_c.cu_seqlens.tolist() == [0]


def test_dtype_policy():
    p = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in _compress_params(4, True).items()}
    x = torch.randn(9, 10).bfloat16()
    out, _ = compress(x, **p, bounds=SeqBoundaries.from_lengths([9]))
    assert out.dtype == torch.bfloat16
    kv, score, ape = _pool_inputs([9], 4, True, dtype=torch.float32)
    pooled, _ = compressor_pool(
        kv.bfloat16(), score.bfloat16(), ape, 4, True, SeqBoundaries.from_lengths([9])
    )
    assert pooled.dtype == torch.float32


@pytest.mark.parametrize(("ratio", "overlap"), [(4, True), (3, False)], ids=["csa4", "hca3"])
def test_pool_gradcheck(ratio, overlap):
    lengths = [9, 0, 5]
    kv, score, ape = _pool_inputs(lengths, ratio, overlap, c=2)
    cu = SeqBoundaries.from_lengths(lengths)
    inputs = [t.requires_grad_() for t in (kv, score, ape)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: compressor_pool_ref(a, b, c, ratio, overlap, cu)[0], inputs
    )


def test_compress_gradcheck():
    p = _compress_params(4, True, d=5, c=4)
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    cu = SeqBoundaries.from_lengths([9])
    names = ["wkv", "wgate", "ape", "norm_weight"]
    tensors = [p[n].clone().requires_grad_() for n in names]

    def fn(x, *ts):
        kw = dict(p, **dict(zip(names, ts)))
        return compress_ref(x, **kw, bounds=cu)[0]

    assert torch.autograd.gradcheck(fn, [x, *tensors])


def test_bad_inputs_raise_value_error():
    kv, score, ape = _pool_inputs([8], 4, True)
    cu = SeqBoundaries.from_lengths([8])
    with pytest.raises(ValueError, match="cu_seqlens"):
        compressor_pool(kv, score, ape, 4, True, SeqBoundaries.from_lengths([7]))
    with pytest.raises(ValueError, match="ape"):
        compressor_pool(kv, score, ape[:2], 4, True, cu)
    with pytest.raises(ValueError, match="ratio"):
        compressor_pool(kv, score, ape, 0, True, cu)
    with pytest.raises(ValueError, match="backend"):
        compressor_pool(kv, score, ape, 4, True, cu, backend="cuda")
    with pytest.raises(ValueError, match="even"):
        compressor_pool(kv[:, :5], score[:, :5], ape[:, :5], 4, True, cu)
