"""fp32-computed RMSNorm: values, gradients (weighted and weightless), megatron spec-module use."""

import pytest
import torch

from dsv4_primitives import RMSNorm, rms_norm_ref
from dsv4_testkit import assert_close_to_ref

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _rms_f64(x, w, eps):
    x = x.double()
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w.double() if w is not None else y


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 4, 33)])
def test_matches_math_and_gradcheck(weighted, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True) if weighted else None
    y = rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(y, _rms_f64(x, w, 1e-6), rtol=1e-12, atol=1e-12)
    inputs = (x, w) if weighted else (x,)
    assert torch.autograd.gradcheck(lambda *a: rms_norm_ref(a[0], a[1] if weighted else None, 1e-6), inputs)


@pytest.mark.parametrize("weighted", [True, False])
def test_bf16_output_and_grads_within_rule(weighted):
    torch.manual_seed(1)
    x = (torch.randn(6, 64) * 3).bfloat16().requires_grad_(True)
    w = (1 + 0.1 * torch.randn(64)).requires_grad_(True) if weighted else None  # fp32 weight, as in training
    gy = torch.randn(6, 64).bfloat16()
    y = rms_norm_ref(x, w)
    assert y.dtype == torch.bfloat16
    grads = torch.autograd.grad(y, [x] + ([w] if weighted else []), gy)
    xr = x.detach().double().requires_grad_(True)
    wr = w.detach().double().requires_grad_(True) if weighted else None
    yr = _rms_f64(xr, wr, 1e-6)
    grads_r = torch.autograd.grad(yr, [xr] + ([wr] if weighted else []), gy.double())
    # plain PyTorch in bf16 (everything in bf16) as the yardstick
    xs = x.detach().clone().requires_grad_(True)
    ws = w.detach().bfloat16().requires_grad_(True) if weighted else None
    ys = xs / torch.sqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6)
    ys = ys * ws if weighted else ys
    grads_s = torch.autograd.grad(ys, [xs] + ([ws] if weighted else []), gy)
    assert_close_to_ref("y", y, yr, ys)
    for name, g, gr, gs in zip(["dx", "dw"], grads, grads_r, grads_s, strict=False):
        assert_close_to_ref(name, g, gr, gs)


def test_module_weightless_and_eps_from_config():
    from types import SimpleNamespace

    norm = RMSNorm(16, config=SimpleNamespace(layernorm_epsilon=1e-5), elementwise_affine=False)
    assert norm.weight is None and norm.eps == 1e-5 and list(norm.parameters()) == []
    x = torch.randn(2, 16)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, None, 1e-5))
    with pytest.raises(ValueError, match="last dim 16"):
        norm(torch.randn(2, 8))
    with pytest.raises(ValueError, match="positive"):
        RMSNorm(0)


def test_megatron_spec_module_in_transformer_layer(megatron_cpu):
    """RMSNorm as the local spec's norms of a megatron TransformerLayer: builds, runs fwd+bwd on CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, layernorm_epsilon=1e-5, normalization="RMSNorm"
    )
    norm = build_module(ModuleSpec(module=RMSNorm), config=cfg, hidden_size=16, eps=cfg.layernorm_epsilon)
    assert isinstance(norm, RMSNorm) and norm.eps == 1e-5
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    layer = build_module(spec, config=cfg, layer_number=1)
    assert isinstance(layer, TransformerLayer)
    assert isinstance(layer.input_layernorm, RMSNorm) and isinstance(layer.pre_mlp_layernorm, RMSNorm)
    x = torch.randn(5, 2, 16, requires_grad=True)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)[None, None]  # True = masked
    out, _ = layer(x, attention_mask=causal)
    out.sum().backward()
    assert out.shape == (5, 2, 16) and layer.input_layernorm.weight.grad is not None
