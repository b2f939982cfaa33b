"""Fused sparse MQA attention with sink (Triton) vs the fp32/fp64 oracle: output, LSE and all three gradients."""

from __future__ import annotations

import pytest
import torch
from _cases import attention_case_indices, sparse_attn_oracle

from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton
from csa_kernels.ops.sparse_attn.reference import sparse_attn_ref
from dsv4_testkit import assert_close_to_ref, interpreting


def _leaf(x, device, dtype):
    return x.detach().to(device=device, dtype=dtype).clone().requires_grad_()


def _run_case(lengths, H, D, ratio, window, topk, dtype, device, seed=0, sink_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    idx, T, Tc = attention_case_indices(lengths, ratio, window, topk, gen)
    q = torch.randn(T, H, D, generator=gen)
    kv = torch.randn(T + Tc, D, generator=gen)
    sink = torch.randn(H, generator=gen) * sink_scale
    do = torch.randn(T, H, D, generator=gen)
    scale = D**-0.5
    idx = idx.to(device)

    def ref(dt, fn):
        qq, kk, ss = (_leaf(x, device, dt) for x in (q, kv, sink))
        o, lse = fn(qq, kk, ss, idx, scale)
        o.backward(do.to(device=device, dtype=dt))
        return o, lse, qq.grad, kk.grad, ss.grad

    r64 = ref(torch.float64, sparse_attn_ref)  # the package's reference, evaluated in fp64
    rdt = ref(dtype, sparse_attn_oracle)  # plain PyTorch in the kernel's dtype: the tolerance yardstick
    qq, kk = (_leaf(x, device, dtype) for x in (q, kv))
    ss = _leaf(sink, device, torch.float32)
    o, lse = sparse_attn_triton(qq, kk, ss, idx, scale)
    assert o.dtype == dtype and lse.dtype == torch.float32
    o.backward(do.to(device=device, dtype=dtype))
    for name, got, r, rd in zip(
        ("o", "lse", "dq", "dkv", "dsink"), (o, lse, qq.grad, kk.grad, ss.grad), r64, rdt
    ):
        assert_close_to_ref(name, got, r, rd)


CPU_CASES = [
    # lengths, H, D, ratio, window, topk
    ([11], 4, 32, 4, 4, 3),  # single doc, -1 window slots at the start, duplicates
    ([1, 0, 7, 5], 3, 24, 2, 3, 4),  # length-1 and empty docs, H and D not powers of two
    ([9, 3], 80, 16, 4, 2, 8),  # top-k larger than visible, two head blocks (BLOCK_H 64)
]


interpreter_only = pytest.mark.skipif(
    not interpreting(), reason="CPU interpreter case (the gpu-marked cases cover the same corners in bf16)"
)


@interpreter_only
@pytest.mark.parametrize("case", CPU_CASES)
def test_sparse_attn_interpreter_fp32(case):
    _run_case(*case, dtype=torch.float32, device="cpu")


@interpreter_only
def test_sparse_attn_interpreter_bf16():
    _run_case([6, 5], 4, 32, 4, 3, 2, dtype=torch.bfloat16, device="cpu")


@interpreter_only
def test_sparse_attn_no_valid_rows_and_large_sink():
    """Rows with no valid index give o = 0 and lse = sink; a large sink drives the output towards 0."""
    T, H, D = 3, 2, 16
    q = torch.randn(T, H, D)
    kv = torch.randn(5, D)
    sink = torch.tensor([0.5, 30.0])
    idx = torch.tensor([[-1, -1], [0, -1], [-1, 4]], dtype=torch.int32)
    o, lse = sparse_attn_triton(q, kv, sink, idx, D**-0.5)
    assert torch.equal(o[0], torch.zeros(H, D))
    torch.testing.assert_close(lse[0], sink)
    assert o[1:, 1].abs().max() < 1e-6


GPU_CASES = [
    ([1, 0, 7, 5], 3, 24, 2, 3, 4),  # the interpreter's corner cases, in bf16 on the GPU
    ([9, 3], 80, 16, 4, 2, 8),
    ([300, 1, 0, 212], 64, 512, 4, 128, 64),  # V4-Flash head shape, varlen, early tokens
    ([257], 128, 512, 4, 128, 96),  # V4-Pro heads (two head blocks)
    ([130, 77], 16, 192, 4, 32, 40),  # small head count, D not a power of two
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_sparse_attn_gpu_bf16(case):
    _run_case(*case, dtype=torch.bfloat16, device="cuda", sink_scale=2.0)


@pytest.mark.gpu
def test_sparse_attn_gpu_fp32_d512():
    """fp32 inputs at D = 512 take the smaller fp32 launch tiles (`_fwd_config` / `_bwd_config`, itemsize 4):
    64 x 64 fp32 q / kv tiles would need 384 KiB of shared memory on the H200. V4-Flash heads, varlen."""
    _run_case([300, 1, 0, 212], 64, 512, 4, 128, 64, dtype=torch.float32, device="cuda", sink_scale=2.0)
