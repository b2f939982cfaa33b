"""A tiny megatron-core HybridModel with mHC (our stack + layer wrapper) and its PP runner, for the CPU tests.

Module-level functions only (``run_distributed`` pickles them into spawned gloo workers).
"""

from __future__ import annotations

import dataclasses

import torch

HIDDEN, HEADS, VOCAB, SEQ, MBS, NUM_MB, STREAMS = 32, 4, 64, 8, 2, 2, 4


def local_hybrid_stack_spec():
    """A ``HybridStack`` spec for '*' (attention) and '-' (MLP) from megatron's local (non-TE) GPT layer parts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    full = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    attn = dataclasses.replace(full, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    mlp = dataclasses.replace(
        full, input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attn),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )


def transformer_config(pp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        add_bias_linear=False,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
        params_dtype=torch.float32,
    )


def build_model(pp: int, pattern: str, pre_process: bool, post_process: bool):
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mhc import MHCConfig
    from mhc.megatron import hyper_connection_stack_spec

    config = transformer_config(pp)
    mhc = MHCConfig(hidden_size=HIDDEN, num_streams=STREAMS, sinkhorn_iters=4, backend="reference")
    spec = hyper_connection_stack_spec(local_hybrid_stack_spec(), mhc)
    return HybridModel(
        config=config,
        hybrid_stack_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_layer_pattern=pattern,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def batches():
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(NUM_MB):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        out.append((tokens, labels))
    return out


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ)[None].expand(MBS, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    out = model(tokens, position_ids, mask, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def run_stage(rank: int, world_size: int) -> dict:
    """One step's forward+backward on ``world_size`` pipeline stages; returns the loss and named grads.

    Every stage copies its shard out of the same deterministic PP=1 parameter set (:func:`initial_state`).
    """
    from megatron.core.pipeline_parallel import schedules

    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_testkit import megatron_cpu_context
    from mhc.megatron import make_mhc_adjust_tensor_shapes_fn

    pp = world_size
    state = initial_state()
    with megatron_cpu_context(pp=pp) as ps:
        first, last = rank == 0, rank == pp - 1
        pattern = "*-*-" if pp == 1 else "*-|*-"
        model = build_model(pp, pattern, pre_process=first, post_process=last)
        layers_per_stage = 4 // pp
        own = {}
        for name, p in model.named_parameters():
            own[name] = _global_name(name, rank * layers_per_stage)
            with torch.no_grad():
                p.copy_(state[own[name]])
        with cuda_as_cpu():  # 0.19.2's schedules allocate with a literal device="cuda"
            fb = schedules.get_forward_backward_func()
            kwargs = dict(
                forward_step_func=_forward_step,
                data_iterator=iter(batches()),
                model=[model],
                num_microbatches=NUM_MB,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=False,
            )
            if pp > 1:
                kwargs["adjust_tensor_shapes_fn"] = make_mhc_adjust_tensor_shapes_fn(STREAMS)
            losses = fb(**kwargs)
        assert ps.get_pipeline_model_parallel_world_size() == pp
        grads = {own[n]: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
        loss = torch.stack([x["lm loss"] for x in losses]).mean().item() if losses else None
        return {"loss": loss, "grads": grads}


def _global_name(name: str, layer_offset: int) -> str:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def initial_state() -> dict:
    """Parameters of the PP=1 model, deterministic; every stage copies its shard out of this set."""
    from dsv4_testkit import megatron_cpu_context

    # inside a gloo world of 2 this is DP=2, PP=1: the same deterministic CPU initialisation on every rank
    with megatron_cpu_context(pp=1, seed=5):
        model = build_model(1, "*-*-", True, True)
        torch.manual_seed(5)
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.add_(0.05 * torch.randn_like(p))  # mHC gates away from their symmetric init
        return {n: p.detach().clone() for n, p in model.named_parameters()}
