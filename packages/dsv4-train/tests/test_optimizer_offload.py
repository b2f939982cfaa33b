"""``--optimizer-cpu-offload``: megatron-core's ``HybridDeviceOptimizer`` inside our distributed optimizer
(:mod:`dsv4_train.offload`), on CPU.

Without CUDA, megatron's hybrid optimizer would offload nothing (it splits by ``param.is_cuda``) and then fail, so
the tests run it under :func:`offload_sim.simulated_device`: CPU tensors play the GPU, pinned copies play the host.
The real offload path runs (host copies of the shards, host Adam state, gradient copies into pinned buffers, the
copy-back hooks into the model's param buffer); the tests check that it did (host state, offloaded element counts).

Parity: both sides of the hybrid optimizer are torch's ``AdamW(fused=True)``; the non-offloaded reference runs with
``--optimizer-impl fused`` (the same kernel on CPU), so updates are bitwise equal. On a GPU the part kept on the
device runs the CUDA fused kernel and the host part the CPU one: the same AdamW within the rounding bound stated in
:mod:`dsv4_train.optimizer`. Gradients are independent of the params (``test_optimizer_impl``'s toy), so
the comparison isolates the optimizer.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from offload_sim import simulated_device
from test_optimizer_impl import _build as _build_toy
from test_optimizer_impl import _core, _load, _main_state, _save, _step

from dsv4_train.offload import hybrid_optimizers, offload_config_fields, offloaded_numel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _build(offload, *, fraction=1.0, bf16=True, dist_opt=True, impl=None, device="cpu", **fields):
    fields = {**(offload_config_fields(fraction) if offload else {}), **fields}
    impl = impl or ("auto" if offload else "fused")
    return _build_toy(impl, dist_opt, bf16=bf16, device=device, clip_grad=1.0, **fields)


def _model_params(ddp):
    return {n: p.detach().clone() for n, p in _core(ddp).named_parameters()}


def _hybrid_state(opt):
    """(main param, exp_avg, exp_avg_sq) per shard of the hybrid optimizer, in the distributed optimizer's order."""
    out = []
    for hdo in hybrid_optimizers(opt):
        for g in hdo.param_groups:
            for p in g["params"]:
                st = hdo.state[p]
                out.append(
                    (st["master_param"].detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone())
                )
    return out


def _check_offloaded(opt, mode, fraction):
    """The real offload path ran: the expected share of elements has its master and Adam state on the host."""
    (hdo,) = hybrid_optimizers(opt)
    host, total = offloaded_numel(opt)
    assert total > 0 and host >= fraction * total and (fraction == 1.0 or host < total), (host, total)
    for gpu_param, host_copy in hdo.gpu_params_map_cpu_copy.items():
        assert mode.is_host(host_copy) and not mode.is_host(gpu_param)
        st = hdo.state[gpu_param]
        assert (
            mode.is_host(st["exp_avg"]) and mode.is_host(st["exp_avg_sq"]) and st["master_param"] is host_copy
        )
        assert host_copy.dtype == torch.float32
    return hdo


@pytest.mark.parametrize("fraction, bf16", [(1.0, True), (0.5, True), (0.5, False)])
def test_offload_parity(megatron_cpu, fraction, bf16):
    from dsv4_primitives.megatron import cuda_as_cpu

    steps = 4
    with cuda_as_cpu():
        ddp0, ref = _build(False, bf16=bf16)
        for s in range(steps):
            _step(ddp0, ref, s)
        with simulated_device() as mode:
            ddp1, opt = _build(True, fraction=fraction, bf16=bf16)
            init = _model_params(ddp1)
            for s in range(steps):
                _step(ddp1, opt, s)
            hdo = _check_offloaded(opt, mode, fraction)
    if fraction < 1.0:  # a native FP32 shard on the device side is updated too (fix 2 of the offload module)
        assert hdo.gpu_optimizer is not None
        kept = [
            p
            for g in hdo.gpu_optimizer.param_groups
            for p in g["params"]
            if p not in hdo.fp32_param_to_orig_param
        ]
        assert kept, "the 0.5 split should keep a native FP32 shard on the device"
    for (n, a), b in zip(_model_params(ddp0).items(), _model_params(ddp1).values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b) and not torch.equal(b, init[n]), n
    for i, ((p0, m0, v0, _), (p1, m1, v1)) in enumerate(
        zip(_main_state(ref), _hybrid_state(opt), strict=True)
    ):
        assert torch.equal(p0, p1) and torch.equal(m0, m1) and torch.equal(v0, v1), i


@pytest.mark.parametrize("save_offload, load_offload", [(True, False), (False, True), (True, True)])
def test_checkpoint_round_trip(megatron_cpu, tmp_path, save_offload, load_offload):
    """Save with or without the offload, resume with or without it: the resumed run's next step (params, masters,
    moments) is bitwise the uninterrupted run's (both sides run the fused AdamW kernel)."""
    import contextlib

    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_train.checkpoint import sync_saver_queue

    def state(ddp, opt, offload):
        return _model_params(ddp), (_hybrid_state(opt) if offload else [t[:3] for t in _main_state(opt)])

    sync_saver_queue()
    with cuda_as_cpu(), simulated_device() as mode:
        sim = (
            contextlib.nullcontext
        )  # the mode is on for both sides (it only matters to the hybrid optimizer)
        with sim():
            ddp, opt = _build(save_offload)
            for s in range(3):
                _step(ddp, opt, s)
            _save(ddp, opt, tmp_path / "ckpt", True)
            ddp2, opt2 = _build(load_offload)
            _load(ddp2, opt2, tmp_path / "ckpt", True)
            after_load = _model_params(ddp2)
            _step(ddp, opt, 3)
            _step(ddp2, opt2, 3)
        if load_offload:
            _check_offloaded(opt2, mode, 1.0)
    for (n, a), b in zip(_model_params(ddp).items(), after_load.values(), strict=True):
        assert not torch.equal(a, b), n  # the step after the load moved every param
    p1, s1 = state(ddp, opt, save_offload)
    p2, s2 = state(ddp2, opt2, load_offload)
    for n in p1:
        assert torch.equal(p1[n], p2[n]), n
    for i, (a, b) in enumerate(zip(s1, s2, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), i


def test_checkpoint_format_identical(megatron_cpu):
    """The offloaded optimizer's state dict and sharded state dict have the plain optimizer's layout and values
    (no hybrid-only keys, no per-param step, the kernel flags as megatron writes them)."""
    from dsv4_primitives.megatron import cuda_as_cpu

    def groups(opt):
        sd = opt.state_dict()
        return (
            [g["optimizer"]["param_groups"] for g in sd.values()]
            if isinstance(sd, dict) and 0 in sd
            else [sd["optimizer"]["param_groups"]]
        )

    with cuda_as_cpu(), simulated_device():
        out = {}
        for offload in (False, True):
            ddp, opt = _build(offload, impl="unfused" if not offload else None)
            for s in range(2):
                _step(ddp, opt, s)
            sd = _core(ddp).sharded_state_dict()
            meta = {"distrib_optim_sharding_type": "dp_reshardable"}
            sharded = opt.sharded_state_dict(sd, metadata=meta)
            out[offload] = (groups(opt), _keys(sharded))
    for a, b in zip(out[False][0][0], out[True][0][0], strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert out[False] == out[True]


def _keys(obj, prefix=""):
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _keys(v, f"{prefix}/{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in _keys(v, f"{prefix}/{i}").items()}
    if isinstance(obj, ShardedBase):
        data = getattr(obj, "data", None)
        return {prefix: (obj.key, tuple(data.shape) if torch.is_tensor(data) else None)}
    return {prefix: type(obj).__name__}


def test_refusals(megatron_cpu):
    from dsv4_primitives.megatron import cuda_as_cpu

    with cuda_as_cpu():
        with pytest.raises(ValueError, match="model is on the CPU"):
            _build(True)  # no simulated device: real CPU params
        with simulated_device():
            with pytest.raises(ValueError, match="needs the distributed optimizer"):
                _build(True, dist_opt=False, use_precision_aware_optimizer=False)
            with pytest.raises(ValueError, match="precision-aware path"):
                _build(True, use_precision_aware_optimizer=False)
            with pytest.raises(ValueError, match="--optimizer-impl fused picks the kernel"):
                _build(True, impl="fused")
            with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
                _build(True, fraction=0.0)


def test_cli_flags():
    from dsv4_train.cli import build_parser, train_config_from_args
    from dsv4_train.config import TrainConfig

    def tc_of(*argv):
        return train_config_from_args(build_parser().parse_args(["train", *argv]))

    tc = tc_of("--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25")
    assert tc.optimizer.optimizer_cpu_offload is True and tc.optimizer.optimizer_offload_fraction == 0.25
    tc = tc_of()
    assert tc.optimizer.optimizer_cpu_offload is False and tc.optimizer.optimizer_offload_fraction == 1.0
    with pytest.raises(ValueError, match="only applies with --optimizer-cpu-offload"):
        tc_of("--optimizer-offload-fraction", "0.5")
    with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
        TrainConfig.from_flat(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5)
    with pytest.raises(ValueError, match="--optimizer-impl fused cannot apply"):
        TrainConfig.from_flat(optimizer_cpu_offload=True, optimizer_impl="fused")
    with pytest.raises(ValueError, match="--optimizer-cpu-offload with --cuda-graph"):
        TrainConfig.from_flat(optimizer_cpu_offload=True, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_cuda_offload_parity(megatron_cpu, tmp_path, fraction):
    """On the GPU: host Adam (CPU fused kernel) and device Adam (CUDA fused kernel) against the non-offloaded
    CUDA fused kernel, within the rounding bound of :mod:`dsv4_train.optimizer`; then a checkpoint
    round trip offloaded -> offloaded keeps the device state on the device and resumes bitwise."""
    from test_optimizer_impl import _assert_within_bound

    from dsv4_train.checkpoint import sync_saver_queue

    steps = 4
    ddp0, ref = _build(False, device="cuda")
    ddp1, opt = _build(True, fraction=fraction, device="cuda")
    (hdo,) = hybrid_optimizers(opt)
    assert all(not p.is_cuda for p in hdo.gpu_params_map_cpu_copy.values())
    for s in range(steps):
        _step(ddp0, ref, s)
        _step(ddp1, opt, s)
    cpu = [tuple(x.cpu() for x in t[:3]) + (t[3],) for t in _main_state(ref)]
    got = [tuple(x.cpu() for x in t) + (float(steps),) for t in _hybrid_state(opt)]
    _assert_within_bound(cpu, got, steps, f"offload {fraction}")
    sync_saver_queue()
    _save(ddp1, opt, tmp_path / "ckpt", True)
    ddp2, opt2 = _build(True, fraction=fraction, device="cuda")
    _load(ddp2, opt2, tmp_path / "ckpt", True)
    (hdo2,) = hybrid_optimizers(opt2)
    for sub in hdo2.sub_optimizers:  # fix 4: state beside its param
        for p, st in sub.state.items():
            assert all(v.device == p.device for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    _step(ddp1, opt, steps)
    _step(ddp2, opt2, steps)
    for (n, a), b in zip(_model_params(ddp1).items(), _model_params(ddp2).values(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_offload():
    """DP2 on gloo: each rank's hybrid optimizer holds its half of the distributed optimizer's shards, and the
    offloaded run equals the non-offloaded fused run bitwise on both ranks (per-rank gradients differ; the DP
    average is applied), the ranks agreeing on every param after the all-gather."""
    from offload_sim import dp_rank_offload_vs_fused

    from dsv4_testkit import run_distributed

    results = run_distributed(dp_rank_offload_vs_fused, 2, 1.0)
    for r in results:
        host, total = r["shard"]
        assert host == total and 0 < total < r["numel"]  # this rank's shard only, all of it offloaded
        for n, p in r["ref"].items():
            assert torch.equal(p, r["offload"][n]), n
    assert sum(r["shard"][1] for r in results) >= results[0]["numel"]
    for n, p in results[0]["offload"].items():
        assert torch.equal(p, results[1]["offload"][n]), n
