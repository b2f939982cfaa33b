"""``G`` (megatron-core's GDN) in a DSv4 model: the local spec, its parameter and FLOP counts, its refusals.

fla (the ``hybrid-model[gdn]`` extra) imports only where Triton finds a GPU, so megatron cannot build the layer on
CPU: here the layer is built with megatron's ``HAVE_FLA`` flag set for the construction only (construction calls
no fla kernel), to count its parameters; forward + backward and ``dsv4 train`` run on the H200
(``test_symbol_layers_gpu.py``)."""

import importlib.util
import re
import types

import pytest
import torch

from hybrid_model.flops import forward_flops, forward_flops_from_stats
from hybrid_model.gated_delta_net import (
    GDNSizes,
    check_gdn_heads,
    gdn_core_flops,
    gdn_layer_params,
    gdn_projection_flops,
)
from hybrid_model.gated_delta_net_layer import GatedDeltaNetLayer, packed_seq_params_on
from hybrid_model.mixers.gdn import RECORD as GDN_RECORD
from hybrid_model.mixers.gdn import check_gdn_training, local_gdn_layer_spec
from hybrid_model.params import analytic_param_counts
from hybrid_model.presets import get_preset


def _tiny(pattern):
    return get_preset("tiny").with_pattern(pattern)


def _pg(cp=1):
    return types.SimpleNamespace(cp=types.SimpleNamespace(size=lambda: cp))


def test_local_layer_parameter_count_matches_the_formula(megatron_cpu, monkeypatch):
    """The local spec builds megatron's ``GatedDeltaNet`` in a ``TransformerLayer`` (DSv4 RMSNorm input norm,
    local linears, a params-dtype RMSNorm ``out_norm``); its parameters are exactly :func:`gdn_layer_params` at the
    model config's (megatron default) sizes."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, common
    from megatron.core.ssm.gated_delta_net import gdn as gdn_module
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from dsv4_primitives import RMSNorm
    from dsv4_primitives.megatron import cuda_as_cpu
    from hybrid_model.spec import transformer_config

    cfg = _tiny("WGE")
    config = transformer_config(cfg)
    assert GDNSizes.of(config) == GDNSizes.for_hidden_size(cfg.hidden_size)
    sizes = GDNSizes.of(config)
    assert (sizes.linear_num_key_heads, sizes.linear_num_value_heads, sizes.linear_key_head_dim) == (
        16,
        32,
        128,
    )
    spec = local_gdn_layer_spec()
    assert spec.module is GatedDeltaNetLayer

    def no_kernel(*args, **kwargs):
        raise AssertionError("construction only: no fla kernel runs in this test")

    monkeypatch.setattr(common, "HAVE_FLA", True)
    monkeypatch.setattr(gdn_module, "chunk_gated_delta_rule", no_kernel)
    with cuda_as_cpu():
        layer = TransformerLayer(
            config,
            spec.submodules,
            layer_number=1,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
    gdn = layer.self_attention
    assert isinstance(gdn, GatedDeltaNet) and isinstance(layer.input_layernorm, RMSNorm)
    assert isinstance(gdn.in_proj, ColumnParallelLinear) and isinstance(gdn.out_proj, RowParallelLinear)
    assert isinstance(gdn.out_norm, torch.nn.RMSNorm) and gdn.out_norm.eps == config.layernorm_epsilon
    assert gdn.in_proj.weight.shape == (sizes.in_proj_width, cfg.hidden_size)
    assert sum(p.numel() for p in layer.parameters()) == gdn_layer_params(sizes)


def test_params_and_flops_of_a_gdn_pattern_by_hand():
    """d = 64, Hk = 16, Hv = 32, dk = dv = 128, K = 4: in_proj 64·(2·2048 + 2·4096 + 64), conv 4·(4096 + 4096),
    dt_bias + A_log 64, out_norm 128, out_proj 4096·64, input norm 64; FLOPs 2·(in + out) and 6·Hv·dk·dv a token."""
    d = 64
    per_layer = d * 12352 + 4 * 8192 + 64 + 128 + 4096 * d + d
    sizes = GDNSizes.for_hidden_size(d)
    assert gdn_layer_params(sizes) == per_layer
    with_g, without = analytic_param_counts(_tiny("WGE/WE")), analytic_param_counts(_tiny("WE/WE"))
    mhc = with_g.components["mhc"] - without.components["mhc"]  # the G layer's own mHC sub-layer
    assert with_g.total - without.total == per_layer + mhc > per_layer
    assert with_g.components["attention.gated_delta_net"] == per_layer - d
    lengths = [5, 11]
    br = forward_flops(_tiny("WGE/WE"), lengths)
    assert br.components["linear_attention.projections"] == 2 * (d * 12352 + 4096 * d) * 16
    assert br.components["linear_attention.delta_rule"] == 6 * 32 * 128 * 128 * 16
    assert (
        gdn_projection_flops(sizes) + gdn_core_flops(sizes) == 2 * (d * 12352 + 4096 * d) + 6 * 32 * 128 * 128
    )
    stats = forward_flops_from_stats(_tiny("WGE/WE"), sum(lengths), sum(x * x for x in lengths))
    assert stats.components["linear_attention.delta_rule"] == br.components["linear_attention.delta_rule"]


def test_refusals(monkeypatch):
    config = types.SimpleNamespace(
        tensor_model_parallel_size=1, linear_num_key_heads=16, linear_num_value_heads=32
    )
    GDN_RECORD.check_single_rank(config, _pg(1))
    check_gdn_heads(config)
    with pytest.raises(ValueError, match=r"does not support context parallelism.*use --cp 1"):
        GDN_RECORD.check_single_rank(config, _pg(2))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1 only"):
        GDN_RECORD.check_single_rank(
            types.SimpleNamespace(**{**vars(config), "tensor_model_parallel_size": 2}), _pg(1)
        )
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(24\) must be a multiple"):
        check_gdn_heads(types.SimpleNamespace(**{**vars(config), "linear_num_value_heads": 24}))
    if (
        importlib.util.find_spec("fla") is None
    ):  # packed G without fla: the ImportError naming the extra first
        with pytest.raises(ImportError, match=re.escape("hybrid-model[gdn]")):
            check_gdn_training("WGE", packed=True, deterministic=True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "fla" else real(n, *a))
    if not torch.cuda.is_available():  # on CUDA it depends on fla's kernels (tested on the H200)
        check_gdn_training("WGE", packed=True, deterministic=False)
    check_gdn_training("WCE", packed=True, deterministic=True)
    check_gdn_training("WGE", packed=False, deterministic=True)
    with pytest.raises(
        ValueError, match=r"--packed with the pattern 'WGE': .*--deterministic, so megatron's torch"
    ):
        check_gdn_training("WGE", packed=True, deterministic=True)
    check_gdn_training("WCE", packed=False, deterministic=False, cuda_graph=True)
    with pytest.raises(ValueError, match=re.escape("--cuda-graph cannot run the pattern 'WGE-'")):
        check_gdn_training("WGE-", packed=False, deterministic=False, cuda_graph=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_a_gdn_model_refuses_to_build_without_cuda(megatron_cpu, monkeypatch):
    """With fla present (as the extra would install it) a ``G`` model on CPU stops with the reason before megatron's
    GDN module imports fla (which raises a Triton driver error without a GPU); the layer refuses on its own too."""
    from hybrid_model.model import build_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "fla" else real(n, *a))
    with pytest.raises(ValueError, match="runs on a CUDA GPU only"):
        build_model(_tiny("WGE/WE"))
    with pytest.raises(ValueError, match="runs on a CUDA GPU only"):
        GatedDeltaNetLayer(object(), object(), record=GDN_RECORD, pg_collection=_pg(1))


def test_spec_follows_the_backend(monkeypatch):
    """Local without transformer-engine (or with megatron's local provider), megatron's own TE spec with it; both
    through :class:`GatedDeltaNetLayer`. A missing fla names the ``hybrid-model[gdn]`` extra."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    real = importlib.util.find_spec
    cfg = _tiny("WGE")

    def installed(*modules):
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda n, *a: (
                object() if n in modules else None if n in ("fla", "transformer_engine") else real(n, *a)
            ),
        )

    installed("fla")
    local = GDN_RECORD.spec(cfg, None, False)
    assert local.module is GatedDeltaNetLayer and local.submodules.input_layernorm is not None
    assert local.params == {"record": GDN_RECORD}
    installed("fla", "transformer_engine")
    te = GDN_RECORD.spec(cfg, None, False)
    assert te.module is GatedDeltaNetLayer and te.params == {"record": GDN_RECORD}
    assert te.submodules is hybrid_stack_spec.submodules.gdn_layer.submodules
    assert GDN_RECORD.spec(cfg, LocalSpecProvider(), False).submodules == local.submodules
    installed()
    with pytest.raises(ImportError, match=re.escape("hybrid-model[gdn]")):
        GDN_RECORD.spec(cfg, None, False)


def test_packed_seq_params_move_to_the_activations_device():
    """fla's varlen kernels read ``cu_seqlens`` on the activations' device; the trainer's packs keep them on the
    host. ``meta`` stands in for the GPU here: every ``cu_seqlens*`` tensor moves, nothing else changes."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, max_seqlen_q=5
    )
    moved = packed_seq_params_on(psp, torch.device("meta"))
    assert moved is not psp and moved.qkv_format == "thd" and moved.max_seqlen_q == 5
    assert {
        moved.cu_seqlens_q.device.type,
        moved.cu_seqlens_kv.device.type,
        moved.cu_seqlens_q_padded.device.type,
    } == {"meta"}
    assert moved.cu_seqlens_kv_padded is None and psp.cu_seqlens_q.device.type == "cpu"
    assert packed_seq_params_on(moved, torch.device("meta")) is moved
