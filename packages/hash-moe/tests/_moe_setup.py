"""Shared builders for the megatron-level tests (tiny DSv4 MoE configs, a full fp64 weight set, the fp64 layer
reference) and the CPU stand-in for the all-to-all dispatcher's CUDA side stream."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

HIDDEN, FFN, SHARED_FFN, EXPERTS, TOPK, VOCAB = 16, 8, 12, 4, 2, 37


def make_config(*, ep: int = 1, limit: float | None = 0.5, balance: float = 1e-2, dtype=torch.float64, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN,
        moe_shared_expert_intermediate_size=SHARED_FFN,
        moe_token_dispatcher_type="allgather",
        moe_router_score_function="sqrtsoftplus",
        moe_router_topk_scaling_factor=1.5,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=balance,
        activation_func_clamp_value=limit,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        params_dtype=dtype,
        expert_model_parallel_size=ep,
        use_cpu_initialization=True,
    )
    args.update(kw)
    return TransformerConfig(**args)


def full_weights(seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Weights of all ``EXPERTS`` experts, the gate and the shared expert (scaled so the clamps at 0.5 bite)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=0.5: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)
    return {
        "gate": r(EXPERTS, HIDDEN),
        "gate_up": r(EXPERTS, 2 * FFN, HIDDEN),
        "down": r(EXPERTS, HIDDEN, FFN),
        "shared_gate": r(SHARED_FFN, HIDDEN),
        "shared_up": r(SHARED_FFN, HIDDEN),
        "shared_down": r(HIDDEN, SHARED_FFN),
        "bias": r(EXPERTS, scale=0.05).float(),
    }


@torch.no_grad()
def load_weights(layer, w: dict[str, torch.Tensor], local_experts: list[int]) -> None:
    layer.router.weight.copy_(w["gate"])
    layer.experts.gate_up_proj.copy_(w["gate_up"][local_experts])
    layer.experts.down_proj.copy_(w["down"][local_experts])
    layer.shared_experts.linear_gate.weight.copy_(w["shared_gate"])
    layer.shared_experts.linear_up.weight.copy_(w["shared_up"])
    layer.shared_experts.linear_down.weight.copy_(w["shared_down"])
    if hasattr(layer.router, "e_score_correction_bias"):
        layer.router.e_score_correction_bias.copy_(w["bias"])


def tid2eid_table() -> torch.Tensor:
    from hash_moe import build_tid2eid_balanced

    counts = torch.arange(VOCAB, dtype=torch.float64) % 7 + 1
    return build_tid2eid_balanced(counts, EXPERTS, TOPK, seed=3)


def build_layer(hash_routing: bool, local_experts: list[int] | None = None, **cfg_kw):
    """``(DSv4 MoE layer from get_dsv4_moe_spec, the full weight set loaded into it)``; ``cfg_kw`` go to make_config."""
    from hash_moe.megatron import get_dsv4_moe_spec

    spec = get_dsv4_moe_spec(
        hash_routing=hash_routing, vocab_size=VOCAB, tid2eid=tid2eid_table() if hash_routing else None
    )
    layer = spec(config=make_config(**cfg_kw), pg_collection=None, is_mtp_layer=False)
    w = full_weights()
    load_weights(layer, w, list(range(EXPERTS)) if local_experts is None else local_experts)
    return layer, w


def ref_leaves(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh leaf tensors (requires_grad) of the reference's parameters, from :func:`full_weights`' set."""
    leaves = {
        "gate": w["gate"],
        "gate_up": w["gate_up"],
        "down": w["down"],
        "shared_gate_up": torch.cat([w["shared_gate"], w["shared_up"]]),
        "shared_down": w["shared_down"],
    }
    return {k: v.clone().requires_grad_() for k, v in leaves.items()}


def layer_reference(x_sbh, ids_bs, pad_bs, w, leaves, hash_routing, limit=0.5):
    """:func:`hash_moe.moe_reference` of a whole layer on megatron's ``[S, B, H]`` input (ids / padding ``[B, S]``)."""
    from hash_moe import RouterConfig, moe_reference

    s, b, h = x_sbh.shape
    u = x_sbh.reshape(s * b, h)  # megatron's [S, B] token order
    return moe_reference(
        u,
        gate_weight=leaves["gate"],
        expert_gate_up=leaves["gate_up"],
        expert_down=leaves["down"],
        cfg=RouterConfig(num_experts=EXPERTS, topk=TOPK, routed_scaling_factor=1.5),
        limit=limit,
        shared_gate_up=leaves["shared_gate_up"],
        shared_down=leaves["shared_down"],
        selection_bias=None if hash_routing else w["bias"],
        token_ids=ids_bs.t().reshape(-1),
        tid2eid=tid2eid_table() if hash_routing else None,
        valid=None if pad_bs is None else ~pad_bs.t().reshape(-1),
    ).reshape(s, b, h)


class _CpuSideStream:
    """Stand-in for the all-to-all dispatcher's device-to-host side stream and its event, on CPU.

    megatron's ``MoEAlltoAllTokenDispatcher`` creates ``torch.cuda.Stream()`` once per process (a class attribute)
    and, at its D2H point, calls ``stream.wait_stream``, enters ``torch.cuda.stream(stream)``, records an event and
    later ``event.synchronize()``. CPU ops are synchronous, so each of these is a no-op here.
    """

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _CpuSideStream:
        return self  # the "event"; its synchronize() is a no-op

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def alltoall_dispatcher_on_cpu():
    """Run megatron-core 0.19.2's ``alltoall`` token dispatcher on CPU (test-only; a null context with CUDA).

    ``dsv4_primitives.megatron.cuda_as_cpu`` already stands in for ``torch.cuda.current_stream``; this adds:

    1. the dispatcher's side stream, preset as the class attribute (so ``__init__`` never calls
       ``torch.cuda.Stream()``), and ``torch.cuda.stream(<that stand-in>)`` as a null context;
    2. the device-to-host copy ``maybe_move_tensor_to_cpu(t, as_numpy=True)``: on GPU it turns the all-to-all split
       sizes into numpy arrays (which ``all_to_all_single`` accepts as sequences); for a tensor already on the CPU
       megatron returns the tensor itself, which gloo's ``alltoall_base`` rejects. Here CPU tensors get the same
       numpy conversion.

    Everything is restored on exit. The dispatcher's real logic (counts, splits, permutation, all-to-all over gloo,
    chunk sort, unpermute) runs unchanged.
    """
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.transformer.moe import token_dispatcher as td

    from dsv4_primitives.megatron import cuda_as_cpu

    side = _CpuSideStream()
    cls = td.MoEAlltoAllTokenDispatcher
    saved = cls.__dict__["cuda_dtoh_stream"], torch.cuda.stream, td.maybe_move_tensor_to_cpu
    move = saved[2]

    def move_to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()  # what the GPU path returns after its copy
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    cls.cuda_dtoh_stream = side
    torch.cuda.stream = lambda s: contextlib.nullcontext() if s is side else saved[1](s)
    td.maybe_move_tensor_to_cpu = move_to_host
    try:
        with cuda_as_cpu():
            yield
    finally:
        cls.cuda_dtoh_stream, torch.cuda.stream, td.maybe_move_tensor_to_cpu = saved
