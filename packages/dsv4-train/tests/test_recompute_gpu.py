"""Activation recompute on the GPU (bf16, deterministic kernels): every recompute setting gives the gradients of a
step without recompute bit for bit, and the layers compute the same values whether autograd records or not. Through
the trainer (megatron's DDP, fp32 ``main_grad``), full recompute that covers the MTP depth changes one gradient by
at most one bf16 rounding per micro-batch: the word embedding's, which the main model and the MTP depth share.

Why the second check: megatron's full recompute runs each checkpointed chunk's first forward under ``no_grad`` and
feeds its output to the rest of the step, then recomputes it with autograd on in the backward. If a kernel takes
another path without autograd (a fused inference kernel, another chunking), the loss and the output gradient come
from one arithmetic and the chunk's backward from another: the step's gradients are no longer the plain step's.
The failure names the first module (in execution order) whose output differs. The model's output itself, the
per-token loss of the fused linear-CE head, runs the head's grad-in-forward mode under autograd and its recompute
mode without (dsv4_primitives.linear_cross_entropy, mode "auto"): the same loss up to the summation order, compared
within 8 fp32 ulps (measured on an H100: one ulp, 4.8e-7 on losses near 7). The head is outside every recompute
chunk except the MTP depth's, whose gradients the recompute tests below compare bitwise."""

import sys
from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from dsv4_primitives.megatron.precision import Float16ModuleKeepFP32
from dsv4_primitives.recompute import RecomputeConfig
from dsv4_train.config import TrainConfig
from dsv4_train.trainer import Trainer
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

sys.path.insert(0, str(Path(__file__).parent))
from parallel_runs import capture_first_step_grads

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
    # the model's own output (names "" and "module": the per-token loss [b, s]) comes from the fused linear-CE head,
    # whose "auto" mode is grad_in_forward under autograd and the vocabulary-chunked recompute mode without it (the
    # same math, another summation order of the log-sum-exp): compared within a few fp32 ulps, every module bitwise
    head = {"", "module"}
    differ = [
        (n, float((a.float() - b.float()).abs().max()))
        for (n, a), (_, b) in zip(with_grad, without, strict=True)
        if n not in head and (a.shape != b.shape or not torch.equal(a, b))
    ]
    assert not differ, f"first differing module outputs (name, max |diff|): {differ[:5]}"
    for (n, a), (_, b) in zip(with_grad, without, strict=True):
        if n in head:
            bound = 8 * torch.finfo(torch.float32).eps * float(b.float().abs().max())
            diff = float((a.float() - b.float()).abs().max())
            assert diff <= bound, f"the head's loss with and without autograd differs by {diff} > {bound}"


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


@pytest.mark.gpu
def test_full_recompute_changes_only_the_shared_embedding_gradient(tmp_path, deterministic):
    """Without recompute autograd sums the word embedding's two bf16 gradient contributions (the embedding lookup
    and MTP's copy) before megatron's hook adds them to the fp32 ``main_grad``; with MTP inside the full recompute
    they arrive in two backward passes and are added to ``main_grad`` one by one. Every other gradient is bitwise
    the plain step's, and without MTP all are (deterministic kernels: without them the compressor ``ape`` gradient
    varies from run to run, as the H100 run without the fixture showed)."""
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    no_mtp = dict(model_overrides={"hybrid_layer_pattern": get_preset("tiny").layer_pattern.split("/")[0]})
    runs = {}
    for name, kw in {
        "eager": {},
        "full": full,
        "eager_no_mtp": no_mtp,
        "full_no_mtp": {**full, **no_mtp},
    }.items():
        tc = TrainConfig.from_flat(
            steps=1,
            seq_len=256,
            global_batch_size=2,
            micro_batch_size=1,
            warmup_steps=0,
            out=str(tmp_path / name),
            progress=False,
            save_final=False,
            **kw,
        )
        trainer = Trainer(tc)
        runs[name] = capture_first_step_grads(trainer)
        trainer.run()
        trainer.close()
    for plain, recomputed, shared in (("eager", "full", True), ("eager_no_mtp", "full_no_mtp", False)):
        a, b = runs[plain], runs[recomputed]
        differ = sorted(k[0] for k in a if not torch.equal(a[k], b[k]))
        assert differ == (["embedding.word_embeddings.weight"] if shared else []), differ
        for k in a:
            bound = 2 * 2.0**-8 * float(a[k].abs().max())  # one bf16 rounding per micro-batch (2)
            assert float((a[k] - b[k]).abs().max()) <= bound, k
