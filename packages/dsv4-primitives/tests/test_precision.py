"""P1 selective FP32: marks, module conversion, the Float16Module replacement, the FP8-disabled context."""

import contextlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dsv4_primitives import (
    KeepFP32Mixin,
    convert_module_to_dtype_except_fp32_marked,
    fp8_disabled_context,
    is_keep_in_fp32,
    mark_keep_in_fp32,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.attn_sink = mark_keep_in_fp32(nn.Parameter(torch.randn(4)))
        self.register_buffer("ape", torch.randn(3, 8))
        mark_keep_in_fp32(self.ape)
        self.register_buffer("running", torch.randn(8))
        self.register_buffer("tid2eid", torch.randint(0, 8, (16,)))


def test_mark_and_query():
    t = torch.zeros(3)
    assert not is_keep_in_fp32(t)
    assert mark_keep_in_fp32(t) is t and is_keep_in_fp32(t)
    with pytest.raises(ValueError, match="never cast"):
        mark_keep_in_fp32(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"torch\.Tensor"):
        mark_keep_in_fp32([1.0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_convert_keeps_marked_fp32(dtype):
    m = nn.Sequential(_Block(), _Block())
    sink = m[0].attn_sink
    sink.grad = torch.ones(4)
    m[0].proj.weight.grad = torch.ones(8, 8)
    before = {n: b.clone() for n, b in m.named_buffers()}
    out = convert_module_to_dtype_except_fp32_marked(m, dtype)
    assert out is m and m[0].attn_sink is sink  # params keep identity (optimizer refs, marks)
    for blk in m:
        assert blk.proj.weight.dtype == dtype
        assert blk.attn_sink.dtype == torch.float32 and is_keep_in_fp32(blk.attn_sink)
        assert blk.ape.dtype == torch.float32 and is_keep_in_fp32(blk.ape)
        assert blk.running.dtype == dtype
        assert blk.tid2eid.dtype == torch.int64
    assert sink.grad.dtype == torch.float32 and m[0].proj.weight.grad.dtype == dtype
    assert torch.equal(m[0].ape, before["0.ape"])  # untouched, bit for bit
    # a marked tensor that is not fp32 is brought to fp32
    p = mark_keep_in_fp32(nn.Parameter(torch.randn(2, dtype=torch.float16)))
    holder = nn.Module()
    holder.p = p
    convert_module_to_dtype_except_fp32_marked(holder, torch.bfloat16)
    assert holder.p.dtype == torch.float32
    with pytest.raises(ValueError, match="floating"):
        convert_module_to_dtype_except_fp32_marked(m, torch.int8)


def test_plain_bfloat16_would_cast_marked_tensors():
    """Why the replacement exists: module.bfloat16() (what 0.19.2's Float16Module calls) ignores the mark."""
    blk = _Block().bfloat16()
    assert blk.attn_sink.dtype == torch.bfloat16


class _MixinBlock(KeepFP32Mixin, _Block):
    pass


@pytest.mark.parametrize("cast", ["bfloat16", "half", "to_dtype"])
def test_mixin_keeps_marked_fp32_through_module_casts(cast):
    outer = nn.Sequential(
        _MixinBlock(), nn.Linear(8, 8)
    )  # parent without the mixin: children handle themselves
    blk = outer[0]
    sink, w = blk.attn_sink, blk.proj.weight
    sink.grad = torch.randn(4)
    before = {n: t.detach().clone() for n, t in [*blk.named_parameters(), *blk.named_buffers()]}
    grad0 = sink.grad.clone()
    half = torch.float16 if cast == "half" else torch.bfloat16
    if cast == "to_dtype":
        outer.to(half)
    else:
        getattr(outer, cast)()
    assert blk.attn_sink is sink and is_keep_in_fp32(sink)  # identity (optimizer refs) and mark kept
    assert sink.dtype == torch.float32 and torch.equal(
        sink, before["attn_sink"]
    )  # original values, bit for bit
    assert sink.grad.dtype == torch.float32 and torch.equal(sink.grad, grad0)
    assert blk.ape.dtype == torch.float32 and is_keep_in_fp32(blk.ape) and torch.equal(blk.ape, before["ape"])
    assert w.dtype == half and blk.running.dtype == half and outer[1].weight.dtype == half
    assert blk.tid2eid.dtype == torch.int64


def test_mixin_buffer_marks_survive_device_moves():
    """A device move replaces buffer tensors; the mixin marks the new ones, so later conversions still see them."""
    plain, mixed = _Block(), _MixinBlock()
    for m in (plain, mixed):
        m._apply(lambda t: t.clone())  # what .to(other_device) does to every tensor (a new object)
    assert not is_keep_in_fp32(plain.ape)  # the documented loss without the mixin
    assert is_keep_in_fp32(mixed.ape) and is_keep_in_fp32(mixed.attn_sink)
    convert_module_to_dtype_except_fp32_marked(mixed, torch.bfloat16)
    assert mixed.ape.dtype == torch.float32 and mixed.running.dtype == torch.bfloat16
    moved = _MixinBlock().to("meta", torch.bfloat16)  # device and dtype in one call
    assert moved.ape.device.type == "meta" and moved.ape.dtype == torch.float32 and is_keep_in_fp32(moved.ape)
    assert moved.attn_sink.device.type == "meta" and moved.attn_sink.dtype == torch.float32
    assert moved.proj.weight.dtype == torch.bfloat16


def test_mixin_with_replaced_parameters_on_conversion():
    """Under torch's overwrite_module_params_on_conversion, _apply builds new Parameters: they are marked too."""
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        blk = _MixinBlock().bfloat16()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert blk.attn_sink.dtype == torch.float32 and is_keep_in_fp32(blk.attn_sink)
    assert blk.proj.weight.dtype == torch.bfloat16


def _toy(config):
    from megatron.core.transformer.module import MegatronModule

    class Toy(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
            self.sink = mark_keep_in_fp32(nn.Parameter(torch.randn(8)))
            self.seen = []

        def forward(self, x):
            self.seen.append((x.dtype, self.w.dtype, self.sink.dtype))
            h = x @ self.w.t()
            return h.float() * torch.sigmoid(self.sink)

    return Toy()


@pytest.mark.parametrize("fp16", [False, True])
def test_float16_module_keep_fp32_forward_and_training(megatron_cpu, fp16):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from dsv4_primitives.megatron.precision import Float16ModuleKeepFP32

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=not fp16, fp16=fp16)
    half = torch.float16 if fp16 else torch.bfloat16
    upstream = Float16Module(cfg, _toy(cfg))
    ours = Float16ModuleKeepFP32(cfg, _toy(cfg))
    assert set(vars(ours)) == set(vars(upstream))  # same wrapper state as megatron's class
    assert upstream.module.sink.dtype == half  # 0.19.2 casts the marked param
    assert ours.module.w.dtype == half and ours.module.sink.dtype == torch.float32
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    sink0 = ours.module.sink.detach().clone()
    for _ in range(2):
        y = ours(torch.randn(3, 8))  # fp32 input is cast to the model dtype on the first stage
        assert y.dtype == torch.float32  # output upcast on the last stage
        y.pow(2).mean().backward()
        assert ours.module.sink.grad.dtype == torch.float32
        opt.step()
        opt.zero_grad()
    assert ours.module.seen[0] == (half, half, torch.float32)
    assert ours.module.sink.dtype == torch.float32 and not torch.equal(ours.module.sink, sink0)
    with pytest.raises(ValueError, match=r"fp16 or config\.bf16"):
        Float16ModuleKeepFP32(
            TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1), _toy(cfg)
        )


def test_fp8_disabled_context_without_transformer_engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    cfg = SimpleNamespace(fp8="hybrid", fp4=None, fp8_param=True, fp4_param=False)
    assert isinstance(fp8_disabled_context(cfg), contextlib.nullcontext)
    assert isinstance(fp8_disabled_context(cfg, is_init=True), contextlib.nullcontext)


def test_fp8_disabled_context_dispatches_to_transformer_engine(monkeypatch):
    calls = []

    @contextlib.contextmanager
    def fp8_autocast(enabled):
        calls.append(("fp8_autocast", enabled))
        yield

    @contextlib.contextmanager
    def fp8_model_init(enabled):
        calls.append(("fp8_model_init", enabled))
        yield

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.fp8_autocast, te_pt.fp8_model_init = fp8_autocast, fp8_model_init
    te.pytorch = te_pt
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)

    off = SimpleNamespace(fp8=None, fp4=None, fp8_param=False, fp4_param=False)
    assert isinstance(fp8_disabled_context(off), contextlib.nullcontext)
    assert isinstance(fp8_disabled_context(off, is_init=True), contextlib.nullcontext)
    with fp8_disabled_context(SimpleNamespace(fp8="e4m3", fp4=None, fp8_param=False, fp4_param=False)):
        pass
    with fp8_disabled_context(
        SimpleNamespace(fp8=None, fp4="nvfp4", fp8_param=False, fp4_param=True), is_init=True
    ):
        pass
    assert calls == [("fp8_autocast", False), ("fp8_model_init", False)]


def test_importing_package_does_not_import_megatron_or_te():
    import subprocess

    code = (
        "import sys, dsv4_primitives; "
        "assert 'transformer_engine' not in sys.modules; assert 'megatron' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
