"""GPU run (bf16, csa-kernels' Triton dispatch, transformer-engine linears when installed) vs the fp64 reference."""

from __future__ import annotations

import pytest
import torch
from _attention_reference import params_of, reference_forward
from _attention_testconfig import tiny_config
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention import IndexerLossAutoScaler
from dsv4_attention.megatron import get_dsv4_attention_spec
from dsv4_testkit import assert_close_to_ref


@pytest.mark.gpu
@pytest.mark.parametrize(("ratio", "seq"), [(0, 77), (4, 77), (128, 300)])
def test_bf16_cuda_layer_matches_reference(pg, ratio, seq):
    torch.manual_seed(0)
    cfg = tiny_config(use_cpu_initialization=False)
    m = build_module(get_dsv4_attention_spec(ratio), config=cfg, layer_number=1, pg_collection=pg).cuda()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p)
            )
    m = m.bfloat16().train()
    assert m.core_attention.attn_sink.dtype == torch.float32
    x = torch.randn(seq, 2, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(seq, 2, 64, device="cuda", dtype=torch.bfloat16)
    IndexerLossAutoScaler.set_loss_scale(0.0)
    try:
        y, _ = m(x)
        (y.float() * w.float()).sum().backward()
    finally:
        IndexerLossAutoScaler.reset()
    xc, wc = x.float().cpu(), w.float().cpu()

    def ref(dtype):
        p = {n: t.detach().cpu().to(dtype).requires_grad_() for n, t in params_of(m, dtype).items()}
        ys = [o[0] for o in reference_forward(m, p, [xc[:, b].to(dtype) for b in range(2)])]
        yr = torch.stack(ys, 1)
        g = torch.autograd.grad((yr * wc.to(dtype)).sum(), list(p.values()), allow_unused=True)
        return yr, dict(zip(p, g))

    y64, g64 = ref(torch.float64)
    ybf, gbf = ref(torch.bfloat16)
    assert_close_to_ref("y", y.float().cpu(), y64, ybf.float())
    for name, prm in m.named_parameters():
        if ".indexer." in name or g64[name] is None:
            continue
        assert_close_to_ref(f"d{name}", prm.grad.float().cpu(), g64[name], gbf[name].float())
