"""``--optimizer-impl``: megatron-core's optimizer wrappers (distributed optimizer and Float16 optimizer, with
bf16 params, keep-in-FP32 params and megatron's default param groups) on torch's fused / foreach AdamW vs megatron's
own torch AdamW: N-step parity within the stated bound, checkpoint round trips across implementations, identical
state-dict format. CPU (gloo, one process); the CUDA fused kernel under ``@pytest.mark.gpu``.

Gradients are the same on both sides and independent of the params (the loss is linear in them: ``sum_p <p, G_p>``),
so the comparison isolates the optimizer arithmetic (a forward through bf16 params would amplify one flipped bf16
rounding into different gradients).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4_primitives import mark_keep_in_fp32
from dsv4_train.optimizer import (
    KernelChoiceAdamW,
    build_optimizer,
    resolve_impl,
    set_adam_impl,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
EPS32 = 2.0**-23
LR = 1e-2
C_ROUNDINGS = 32  # fp32 roundings of the update per step allowed (module doc of dsv4_train.optimizer)


def _toy_cls():
    from megatron.core.transformer.module import MegatronModule

    class Toy(MegatronModule):
        """bf16 and keep-in-FP32 params interleaved; 1-D params land in megatron's no-weight-decay group."""

        def __init__(self, config):
            super().__init__(config)
            g = torch.Generator().manual_seed(0)
            self.w_in = torch.nn.Parameter(torch.randn(16, 8, generator=g) * 0.3)
            self.mix = mark_keep_in_fp32(torch.nn.Parameter(torch.randn(16, 16, generator=g) * 0.2))
            self.w_out = torch.nn.Parameter(torch.randn(5, 16, generator=g) * 0.3)
            self.sink = mark_keep_in_fp32(torch.nn.Parameter(torch.randn(16, generator=g)))
            self.bias = torch.nn.Parameter(torch.randn(7, generator=g))

        def forward(self, grads):  # loss = sum_p <p, G_p>: dL/dp = G_p whatever p is
            return sum((p.float() * g.float()).sum() for p, g in zip(self.parameters(), grads))

    return Toy


def _build(impl, dist_opt, bf16=True, device="cpu", clip_grad=0.0, offload_chunk_numel=None, **fields):
    """The toy model in megatron's DDP and our optimizer builder; ``fields``: extra ``OptimizerConfig`` fields;
    ``offload_chunk_numel``: the pipelined offload step (:mod:`dsv4_train.offload_pipeline`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from dsv4_primitives.megatron.precision import Float16ModuleKeepFP32

    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=1, bf16=bf16, params_dtype=dtype
    )
    model = _toy_cls()(cfg).to(device)
    if bf16:
        model = Float16ModuleKeepFP32(cfg, model)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        bf16=bf16,
        params_dtype=dtype,
        use_distributed_optimizer=dist_opt,
        clip_grad=clip_grad,
        **fields,
    )
    return ddp, build_optimizer(ocfg, [ddp], impl=impl, offload_chunk_numel=offload_chunk_numel)


def _core(ddp):
    m = ddp.module
    return m.module if hasattr(m, "module") else m


class _OpLog(TorchDispatchMode):
    """Names of the aten ops dispatched inside the block (``_fused_adamw_``, ``_foreach_mul_``, ``lerp_``, ...)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _kernel_family(ops: set[str]) -> str:
    """Which torch Adam kernel ran, read from the dispatched ops (not from how it rounds)."""
    if any(o.startswith("_fused_adam") for o in ops):
        return "fused"
    # Adam's own multi-tensor ops (the gradient norm and clipping run ``_foreach_norm`` / ``_foreach_mul_`` through
    # dsv4_primitives.megatron.multi_tensor whatever the Adam kernel)
    if ops & {"_foreach_lerp_", "_foreach_addcdiv_", "_foreach_addcmul_"}:
        return "foreach"
    return "unfused"


def _step(ddp, opt, step, log: _OpLog | None = None):
    gen = torch.Generator().manual_seed(100 + step)
    dev = next(ddp.parameters()).device
    scales = [10.0 ** (-4 + (i + step) % 5) for i in range(5)]  # gradients over five decades
    grads = [
        (s * torch.randn(p.shape, generator=gen)).to(dev) for s, p in zip(scales, _core(ddp).parameters())
    ]
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(grads).backward()
    ddp.finish_grad_sync()
    if log is None:
        ok, _, _ = opt.step()
    else:
        with log:
            ok, _, _ = opt.step()
    assert ok


def _inner(opt):
    return [w.optimizer for w in opt.chained_optimizers]


def _main_state(opt):
    """(main param, exp_avg, exp_avg_sq, step) per inner-optimizer param, in group order."""
    out = []
    for inner in _inner(opt):
        for g in inner.param_groups:
            for p in g["params"]:
                st = inner.state[p]
                out.append(
                    (p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"]))
                )
    return out


def _assert_within_bound(ref, got, steps, what):
    """The module's bound: per step ``C * eps32 * lr * R`` (R = 1 + weight decay |p|: the Adam ratio of the five-
    decade gradients stays below 1.5 here) plus one fp32 ulp of the param."""
    for i, ((p0, m0, v0, s0), (p1, m1, v1, s1)) in enumerate(zip(ref, got, strict=True)):
        assert s0 == s1 == steps, (what, i, s0, s1)
        ulp = torch.finfo(torch.float32).eps * p0.abs().clamp_min(2.0**-126)
        bound = steps * (C_ROUNDINGS * EPS32 * LR * 1.5 + ulp)
        err = (p1 - p0).abs()
        assert (err <= bound).all(), f"{what} param {i}: max err {err.max():.3e} vs bound {bound.max():.3e}"
        for name, a, b in (("exp_avg", m0, m1), ("exp_avg_sq", v0, v1)):
            tol = steps * C_ROUNDINGS * EPS32 * a.abs().max().clamp_min(1e-30)
            assert (a - b).abs().max() <= tol, f"{what} {name} of param {i}"


def test_resolve_impl():
    assert resolve_impl("auto", torch.device("cuda", 0)) == "fused"
    assert resolve_impl("auto", torch.device("cpu")) == "unfused"
    assert resolve_impl("foreach", torch.device("cpu")) == "foreach"
    with pytest.raises(ValueError, match="optimizer-impl must be one of"):
        resolve_impl("apex", torch.device("cpu"))


def test_cli_flags():
    from dsv4_train.cli import build_parser, train_config_from_args
    from dsv4_train.config import TrainConfig

    tc = train_config_from_args(
        build_parser().parse_args(["train", "--optimizer-impl", "fused", "--no-fused-linear-ce"])
    )
    assert tc.optimizer.optimizer_impl == "fused" and tc.precision.fused_linear_ce is False
    tc = train_config_from_args(build_parser().parse_args(["train"]))
    assert tc.optimizer.optimizer_impl == "auto" and tc.precision.fused_linear_ce is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--optimizer-impl", "apex"])
    with pytest.raises(ValueError, match="--optimizer-impl must be one of"):
        TrainConfig.from_flat(optimizer_impl="apex")


@pytest.mark.parametrize("dist_opt", [True, False])
def test_fused_inner_optimizer_keeps_megatron_groups(megatron_cpu, dist_opt):
    from dsv4_primitives.megatron import cuda_as_cpu

    with cuda_as_cpu():
        _, ref = _build("unfused", dist_opt)
        _, opt = _build("fused", dist_opt)
    assert [type(i) for i in _inner(ref)] == [torch.optim.AdamW] * len(_inner(ref))
    assert all(type(i) is KernelChoiceAdamW for i in _inner(opt))
    for a, b in zip(_inner(ref), _inner(opt), strict=True):
        assert len(a.param_groups) == len(b.param_groups) >= 2  # weight-decay and no-weight-decay groups
        for ga, gb in zip(a.param_groups, b.param_groups, strict=True):
            assert gb["fused"] is True and gb["foreach"] is False and ga["fused"] is None
            strip = {"params", "fused", "foreach"}
            assert {k: v for k, v in ga.items() if k not in strip} == {
                k: v for k, v in gb.items() if k not in strip
            }
            assert [p.shape for p in ga["params"]] == [p.shape for p in gb["params"]]


def test_set_adam_impl_refuses_non_torch_adam(megatron_cpu):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from dsv4_primitives.megatron import cuda_as_cpu

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with cuda_as_cpu():
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), _toy_cls()(cfg))
        sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1), [ddp])
    with pytest.raises(ValueError, match="megatron built SGD"):
        set_adam_impl(sgd, "fused")
    assert set_adam_impl(sgd, "unfused") is sgd


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("dist_opt, bf16", [(True, True), (False, True), (True, False)])
def test_parity_with_megatron_adam(megatron_cpu, impl, dist_opt, bf16):
    from dsv4_primitives.megatron import cuda_as_cpu

    steps = 6
    ref_ops, ops = _OpLog(), _OpLog()
    with cuda_as_cpu():
        ddp0, ref = _build("unfused", dist_opt, bf16)
        ddp1, opt = _build(impl, dist_opt, bf16)
        for s in range(steps):
            _step(ddp0, ref, s, ref_ops)
            _step(ddp1, opt, s, ops)
    # the kernel that ran, seen in the dispatched ops (a rounding difference proves nothing: on some CPUs the
    # fused and the single-tensor update round identically)
    assert _kernel_family(ref_ops.ops) == "unfused", sorted(ref_ops.ops)
    assert _kernel_family(ops.ops) == impl, sorted(ops.ops)
    _assert_within_bound(_main_state(ref), _main_state(opt), steps, f"{impl} dist_opt={dist_opt} bf16={bf16}")
    for (n, p0), p1 in zip(_core(ddp0).named_parameters(), _core(ddp1).parameters(), strict=True):
        assert p0.dtype == p1.dtype and p0.dtype == (
            torch.float32 if n in ("mix", "sink") or not bf16 else torch.bfloat16
        )
        if (
            p0.dtype == torch.bfloat16
        ):  # the rounding of main params that agree to the bound: at most one bf16 ulp
            ulp = 2.0**-7 * p0.float().abs()
            assert ((p1.float() - p0.float()).abs() <= ulp).all(), n


def _save(ddp, opt, path, dist_opt):
    from megatron.core import dist_checkpointing

    meta = {"distrib_optim_sharding_type": "dp_reshardable"} if dist_opt else None
    sd = _core(ddp).sharded_state_dict()
    path.mkdir()
    dist_checkpointing.save({"model": sd, "optimizer": opt.sharded_state_dict(sd, metadata=meta)}, str(path))


def _load(ddp, opt, path, dist_opt):
    from megatron.core import dist_checkpointing

    meta = {"distrib_optim_sharding_type": "dp_reshardable"} if dist_opt else None
    sd = _core(ddp).sharded_state_dict()
    template = {"model": sd, "optimizer": opt.sharded_state_dict(sd, is_loading=True, metadata=meta)}
    loaded = dist_checkpointing.load(template, str(path))
    groups = [dict(g) for g in _find_param_groups(loaded["optimizer"])]  # as saved
    _core(ddp).load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    return groups


def _find_param_groups(obj):
    if isinstance(obj, dict):
        if "param_groups" in obj:
            return list(obj["param_groups"])
        return [g for v in obj.values() for g in _find_param_groups(v)]
    if isinstance(obj, (list, tuple)):
        return [g for v in obj for g in _find_param_groups(v)]
    return []


@pytest.mark.parametrize("dist_opt", [True, False])
@pytest.mark.parametrize(
    "save_impl, load_impl", [("unfused", "fused"), ("fused", "unfused"), ("fused", "fused")]
)
def test_checkpoint_round_trip_across_impls(megatron_cpu, tmp_path, dist_opt, save_impl, load_impl):
    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_train.checkpoint import sync_saver_queue

    sync_saver_queue()
    with cuda_as_cpu():
        ddp, opt = _build(save_impl, dist_opt)
        for s in range(3):
            _step(ddp, opt, s)
        _save(ddp, opt, tmp_path / "ckpt", dist_opt)
        ddp2, opt2 = _build(load_impl, dist_opt)
        saved_groups = _load(ddp2, opt2, tmp_path / "ckpt", dist_opt)
        # the loaded optimizer keeps its own kernel, with Adam's step where that kernel wants it
        for inner in _inner(opt2):
            for g in inner.param_groups:
                assert g["fused"] is (True if load_impl == "fused" else None)
                for p in g["params"]:
                    assert float(inner.state[p]["step"]) == 3.0
        # the model, main params and Adam state come back bitwise
        for (n, a), b in zip(_core(ddp).state_dict().items(), _core(ddp2).state_dict().values(), strict=True):
            assert torch.equal(a, b), n
        for i, (a, b) in enumerate(zip(_main_state(opt), _main_state(opt2), strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and a[3] == b[3], i
        _step(ddp, opt, 3)
        _step(ddp2, opt2, 3)
    if save_impl == load_impl:
        for a, b in zip(_main_state(opt), _main_state(opt2), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
    else:  # one step on another kernel: within one step's bound of the uninterrupted run
        _assert_within_bound(_main_state(opt), _main_state(opt2), 4, "resumed on another kernel")
    # the checkpoint says nothing about the kernel: megatron's flags (None), Adam's step as a CPU float32 value
    assert saved_groups and all(g["fused"] is None and g["foreach"] is None for g in saved_groups)


@pytest.mark.parametrize("dist_opt", [True, False])
def test_state_dict_format_identical(megatron_cpu, dist_opt):
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedObject

    from dsv4_primitives.megatron import cuda_as_cpu

    def layout(obj, prefix=""):
        """Flat {path: type / (key, shape, dtype) / value} of a (sharded) state dict."""
        if isinstance(obj, dict):
            return {k2: v2 for k, v in obj.items() for k2, v2 in layout(v, f"{prefix}/{k}").items()}
        if isinstance(obj, (list, tuple)):
            return {k2: v2 for i, v in enumerate(obj) for k2, v2 in layout(v, f"{prefix}/{i}").items()}
        if isinstance(obj, LocalNonpersistentObject):  # never written
            return {prefix: "nonpersistent"}
        if isinstance(
            obj, ShardedObject
        ):  # the common part (param groups, step): recurse into what is written
            return {prefix: obj.key, **layout(obj.data, f"{prefix}.data")}
        if isinstance(obj, ShardedBase):
            data = getattr(obj, "data", None)
            return {
                prefix: (
                    obj.key,
                    tuple(data.shape) if torch.is_tensor(data) else None,
                    getattr(obj, "dtype", None),
                )
            }
        if torch.is_tensor(obj):
            return {prefix: (tuple(obj.shape), obj.dtype, obj.device.type)}
        return {prefix: obj}

    meta = {"distrib_optim_sharding_type": "dp_reshardable"} if dist_opt else None
    out = {}
    with cuda_as_cpu():
        for impl in ("unfused", "fused"):
            ddp, opt = _build(impl, dist_opt)
            for s in range(2):
                _step(ddp, opt, s)
            sd = _core(ddp).sharded_state_dict()
            out[impl] = (layout(opt.state_dict()), layout(opt.sharded_state_dict(sd, metadata=meta)))
    assert out["unfused"][0] == out["fused"][0]
    assert out["unfused"][1] == out["fused"][1]


@pytest.mark.gpu
@pytest.mark.parametrize("dist_opt", [True, False])
def test_cuda_fused_parity_with_megatron_adam(megatron_cpu, dist_opt):
    steps = 6
    ddp0, ref = _build("unfused", dist_opt, device="cuda")
    ddp1, opt = _build("auto", dist_opt, device="cuda")
    assert all(type(i) is KernelChoiceAdamW for i in _inner(opt))
    for s in range(steps):
        _step(ddp0, ref, s)
        _step(ddp1, opt, s)
    got = _main_state(opt)
    assert all(
        inner.state[p]["step"].is_cuda
        for inner in _inner(opt)
        for g in inner.param_groups
        for p in g["params"]
    )
    _assert_within_bound(
        [tuple(x.cpu() if torch.is_tensor(x) else x for x in t) for t in _main_state(ref)],
        [tuple(x.cpu() if torch.is_tensor(x) else x for x in t) for t in got],
        steps,
        "cuda fused",
    )
