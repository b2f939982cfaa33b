"""megatron-core expert modules with clamped SwiGLU (P5): grouped routed experts and the shared expert.

:class:`ClampedSwiGLUExperts` implements megatron's ``ExpertsInterface`` (``forward(dispatched_input,
tokens_per_expert, permuted_probs) -> (output, None)``) over ``G = E / EP`` local experts with two fused weights,
``gate_up_proj [G, 2F, H]`` (``[w1; w3]`` per expert, HF layout) and ``down_proj [G, H, F]``; the routing weight
is multiplied into the activation in fp32 before ``w2`` (§7.3). :class:`ClampedSwiGLUSharedExpert` implements
``SharedExpertsInterface`` with tensor-parallel column/row linears and the same clamped activation.

Settings read from the ``TransformerConfig``: ``moe_ffn_hidden_size`` (F), ``moe_shared_expert_intermediate_size``
(shared F), ``activation_func_clamp_value`` (the SwiGLU limit; ``None`` = unclamped), ``params_dtype``,
``init_method`` / ``output_layer_init_method``. Expert tensor parallelism is not supported (DSv4 shards experts by
EP only).

**Decoding** (``routed_max_rows``, default 256; 0 keeps the grouped GEMM). In eval mode without grad (cached decoding, ``hybrid_model.generation``), on CUDA, with at most
``routed_max_rows`` dispatched rows (``tokens · topk``), the routed experts run
:func:`hash_moe.routed_experts.routed_swiglu_experts`: only the experts with rows have their weights read (the
grouped GEMM reads all ``G``), with the counts on the device (no sync, CUDA-graph capturable). Same roundings as the
grouped path, the sums in another order. Training and grad-mode forwards always take the grouped GEMM.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig

from dsv4_primitives.recompute import discard, recompute_config_of, recompute_scope
from hash_moe.experts import grouped_swiglu_experts
from hash_moe.grouped_gemm import GroupedBackend, grouped_mm
from hash_moe.routed_experts import ROUTED_DTYPES, routed_swiglu_experts
from hash_moe.swiglu import check_swiglu_limit, clamped_swiglu

#: default ``routed_max_rows``: decode batches up to 42 tokens at top-6 take the routed kernels (measured on an H100,
#: 2026-12-07, flash-smoke decode after a 4K prompt: CUDA-graph steps 1.20x / 1.10x the grouped GEMM's tokens/s at
#: batch 1 / 32, eager steps 1.12x / 1.20x; hash-moe README)
ROUTED_MAX_ROWS = 256


def _param_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


class ClampedSwiGLUExperts(MegatronModule):
    """The ``G`` local routed experts of one MoE layer (grouped GEMMs + fp32 clamped SwiGLU).

    Args:
        num_local_experts: ``G = num_moe_experts / EP``.
        config: megatron ``TransformerConfig`` (see the module docstring for the fields used).
        pg_collection: process groups (``ep``, ``expt_tp``, ``expt_dp``); megatron's defaults when None.
        name: module name passed down by megatron (unused).
        backend: grouped GEMM backend, ``"auto"`` (``torch._grouped_mm`` on CUDA bf16, a loop elsewhere).
        routed_max_rows: the most dispatched rows for which an eval-mode no-grad CUDA forward runs the routed-expert
            kernels (see the module docstring); 0 = never. Also settable on the module.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        /,
        *,
        pg_collection: ProcessGroupCollection | None = None,
        name: str | None = None,
        backend: GroupedBackend = "auto",
        routed_max_rows: int = ROUTED_MAX_ROWS,
    ) -> None:
        super().__init__(config=config)
        if routed_max_rows < 0:
            raise ValueError(
                f"routed_max_rows must be >= 0 (0 = never use the routed kernels), got {routed_max_rows}"
            )
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        if pg_collection.expt_tp is not None and pg_collection.expt_tp.size() > 1:
            raise ValueError(
                "ClampedSwiGLUExperts does not support expert tensor parallelism; set expert_tensor_parallel_size=1"
            )
        if config.moe_ffn_hidden_size is None:
            raise ValueError("set TransformerConfig.moe_ffn_hidden_size (the routed expert width F)")
        if config.add_bias_linear:
            raise ValueError("DSv4 experts have no biases; set TransformerConfig.add_bias_linear=False")
        check_swiglu_limit(config.activation_func_clamp_value)
        self.num_local_experts = num_local_experts
        self.recompute_activation = recompute_config_of(config).selects("moe_act")
        self.limit = config.activation_func_clamp_value
        self.backend = backend
        self.routed_max_rows = routed_max_rows
        self.ep_group = pg_collection.ep
        self.expt_dp_group = pg_collection.expt_dp
        h, f = config.hidden_size, config.moe_ffn_hidden_size
        kw = {"device": _param_device(), "dtype": config.params_dtype}
        self.gate_up_proj = torch.nn.Parameter(torch.empty(num_local_experts, 2 * f, h, **kw))  # [G, 2F, H]
        self.down_proj = torch.nn.Parameter(torch.empty(num_local_experts, h, f, **kw))  # [G, H, F]
        for p in (self.gate_up_proj, self.down_proj):
            p.allreduce = False  # expert parameter: gradients reduced over the expert-data-parallel group
        if config.perform_initialization:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for e in range(num_local_experts):
                    config.init_method(self.gate_up_proj.data[e])
                    config.output_layer_init_method(self.down_proj.data[e])

    def forward(
        self, dispatched_input: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor, /
    ) -> tuple[torch.Tensor, None]:
        """``[M, H]`` expert-sorted rows, ``[G]`` rows per expert, ``[M]`` weights -> ``([M, H], None)``."""
        routed = self._takes_routed_path(dispatched_input)
        if routed or not (self.recompute_activation and torch.is_grad_enabled()):
            experts = (
                routed_swiglu_experts if routed else partial(grouped_swiglu_experts, backend=self.backend)
            )
            out = experts(
                dispatched_input,
                tokens_per_expert,
                self.gate_up_proj,
                self.down_proj,
                limit=self.limit,
                probs=permuted_probs,
            )
            return out, None
        # moe_act: the activation [M, F] kept by the down projection is rebuilt from the up projection's output
        with recompute_scope():
            gate_up_out = grouped_mm(
                dispatched_input, self.gate_up_proj, tokens_per_expert, backend=self.backend
            )
            h = clamped_swiglu(gate_up_out, self.limit, permuted_probs)  # [M, F]
            discard(h, lambda: clamped_swiglu(gate_up_out, self.limit, permuted_probs))
            out = grouped_mm(h, self.down_proj, tokens_per_expert, backend=self.backend)  # [M, H]
        return out, None

    def _takes_routed_path(self, x: torch.Tensor) -> bool:
        """Decoding: eval mode, no grad, CUDA, a supported dtype, ``0 < M <= routed_max_rows``."""
        return (
            not self.training
            and not torch.is_grad_enabled()
            and x.is_cuda
            and x.dtype in ROUTED_DTYPES
            and self.gate_up_proj.dtype == x.dtype
            and 0 < x.shape[0] <= self.routed_max_rows
        )

    def backward_dw(self) -> None:
        """Weight gradients are computed in the ordinary backward (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Expert weights sharded along the expert axis over EP, replicated over the expert-data-parallel group."""
        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        ep_size = self.ep_group.size() if self.ep_group is not None else 1
        dp_rank = self.expt_dp_group.rank() if self.expt_dp_group is not None else 0
        n = len(sharded_offsets)
        out = {}
        for pname in ("gate_up_proj", "down_proj"):
            out[f"{prefix}{pname}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{pname}",
                getattr(self, pname),
                *sharded_offsets,
                (n, ep_rank, ep_size),
                replica_id=(0, 0, dp_rank),
                prepend_axis_num=n,
            )
        return out


class ClampedSwiGLUSharedExpert(MegatronModule):
    """The always-on shared expert with clamped SwiGLU (fp32 activation); TP column/row parallel linears.

    ``linear_gate`` (w1) and ``linear_up`` (w3) are column-parallel ``H -> F`` and ``linear_down`` (w2) is
    row-parallel ``F -> H``, so tensor parallelism shards the gate and up halves consistently.
    """

    def __init__(
        self,
        *,
        config: TransformerConfig,
        pg_collection: ProcessGroupCollection | None = None,
        gate: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(config=config)
        if gate:
            raise ValueError(
                "DSv4's shared expert has no sigmoid gate; set TransformerConfig.moe_shared_expert_gate=False"
            )
        if config.moe_shared_expert_intermediate_size is None:
            raise ValueError(
                "set TransformerConfig.moe_shared_expert_intermediate_size (the shared expert width)"
            )
        if config.add_bias_linear:
            raise ValueError("DSv4 experts have no biases; set TransformerConfig.add_bias_linear=False")
        check_swiglu_limit(config.activation_func_clamp_value)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        self.limit = config.activation_func_clamp_value
        self.recompute_activation = recompute_config_of(config).selects("moe_act")
        h, f = config.hidden_size, config.moe_shared_expert_intermediate_size
        common = {"config": config, "bias": False, "tp_group": pg_collection.tp, "is_expert": False}
        self.linear_gate = ColumnParallelLinear(
            h, f, init_method=config.init_method, gather_output=False, skip_bias_add=True, **common
        )
        self.linear_up = ColumnParallelLinear(
            h, f, init_method=config.init_method, gather_output=False, skip_bias_add=True, **common
        )
        self.linear_down = RowParallelLinear(
            f,
            h,
            init_method=config.output_layer_init_method,
            input_is_parallel=True,
            skip_bias_add=True,
            **common,
        )

    def forward(self, hidden_states: torch.Tensor, /) -> torch.Tensor:
        """``[S, B, H] -> [S, B, H]``."""
        a, _ = self.linear_gate(hidden_states)  # [S, B, F/tp]
        b, _ = self.linear_up(hidden_states)
        gate_up = torch.cat([a, b], dim=-1)
        if not (self.recompute_activation and torch.is_grad_enabled()):
            out, _ = self.linear_down(clamped_swiglu(gate_up, self.limit))
            return out
        with recompute_scope():  # moe_act: the activation kept by linear_down is rebuilt from gate_up
            h = clamped_swiglu(gate_up, self.limit)
            discard(h, lambda: clamped_swiglu(gate_up, self.limit))
            out, _ = self.linear_down(h)
        return out

    def backward_dw(self) -> None:
        """Weight gradients are computed in the ordinary backward (no delayed wgrad)."""
