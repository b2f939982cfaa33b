"""Activation recompute on the GPU (bf16, deterministic kernels): every recompute setting gives the gradients of a
step without recompute bit for bit, and the layers compute the same values whether autograd records or not.

Why the second check: megatron's full recompute runs each checkpointed chunk's first forward under ``no_grad`` and
feeds its output to the rest of the step, then recomputes it with autograd on in the backward. If a kernel takes
another path without autograd (a fused inference kernel, another chunking), the loss and the output gradient come
from one arithmetic and the chunk's backward from another: the step's gradients are no longer the plain step's.
The failure names the first module (in execution order) whose output differs."""

import pytest
import torch
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from dsv4_primitives.megatron.precision import Float16ModuleKeepFP32
from dsv4_primitives.recompute import RecomputeConfig
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

SETTINGS = {
    "selective-all": RecomputeConfig(
        "selective",
        ("mhc", "layernorm", "mla_up_proj", "compressor", "indexer", "core_attn", "moe_act"),
        mhc_layer_num=2,
    ),
    "full-uniform-2": RecomputeConfig("full", method="uniform", num_layers=2),
    "full-block-3": RecomputeConfig("full", method="block", num_layers=3),
}


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before)


def _model(recompute=None):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)  # megatron's RNG tracker: every build starts from the same states
    core = build_model(get_preset("tiny"), bf16=True, params_dtype=torch.bfloat16, recompute=recompute).cuda()
    return core, Float16ModuleKeepFP32(core.config, core).train()


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, get_preset("tiny").vocab_size, (2, 256), generator=g).cuda()


def _step(recompute):
    core, model = _model(recompute)
    ids = _ids()
    loss = model(ids, None, None, labels=torch.roll(ids, -1, 1)).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in core.named_parameters() if p.grad is not None}


def _outputs(model, ids, grad: bool) -> list[tuple[str, torch.Tensor]]:
    """``(module name, output)`` of every module that returns a tensor, in execution order."""
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(
            lambda mod, inp, out, name=name: (
                seen.append((name, out.detach().clone())) if isinstance(out, torch.Tensor) else None
            )
        )
        for name, m in model.named_modules()
    ]
    try:
        with torch.set_grad_enabled(grad):
            model(ids, None, None, labels=torch.roll(ids, -1, 1))
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.gpu
def test_layers_compute_the_same_with_and_without_autograd(megatron_cpu, deterministic):
    _, model = _model()
    ids = _ids()
    with_grad, without = _outputs(model, ids, True), _outputs(model, ids, False)
    assert [n for n, _ in with_grad] == [n for n, _ in without]
    differ = [
        (n, float((a.float() - b.float()).abs().max()))
        for (n, a), (_, b) in zip(with_grad, without, strict=True)
        if a.shape != b.shape or not torch.equal(a, b)
    ]
    assert not differ, f"first differing module outputs (name, max |diff|): {differ[:5]}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SETTINGS))
def test_recompute_gradients_equal_no_recompute_bitwise_on_gpu(megatron_cpu, deterministic, name):
    ref_loss, ref_grads = _step(None)
    loss, grads = _step(SETTINGS[name])
    assert torch.equal(loss, ref_loss), (name, loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    differ = [
        (n, float((grads[n].float() - ref_grads[n].float()).abs().max()))
        for n in grads
        if not torch.equal(grads[n], ref_grads[n])
    ]
    assert differ == [], (name, len(differ), differ[:12])
