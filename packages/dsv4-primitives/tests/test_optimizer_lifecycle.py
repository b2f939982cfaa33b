"""P1 optimizer lifecycle on CPU (gloo): bf16 + native-FP32 (marked) + frozen params train with megatron-core's
mixed-precision optimizer and distributed optimizer, save with dist_checkpointing, load into a fresh model and
optimizer, and agree bitwise (params, buffers, main copies, Adam state, the next training step).

Also pins the megatron-core 0.19.2 bug that :class:`Float16OptimizerWithNativeFP32Params` fixes.
"""

import os

import pytest
import torch

from dsv4_primitives import is_keep_in_fp32, mark_keep_in_fp32
from dsv4_testkit import megatron_cpu_context, run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _toy_cls():
    from megatron.core.transformer.module import MegatronModule

    class MixedPrecisionToy(MegatronModule):
        """Params in the order bf16, fp32, bf16, fp32, fp32(1-D), frozen bf16; an fp32 and an integer buffer."""

        def __init__(self, config, seed):
            super().__init__(config)
            g = torch.Generator().manual_seed(seed)
            self.w_in = torch.nn.Parameter(torch.randn(16, 8, generator=g) * 0.3)
            self.mix = mark_keep_in_fp32(torch.nn.Parameter(torch.randn(16, 16, generator=g) * 0.2))
            self.w_out = torch.nn.Parameter(torch.randn(4, 16, generator=g) * 0.3)
            self.gate = mark_keep_in_fp32(torch.nn.Parameter(torch.randn(4, 16, generator=g) * 0.2))
            self.sink = mark_keep_in_fp32(torch.nn.Parameter(torch.randn(16, generator=g)))
            self.frozen = torch.nn.Parameter(torch.randn(16, generator=g), requires_grad=False)
            self.register_buffer("ape", mark_keep_in_fp32(torch.randn(16, generator=g)))
            self.register_buffer("tid2eid", torch.randint(0, 4, (32,), generator=g))

        def forward(self, x):  # x [N, 8] bf16
            h = x @ self.w_in.t() + self.frozen  # bf16
            h = h.float() @ self.mix.t() * torch.sigmoid(self.sink) + self.ape  # fp32 path
            y = h.to(x.dtype) @ self.w_out.t() + (h @ self.gate.t()).to(x.dtype)
            return y.float().pow(2).mean()

    return MixedPrecisionToy


def _build(seed, dist_opt, overrides, shared_embedding=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from dsv4_primitives.megatron.precision import Float16ModuleKeepFP32, get_megatron_optimizer_keep_fp32

    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    model = Float16ModuleKeepFP32(cfg, _toy_cls()(cfg, seed))
    if (
        shared_embedding
    ):  # as a pipeline stage's word embedding: the distributed optimizer gives it its own bucket
        model.module.w_in.shared_embedding = True
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.1,
        bf16=True,
        use_distributed_optimizer=dist_opt,
        clip_grad=1.0,
    )
    opt = get_megatron_optimizer_keep_fp32(ocfg, [ddp], config_overrides=overrides)
    return ddp, opt


def _train_step(ddp, opt, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 8, generator=g).bfloat16()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(x)
    loss.backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    return loss.detach()


def _model_tensors(ddp):
    out = {n: p.detach().clone() for n, p in ddp.module.module.named_parameters()}
    out.update({n: b.detach().clone() for n, b in ddp.module.module.named_buffers()})
    return out


def _optimizer_tensors(opt):
    """Every inner-optimizer param (main copies / native fp32 / shards) and its state, in group order."""
    out = []
    for inner in opt.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                st = inner.optimizer.state[p]
                out.append((p.detach().clone(), {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}))
    return out


def _assert_bitwise(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max().item()}"


def _check_mapping(ddp, opt, dist_opt):
    model = ddp.module.module
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if n in ("mix", "gate", "sink") else torch.bfloat16), n
    assert model.ape.dtype == torch.float32 and is_keep_in_fp32(model.ape)
    assert model.tid2eid.dtype == torch.int64
    if dist_opt:
        return
    for inner in opt.chained_optimizers:
        id_to_model = inner.main_param_id_to_model_param()
        flat = [p for g in inner.optimizer.param_groups for p in g["params"]]
        for i, main in enumerate(flat):
            model_param = id_to_model[i]
            assert names[id(model_param)] != "frozen"
            if model_param.dtype == torch.float32:
                assert main is model_param  # native FP32 params are their own main copy
            else:
                assert main.dtype == torch.float32 and torch.equal(main.bfloat16(), model_param.detach())


# (distributed optimizer, config_overrides, dist-opt checkpoint format). overrides={} puts every param in one group
# (bf16 / fp32 interleaved inside it); None gives megatron's default groups (1-D params without weight decay, so one
# group holds only native FP32 params). 0.19.2's default dist-opt format 'fully_sharded_model_space' cannot be
# saved at all (flattened ShardedTensors were removed), so the two formats megatron's training loop uses are tested.
# The last variant marks a bf16 param ``shared_embedding``: two buckets in the bf16 buffer with end padding between
# them, where 0.19.2's fully_reshardable save shifted the state of every param after the padding.
VARIANTS = [
    (False, {}, None),
    (False, None, None),
    (True, {}, "dp_reshardable"),
    (True, None, "fully_reshardable"),
    (True, None, "fully_reshardable", "shared_embedding"),
]


def _lifecycle(rank, world_size, ckpt_root):
    from megatron.core import dist_checkpointing

    from dsv4_primitives.megatron import cuda_as_cpu

    results = {}
    with megatron_cpu_context(), cuda_as_cpu():
        for dist_opt, overrides, sharding, *extra in VARIANTS:
            tag = f"distopt{int(dist_opt)}_{'one_group' if overrides == {} else 'default_groups'}"
            shared = "shared_embedding" in extra
            tag += "_shared_embedding" if shared else ""
            meta = {"distrib_optim_sharding_type": sharding} if sharding else None
            ddp, opt = _build(seed=1, dist_opt=dist_opt, overrides=overrides, shared_embedding=shared)
            if shared:  # the layout of the 0.19.2 failure: padding between the buckets of one buffer
                buffers = [b for b in ddp.buffers if len(b.buckets) > 1]
                assert any(
                    bk.offset > prev.offset + prev.numel_unpadded
                    for b in buffers
                    for prev, bk in zip(b.buckets, b.buckets[1:], strict=False)
                ), "no padded bucket end: the variant does not exercise the fix"
            frozen0 = ddp.module.module.frozen.detach().clone()
            losses = [_train_step(ddp, opt, s, rank) for s in range(3)]
            assert torch.isfinite(torch.stack(losses)).all()
            assert torch.equal(ddp.module.module.frozen, frozen0)  # frozen stays frozen
            _check_mapping(ddp, opt, dist_opt)
            ckpt = f"{ckpt_root}/{tag}"
            if rank == 0:
                os.makedirs(ckpt)
            torch.distributed.barrier()
            model_sd = ddp.module.module.sharded_state_dict()
            state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}
            dist_checkpointing.save(state, ckpt)
            torch.distributed.barrier()

            ddp2, opt2 = _build(seed=2, dist_opt=dist_opt, overrides=overrides, shared_embedding=shared)
            model_sd2 = ddp2.module.module.sharded_state_dict()
            template = {
                "model": model_sd2,
                "optimizer": opt2.sharded_state_dict(model_sd2, is_loading=True, metadata=meta),
            }
            loaded = dist_checkpointing.load(template, ckpt)
            ddp2.load_state_dict(loaded["model"])
            opt2.load_state_dict(loaded["optimizer"])

            m1, m2 = _model_tensors(ddp), _model_tensors(ddp2)
            assert m1.keys() == m2.keys()
            for k in m1:
                _assert_bitwise(m1[k], m2[k], f"{tag} model {k}")
            o1, o2 = _optimizer_tensors(opt), _optimizer_tensors(opt2)
            assert len(o1) == len(o2) > 0
            for i, ((p1, s1), (p2, s2)) in enumerate(zip(o1, o2, strict=True)):
                _assert_bitwise(p1, p2, f"{tag} main param {i}")
                assert s1.keys() == s2.keys() and {"exp_avg", "exp_avg_sq"} <= s1.keys(), (tag, s1.keys())
                for k in s1:
                    _assert_bitwise(s1[k], s2[k], f"{tag} state {k} of param {i}")
            _check_mapping(ddp2, opt2, dist_opt)
            # resumed training continues bit-identically
            l1, l2 = _train_step(ddp, opt, 7, rank), _train_step(ddp2, opt2, 7, rank)
            _assert_bitwise(l1, l2, f"{tag} loss after resume")
            for k, v in _model_tensors(ddp).items():
                _assert_bitwise(v, _model_tensors(ddp2)[k], f"{tag} model {k} after resume step")
            results[tag] = [float(x) for x in losses]
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_optimizer_checkpoint_lifecycle_two_ranks(tmp_path):
    res = run_distributed(_lifecycle, 2, str(tmp_path), timeout=300)
    assert res[0].keys() == {
        "distopt0_one_group",
        "distopt0_default_groups",
        "distopt1_one_group",
        "distopt1_default_groups",
        "distopt1_default_groups_shared_embedding",
    }
    # the same data-parallel training on both ranks: identical losses per variant after the all-reduce
    for tag in res[0]:
        assert len(res[0][tag]) == 3


def test_megatron_0192_float16_optimizer_mismaps_native_fp32(megatron_cpu):
    """Regression pin: the unfixed optimizer cannot checkpoint an interleaved bf16/fp32 model; ours can."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_primitives.megatron.precision import Float16OptimizerWithNativeFP32Params

    with cuda_as_cpu():
        ddp, opt = _build(seed=1, dist_opt=False, overrides={})
        _train_step(ddp, opt, 0, 0)
        inner = opt.chained_optimizers[0]
        assert type(inner) is Float16OptimizerWithNativeFP32Params
        model_sd = ddp.module.module.sharded_state_dict()
        fixed = inner.sharded_state_dict(model_sd)
        keys = {
            sh.key: tuple(sh.local_shape)
            for grp in fixed["optimizer"]["state"].values()
            if isinstance(grp, dict)
            for sh in grp.values()
            if hasattr(sh, "key")
        }
        assert keys["optimizer.state.exp_avg.mix"] == (16, 16)
        assert keys["optimizer.state.exp_avg.gate"] == (4, 16)
        assert keys["optimizer.state.exp_avg.w_out"] == (4, 16)
        fp32_keys = [t.key for t in fixed["fp32_from_fp16_params"][0]]
        assert fp32_keys == ["optimizer.state.fp32_param.w_in", "optimizer.state.fp32_param.w_out"]
        inner.__class__ = Float16OptimizerWithFloat16Params  # the 0.19.2 code path
        with pytest.raises(AssertionError, match="does not match model shape"):  # mix's Adam state -> w_out
            inner.sharded_state_dict(model_sd)


def test_megatron_0192_distributed_optimizer_group_index_map(megatron_cpu):
    """Regression pin: 0.19.2's param -> (group, position) map points at other params' shards; ours does not."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_primitives.megatron.precision import DistributedOptimizerWithNativeFP32Params

    with cuda_as_cpu():
        ddp, opt = _build(seed=1, dist_opt=True, overrides={})
        inner = opt.chained_optimizers[0]
        assert type(inner) is DistributedOptimizerWithNativeFP32Params
        model_groups = [  # group membership of the model params (what upstream's map is built from)
            {"params": [*g16, *g32]} for g16, g32 in zip(inner.model_float16_groups, inner.model_fp32_groups)
        ]
        upstream_map, _ = DistributedOptimizer._build_optimizer_group_ranges(model_groups, inner.gbuf_ranges)

        def points_at_own_shard(index_map):
            ok = []
            for model_param, (g, o) in index_map.items():
                main = inner.optimizer.param_groups[g]["params"][o]
                own = main.numel() == model_param.numel() and torch.equal(
                    main.detach().view(-1), model_param.detach().float().view(-1)
                )
                ok.append(own)
            return ok

        assert all(points_at_own_shard(inner.model_param_group_index_map))
        assert not all(points_at_own_shard(upstream_map))
        # a fresh torch-Adam distributed optimizer can build its loading template (0.19.2 asserts here)
        model_sd = ddp.module.module.sharded_state_dict()
        inner.sharded_state_dict(
            model_sd, is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )
