"""Fused indexer KL loss (Triton) vs the reference: loss, per-row KL and the gradient of the index scores."""

from __future__ import annotations

import pytest
import torch
from _cases import attention_case_indices

from csa_kernels.ops.indexer_loss import indexer_loss, indexer_loss_ref
from csa_kernels.ops.indexer_loss.autograd import indexer_loss_triton
from csa_kernels.ops.sparse_attn.reference import sparse_attn_ref
from dsv4_testkit import assert_close_to_ref, interpreting

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter case (gpu cases cover it)")


def _loss_oracle(q, kv_all, attn_sink, lse, comp, x, scale):
    """Plain PyTorch: teacher logits from a GEMM in the inputs' dtype, the rest in fp32 (tolerance yardstick)."""
    valid = comp >= 0
    rows = kv_all[comp.clamp(min=0).long()]  # [T, Kc, D]
    z = torch.einsum("thd,tkd->thk", q, rows).float() * scale  # [T, H, Kc]
    log_pi = (z - lse.float()[:, :, None]).masked_fill(~valid[:, None, :], float("-inf"))
    log_mass = torch.logsumexp(log_pi, 1)  # [T, Kc]
    has = valid.any(1)
    log_p = torch.where(valid, log_mass - torch.logsumexp(log_mass, 1, keepdim=True), float("-inf"))
    log_r = torch.log_softmax(torch.where(has[:, None], x.float().masked_fill(~valid, float("-inf")), 0.0), 1)
    terms = torch.where(
        valid, log_p.exp() * (log_p.masked_fill(~valid, 0) - log_r.masked_fill(~valid, 0)), 0.0
    )
    per_row = torch.where(has, terms.sum(1), 0.0)
    return per_row.sum() / has.sum().clamp(min=1), per_row


def _inputs(lengths, H, D, ratio, window, topk, seed, lse_shift=0.0):
    gen = torch.Generator().manual_seed(seed)
    idx, T, Tc = attention_case_indices(lengths, ratio, window, topk, gen)
    q = torch.randn(T, H, D, generator=gen)
    kv = torch.randn(T + Tc, D, generator=gen)
    sink = torch.randn(H, generator=gen)
    _, lse = sparse_attn_ref(q.double(), kv.double(), sink.double(), idx, D**-0.5)  # real full denominators
    comp = idx[:, window:].contiguous()  # [T, topk] rows of kv_all (compressed part, -1 / repeats included)
    x = torch.randn(T, topk, generator=gen) * 2
    return q, kv, sink, lse + lse_shift, comp, x


def _run(lengths, H, D, ratio, window, topk, dtype, device, seed=0, lse_shift=0.0):
    q, kv, sink, lse, comp, x = _inputs(lengths, H, D, ratio, window, topk, seed, lse_shift)
    qd, kvd = q.to(dtype).double(), kv.to(dtype).double()  # the kernel sees dtype-rounded q / kv
    g = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(seed + 1))

    def run(fn, qq, kk, ll, xdt):
        xx = x.to(device=device, dtype=xdt).requires_grad_()
        dev = [t.to(device) for t in (qq, kk, sink, ll, comp)]
        loss, per_row = fn(*dev[:4], dev[4], xx, D**-0.5)
        (3 * loss + (per_row * g.to(device=device, dtype=per_row.dtype)).sum()).backward()
        return loss, per_row, xx.grad

    r64 = run(indexer_loss_ref, qd, kvd, lse, torch.float64)
    rdt = run(_loss_oracle, q.to(dtype), kv.to(dtype), lse.float(), torch.float32)
    got = run(indexer_loss_triton, q.to(dtype), kv.to(dtype), lse.float(), torch.float32)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    for name, a, r, rd in zip(("loss", "per_row_kl", "d_index_scores"), got, r64, rdt):
        assert_close_to_ref(name, a, r, rd)
    return got, run(indexer_loss_triton, q.to(dtype), kv.to(dtype), lse.float(), torch.float32)


CPU_CASES = [
    # lengths, H, D, ratio, window, topk
    ([11], 4, 32, 4, 4, 3),  # early rows without entries, repeated indices
    ([1, 0, 7, 5], 3, 24, 2, 3, 4),  # length-1 and empty docs, H and D not powers of two
    ([9, 3], 80, 16, 4, 2, 8),  # top-k larger than visible, two head blocks (BLOCK_H 64)
    ([23], 2, 16, 1, 2, 20),  # more slots than one BLOCK_N tile (online sums across tiles)
]


@interpreter_only
@pytest.mark.parametrize("case", CPU_CASES)
def test_indexer_loss_interpreter_fp32(case):
    _run(*case, dtype=torch.float32, device="cpu")


@interpreter_only
def test_indexer_loss_backward_bitwise_reproducible():
    """The loss, per-row KL and ``d index_scores`` (an elementwise backward: no cross-program reduction) are
    bitwise equal over two runs (audit for ``dsv4 train --deterministic``)."""
    first, again = _run(*CPU_CASES[3], dtype=torch.float32, device="cpu")
    for name, a, b in zip(("loss", "per_row_kl", "d_index_scores"), first, again):
        assert torch.equal(a, b), f"{name} differs between two runs"


@interpreter_only
def test_indexer_loss_interpreter_underflowing_teacher():
    """The window holds (almost) all the mass: exp(z - lse) underflows fp32, the log-domain teacher does not."""
    _run([14], 4, 16, 2, 3, 6, dtype=torch.float32, device="cpu", lse_shift=150.0)


@interpreter_only
def test_indexer_loss_no_entries():
    """Rows without valid slots contribute 0; with none at all the loss is 0 and the gradient vanishes."""
    q, kv = torch.randn(4, 2, 16), torch.randn(6, 16)
    comp = torch.full((4, 3), -1, dtype=torch.int32)
    x = torch.randn(4, 3, requires_grad=True)
    loss, per_row = indexer_loss_triton(q, kv, torch.zeros(2), torch.zeros(4, 2), comp, x, 0.25)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not per_row.any() and not x.grad.any()


@interpreter_only
def test_public_indexer_loss_backends_agree():
    q, kv, sink, lse, comp, x = _inputs([10, 6], 3, 16, 2, 2, 4, seed=5)
    lse = lse.float()
    outs = []
    for backend in ("triton", "reference"):
        xx = x.clone().requires_grad_()
        loss, per_row = indexer_loss(q, kv, sink, lse, comp, xx, 0.25, backend=backend)
        loss.backward()
        outs.append((loss, per_row, xx.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


GPU_CASES = [
    ([1, 0, 7, 5], 3, 24, 2, 3, 4),
    ([9, 3], 80, 16, 4, 2, 8),
    ([300, 1, 0, 212], 64, 512, 4, 128, 64),  # V4-Flash head shape, varlen, early rows
    ([257], 128, 512, 4, 16, 96),  # V4-Pro heads (two head blocks)
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_indexer_loss_gpu_bf16(case):
    _run(*case, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_indexer_loss_gpu_bf16_bitwise_reproducible():
    """Loss, per-row KL and ``d index_scores`` bitwise equal over two runs on the GPU (issue 20)."""
    first, again = _run(*GPU_CASES[2], dtype=torch.bfloat16, device="cuda")
    for name, a, b in zip(("loss", "per_row_kl", "d_index_scores"), first, again):
        assert torch.equal(a, b), f"{name} differs between two runs"
