"""``--optimizer-impl fused-step`` (dsv4_train.fused_step): megatron-core's distributed / Float16 / FP32 optimizers
with the clip, the AdamW update and the main -> model copy in one Triton pass (the interpreter on CPU) vs megatron's
own torch AdamW: N-step parity within the bound of dsv4_train.optimizer (clipping active), megatron's separate copy
and clip skipped, checkpoints across impls, the same state-dict format, refusals. The toy and helpers are
test_optimizer_impl's (gradients independent of the params)."""

import sys
from pathlib import Path

import pytest
import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

sys.path.insert(0, str(Path(__file__).parent))
from test_optimizer_impl import (
    _assert_within_bound,
    _build,
    _core,
    _inner,
    _load,
    _main_state,
    _OpLog,
    _save,
    _step,
    _toy_cls,
)
from test_train_e2e import _train_runs

from dsv4_testkit import interpreting
from dsv4_train.fused_step import FusedStepAdamW

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(
        not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1"
    ),
]


@pytest.fixture
def copy_calls(monkeypatch):
    """Counts megatron's main -> model copies (patched before the optimizer is built, so the fused step's
    wrapper around it counts too)."""
    calls = []
    for cls in (DistributedOptimizer, Float16OptimizerWithFloat16Params):
        original = cls._copy_main_params_to_model_params

        def counting(self, _original=original):
            calls.append(type(self).__name__)
            return _original(self)

        monkeypatch.setattr(cls, "_copy_main_params_to_model_params", counting)
    return calls


@pytest.mark.parametrize("clip_grad", [1.0, 0.0])
@pytest.mark.parametrize("dist_opt, bf16", [(True, True), (False, True), (True, False)])
def test_parity_with_megatron_adam(megatron_cpu, copy_calls, dist_opt, bf16, clip_grad):
    from dsv4_primitives.megatron import cuda_as_cpu

    steps = 4
    ref_ops, ops = _OpLog(), _OpLog()
    with cuda_as_cpu():
        ddp0, ref = _build("unfused", dist_opt, bf16, clip_grad=clip_grad)
        ddp1, opt = _build("fused-step", dist_opt, bf16, clip_grad=clip_grad)
        assert all(type(i) is FusedStepAdamW for i in _inner(opt))
        for s in range(steps):
            _step(ddp0, ref, s, ref_ops)
            n_ref_copies = len(copy_calls)
            _step(ddp1, opt, s, ops)
            assert len(copy_calls) == n_ref_copies, "megatron's main -> model copy ran after the fused step"
    if bf16:
        assert n_ref_copies == steps  # megatron copies once per step: the count above could fail
    if (
        clip_grad
    ):  # megatron scaled the gradients in place (the five-decade gradients are clipped); we did not
        assert "_foreach_mul_" in ref_ops.ops and "_foreach_mul_" not in ops.ops
    _assert_within_bound(
        _main_state(ref), _main_state(opt), steps, f"fused-step dist_opt={dist_opt} bf16={bf16}"
    )
    for (n, p0), p1 in zip(_core(ddp0).named_parameters(), _core(ddp1).parameters(), strict=True):
        assert p0.dtype == p1.dtype
        if (
            p0.dtype == torch.bfloat16
        ):  # roundings of main params that agree to the bound: one bf16 ulp at most
            assert ((p1.float() - p0.float()).abs() <= 2.0**-7 * p0.float().abs()).all(), n
    # the model params are the bf16 rounding of our own main params (dist-opt: main shards in param order)
    if bf16 and dist_opt:
        wrapper = opt.chained_optimizers[0]
        for shard_group, model_group in zip(
            wrapper.shard_fp32_from_float16_groups, wrapper.model_float16_groups, strict=True
        ):
            for shard, model_param in zip(shard_group, model_group, strict=True):
                assert torch.equal(model_param.detach().view(-1), shard.bfloat16())


@pytest.mark.parametrize("dist_opt", [True, False])
def test_param_without_grad_falls_back_to_megatrons_copy(megatron_cpu, copy_calls, dist_opt):
    """A step in which the kernel did not write every model param (a main param without a gradient) leaves the
    copy to megatron, which then makes every model param the rounding of its main param."""
    from dsv4_primitives.megatron import cuda_as_cpu

    with cuda_as_cpu():
        ddp, opt = _build("fused-step", dist_opt, clip_grad=1.0)
        _step(ddp, opt, 0)
        assert copy_calls == []
        wrapper = opt.chained_optimizers[0]
        inner = wrapper.optimizer
        first = inner.param_groups[0]["params"][0]
        first.grad = None
        with torch.no_grad():
            first.add_(0.5)  # only megatron's copy can bring this into the model param
        wrapper.step_with_ready_grads()
    assert len(copy_calls) == 1 and inner.wrote_model_params is False
    assert float(inner.state[first]["step"]) == 1.0  # no gradient: not stepped
    if dist_opt:
        pairs = zip(wrapper.shard_fp32_from_float16_groups, wrapper.model_float16_groups, strict=True)
    else:
        pairs = zip(wrapper.fp32_from_float16_groups, wrapper.float16_groups, strict=True)
    n = 0
    for mains, models in pairs:
        for main, model_param in zip(mains, models, strict=True):
            assert torch.equal(model_param.detach().view(-1), main.detach().view(-1).bfloat16())
            n += 1
    assert n >= 2


@pytest.mark.parametrize("dist_opt", [True, False])
@pytest.mark.parametrize(
    "save_impl, load_impl", [("fused-step", "unfused"), ("unfused", "fused-step"), ("fused", "fused-step")]
)
def test_checkpoint_round_trip_across_impls(megatron_cpu, tmp_path, dist_opt, save_impl, load_impl):
    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_train.checkpoint import sync_saver_queue

    sync_saver_queue()
    with cuda_as_cpu():
        ddp, opt = _build(save_impl, dist_opt, clip_grad=1.0)
        for s in range(3):
            _step(ddp, opt, s)
        _save(ddp, opt, tmp_path / "ckpt", dist_opt)
        ddp2, opt2 = _build(load_impl, dist_opt, clip_grad=1.0)
        saved_groups = _load(ddp2, opt2, tmp_path / "ckpt", dist_opt)
        for (n, a), b in zip(_core(ddp).state_dict().items(), _core(ddp2).state_dict().values(), strict=True):
            assert torch.equal(a, b), n
        for i, (a, b) in enumerate(zip(_main_state(opt), _main_state(opt2), strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and a[3] == b[3] == 3.0, i
        for inner in _inner(opt2):
            for g in inner.param_groups:
                assert all(inner.state[p]["step"].device.type == "cpu" for p in g["params"])
        _step(ddp, opt, 3)
        _step(ddp2, opt2, 3)
    _assert_within_bound(_main_state(opt), _main_state(opt2), 4, f"{save_impl} -> {load_impl}")
    assert saved_groups and all(g["fused"] is None and g["foreach"] is None for g in saved_groups)


@pytest.mark.parametrize("dist_opt", [True, False])
def test_state_dict_format_identical_to_unfused(megatron_cpu, dist_opt):
    from dsv4_primitives.megatron import cuda_as_cpu

    def layout(sd):
        """(param-group entries without params, per-param state key -> (shape, dtype, device))."""
        inner = sd.get("optimizer", sd)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        state = {
            i: {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in st.items()}
            for i, st in inner["state"].items()
        }
        return groups, state

    out = {}
    with cuda_as_cpu():
        for impl in ("unfused", "fused-step"):
            ddp, opt = _build(impl, dist_opt, clip_grad=1.0)
            for s in range(2):
                _step(ddp, opt, s)
            out[impl] = [layout(w.optimizer.state_dict()) for w in opt.chained_optimizers]
    assert out["unfused"] == out["fused-step"]


def test_refusals(megatron_cpu, monkeypatch):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_train.config import TrainConfig
    from dsv4_train.optimizer import set_adam_impl

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    with cuda_as_cpu():
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), _toy_cls()(cfg))
        sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1), [ddp])
        adam_l2 = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=0.1, decoupled_weight_decay=False), [ddp]
        )
        with pytest.raises(ValueError, match="fused-step cannot apply: megatron built SGD"):
            set_adam_impl(sgd, "fused-step")
        with pytest.raises(ValueError, match="fused-step cannot apply: megatron built Adam "):
            set_adam_impl(adam_l2, "fused-step")
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "0")
            with pytest.raises(ValueError, match="fused-step cannot apply: params on cpu"):
                _build("fused-step", True)
    with pytest.raises(ValueError, match="--optimizer-impl fused-step cannot apply"):
        TrainConfig.from_flat(optimizer_cpu_offload=True, optimizer_impl="fused-step")


def test_cli_flag():
    from dsv4_train.cli import build_parser, train_config_from_args

    tc = train_config_from_args(build_parser().parse_args(["train", "--optimizer-impl", "fused-step"]))
    assert tc.optimizer.optimizer_impl == "fused-step"


@pytest.mark.slow
def test_train_exact_resume_and_cross_impl_resume(tmp_path):
    """``dsv4 train --optimizer-impl fused-step`` (tiny preset, distributed optimizer, bf16, clipping; the kernel in
    the interpreter on CPU): resumes bit-identically, and its checkpoint resumes under ``unfused`` within the
    rounding difference."""
    kw = dict(steps=4, warmup_steps=1)
    run = tmp_path / "run"
    full, tail, other = _train_runs(
        tmp_path,
        dict(out=str(run), save_interval=2, optimizer_impl="fused-step", **kw),
        dict(out=str(run), resume=True, optimizer_impl="fused-step", latest="iter_0000002", **kw),
        dict(out=str(run), resume=True, optimizer_impl="unfused", latest="iter_0000002", **kw),
    )
    assert len(full) == 4 and tail == full[2:]
    assert len(other) == 2
    for a, b in zip(other, full[2:], strict=True):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-3 * abs(b["lm_loss"]), (a, b)
        assert a["lr"] == b["lr"]


@pytest.mark.gpu
@pytest.mark.parametrize("dist_opt", [True, False])
def test_cuda_parity_with_megatron_adam(megatron_cpu, dist_opt):
    steps = 6
    ddp0, ref = _build("unfused", dist_opt, device="cuda", clip_grad=1.0)
    ddp1, opt = _build("fused-step", dist_opt, device="cuda", clip_grad=1.0)
    assert all(type(i) is FusedStepAdamW for i in _inner(opt))
    for s in range(steps):
        _step(ddp0, ref, s)
        _step(ddp1, opt, s)

    def cpu(state):
        return [tuple(x.cpu() if torch.is_tensor(x) else x for x in t) for t in state]

    _assert_within_bound(cpu(_main_state(ref)), cpu(_main_state(opt)), steps, "cuda fused-step")
    for (n, p0), p1 in zip(_core(ddp0).named_parameters(), _core(ddp1).parameters(), strict=True):
        if p0.dtype == torch.bfloat16:
            assert ((p1.float() - p0.float()).abs() <= 2.0**-7 * p0.float().abs()).all(), n
