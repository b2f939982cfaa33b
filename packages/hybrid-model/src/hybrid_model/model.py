"""``DSv4Model``: megatron-core 0.19.2 ``HybridModel`` with DSv4 layers, mHC streams, hash MoE and DSv4 MTP.

Dataflow (spec §1.1, §8)::

    e = Embed(ids)                         [s, b, d]      first stage
    X = DSv4HybridStack(e, ids)            [s, b, n·d]    streams between stages (pipeline transport: mhc P3)
    h = RMSNorm(HyperHead(X))              [s, b, d]      last stage
    logits = h @ head.T                    [b, s, V]      (without labels)
    loss_t = lse(h_t head^T) - (h_t head^T)[y_t]  [b, s]  (with labels: dsv4-primitives' linear_cross_entropy,
                                                           the [s, b, V] logits never materialised)
    MTP (last stage): depth k = DSv4MultiTokenPrediction(X_{k-1}, Embed(ids rolled left k)) -> shared head ->
                      loss on t+k+1; weight ``mtp_loss_weight / D`` per depth (D depths), attached to h with
                      megatron's ``MTPLossAutoScaler``

Construction goes through ``HybridModel.__init__`` (embedding, pipeline segment selection, decoder from the stack
spec, output layer); the main pattern (``|`` cuts included, MTP part removed) is what megatron parses, after
:func:`~hybrid_model.symbols.register_dsv4_symbols`. The MTP depth is ours (megatron's MTP block has no mHC), and
its embedding copy on the last pipeline stage is kept in sync by megatron's ``mtp_process`` embedding group logic.

Per-step training state (dense / sparse attention phase, MTP loss weight) goes through
:meth:`DSv4Model.set_step_state`, never by writing the shared megatron config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from dsv4_attention.megatron import DSv4HybridAttention
from dsv4_primitives import linear_cross_entropy, vocab_parallel_cross_entropy
from dsv4_primitives.cp_partial_loss import cp_partial_mean, partial_loss_gradient_scale
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.context_parallel import context_parallel_group
from hybrid_model.mtp import (
    DSv4MultiTokenPrediction,
    mtp_full_recompute,
    mtp_roll_left,
    router_cu_seqlens,
    run_mtp_depth,
)
from hybrid_model.spec import dsv4_stack_spec, dsv4_stack_submodules, mhc_config, transformer_config
from hybrid_model.symbols import PIPE, register_dsv4_symbols
from hybrid_model.tensor_parallel import (
    check_tensor_parallel_pattern,
    mark_sequence_parallel_parameters,
    sequence_shard,
)


@dataclass(frozen=True)
class StepState:
    """The host-side values a training step runs with (a CUDA-graph capture bakes them in: recapture on change).

    Attributes:
        dense_attention: dense phase (CSA layers attend every visible compressed entry) instead of the sparse one.
        mtp_loss_weight: the MTP loss weight (spec §8: 0.3, then 0.1).
    """

    dense_attention: bool
    mtp_loss_weight: float


class DSv4Model(HybridModel):
    """DeepSeek-V4 language model on megatron-core's ``HybridModel``.

    Args:
        model_config: the architecture (:class:`DSv4ModelConfig`).
        config: the megatron config (:func:`hybrid_model.spec.transformer_config`).
        stack_spec: decoder spec (default :func:`hybrid_model.spec.dsv4_stack_spec`).
        pre_process / post_process: pipeline-stage flags; pg_collection: explicit process groups.
        fused_linear_cross_entropy: the losses of both heads (main and MTP) through dsv4-primitives'
            ``linear_cross_entropy`` (vocab-chunked head GEMM + cross entropy; no ``[s, b, V]`` logits or fp32
            copies); ``False``: the output layer's logits, then :meth:`compute_language_model_loss`. Logits are
            returned whenever no labels are given either way.
    """

    def __init__(
        self,
        model_config: DSv4ModelConfig,
        config,
        stack_spec=None,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        backend=None,
        fused_linear_cross_entropy: bool = True,
    ) -> None:

        register_dsv4_symbols()
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        parsed = model_config.parsed_pattern
        tp_size = pg_collection.tp.size() if getattr(pg_collection, "tp", None) is not None else 1
        if tp_size != config.tensor_model_parallel_size:
            raise ValueError(
                f"the tensor-parallel group has {tp_size} ranks but config.tensor_model_parallel_size is "
                f"{config.tensor_model_parallel_size}: build the config with tensor_model_parallel_size={tp_size}"
            )
        check_tensor_parallel_pattern(parsed.all_symbols, tp_size)
        pp_size = pg_collection.pp.size() if getattr(pg_collection, "pp", None) is not None else 1
        stages = pp_size * (config.virtual_pipeline_model_parallel_size or 1)
        if len(parsed.segments) > 1 and len(parsed.segments) != stages:
            raise ValueError(
                f"pattern {parsed.pattern!r} has {len(parsed.segments)} '|'-separated pipeline segments but the model "
                f"runs on {stages} pipeline stage(s) (PP x VPP): give one segment per stage"
            )
        if stack_spec is None:
            stack_spec = dsv4_stack_spec(model_config, backend)(config)
        elif callable(stack_spec) and not hasattr(stack_spec, "submodules"):
            stack_spec = stack_spec(config)
        self._deferring_embedding_setup = True
        super().__init__(
            config=config,
            hybrid_stack_spec=stack_spec,
            vocab_size=model_config.vocab_size,
            max_sequence_length=model_config.max_position_embeddings,
            hybrid_layer_pattern=PIPE.join(parsed.segments),
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type="none",
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        self.model_config = model_config
        self.fused_linear_cross_entropy = bool(fused_linear_cross_entropy)
        self.mtp_process = bool(post_process and parsed.mtp_num_depths)
        if self.mtp_process:
            if not hasattr(self, "embedding"):
                self.embedding = LanguageModelEmbedding(
                    config=config,
                    vocab_size=model_config.vocab_size,
                    max_sequence_length=model_config.max_position_embeddings,
                    position_embedding_type="none",
                    tp_group=self.pg_collection.tp,
                )
            subs = dsv4_stack_submodules(model_config, backend, is_mtp=True)
            self.mtp = DSv4MultiTokenPrediction(
                config,
                subs,
                mhc_config(model_config),
                self.pg_collection,
                pattern=parsed.mtp_pattern,
                num_depths=parsed.mtp_num_depths,
                enable_mhc=model_config.enable_mhc_connections,
            )
        self._deferring_embedding_setup = False
        self.setup_embeddings_and_output_layer()
        # under sequence parallelism every replicated parameter sees this rank's tokens only: its gradient is summed
        # over the TP group by megatron's finalize_model_grads (hybrid_model.tensor_parallel)
        mark_sequence_parallel_parameters(self, config.sequence_parallel)
        self.last_mtp_loss: torch.Tensor | None = None  # mean over the depths of the last training forward
        self.last_mtp_losses: list[
            torch.Tensor
        ] = []  # one per depth (metrics ``mtp_loss_1``, ``mtp_loss_2``, ...)
        self._step_state = StepState(
            bool(getattr(config, "csa_dense_mode", False)), float(config.mtp_loss_scaling_factor or 0.0)
        )
        self.set_step_state()

    # ------------------------------------------------------------------ per-step state
    @property
    def step_state(self) -> StepState:
        """The current :class:`StepState` (hashable: the trainer's CUDA-graph capture key)."""
        return self._step_state

    def set_step_state(
        self, *, dense_attention: bool | None = None, mtp_loss_weight: float | None = None
    ) -> None:
        """Set the phase of every DSv4 attention layer of this model chunk and the MTP loss weight for the next
        forwards (``None`` keeps a value). The megatron config is not touched."""

        new = StepState(
            self._step_state.dense_attention if dense_attention is None else bool(dense_attention),
            self._step_state.mtp_loss_weight if mtp_loss_weight is None else float(mtp_loss_weight),
        )
        if not (new.mtp_loss_weight >= 0 and new.mtp_loss_weight != float("inf")):
            raise ValueError(f"mtp_loss_weight must be a finite number >= 0, got {new.mtp_loss_weight}")
        for module in self.modules():
            if isinstance(module, DSv4HybridAttention):
                module.set_dense_attention(new.dense_attention)
        self._step_state = new

    # megatron's HybridModel.__init__ calls this before our MTP embedding exists: run it once, at the end
    def setup_embeddings_and_output_layer(self) -> None:
        if getattr(self, "_deferring_embedding_setup", False):
            return
        super().setup_embeddings_and_output_layer()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context=None,
        runtime_gather_output: bool | None = None,
        *,
        loss_mask: torch.Tensor | None = None,
        packed_seq_params=None,
        padding_mask: torch.Tensor | None = None,
        **_unused,
    ):
        """``input_ids [b, s]`` (THD: ``[1, T]`` + ``packed_seq_params``) -> per-token loss ``[b, s]`` with labels,
        logits ``[b, s, V]`` without (last stage), or the streams ``[s, b, n·d]`` (other stages)."""
        if attention_mask is not None:
            raise ValueError("DSv4Model is causal by construction: pass attention_mask=None")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, d]
        cp = self.context_parallel_group
        if cp is not None and packed_seq_params is None:
            raise ValueError(
                f"context parallelism (CP size {cp.size()}) needs a THD pack: pass this CP rank's rows [1, L] and "
                "the global packed_seq_params ([B, S] batches run under CP as a THD pack of B documents of S tokens: "
                "dsv4_train.context_parallel.sbhd_as_thd_pack)"
            )
        if padding_mask is not None:  # [b, s] -> this rank's [b, s/tp] under SP (the layers' token rows)
            padding_mask = sequence_shard(padding_mask, self.sequence_parallel_group)
        router_cu = None
        if input_ids is not None:
            # the hash routers see this rank's sequence shard of the ids (SP cuts the activations the same way)
            router_ids = sequence_shard(input_ids, self.sequence_parallel_group)
            router_cu = router_cu_seqlens(packed_seq_params, router_ids.shape[-1], self.sequence_rows_group)
            self.decoder.bind_input_ids(router_ids, router_cu)
        try:
            out = self.decoder(
                hidden_states=decoder_input,
                attention_mask=None,
                packed_seq_params=packed_seq_params,
                padding_mask=padding_mask,
            )
        finally:
            self.decoder.bind_input_ids(None)
        if not self.post_process:
            return out
        hidden, streams = out if isinstance(out, tuple) else (out, None)
        if self.mtp_process and labels is not None:  # eval mode too (evaluation's MTP loss; no gradient then)
            hidden = self._attach_mtp_loss(
                hidden,
                streams,
                input_ids,
                position_ids,
                labels,
                loss_mask,
                packed_seq_params,
                padding_mask,
                router_cu,
            )
        if labels is not None and self._fused_head():
            return self.head_loss(hidden, labels, loss_mask)  # [b, s]
        logits, _ = self.output_layer(hidden, runtime_gather_output=runtime_gather_output)  # [s, b, V]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V]
        return self.compute_language_model_loss(labels, logits)  # [b, s]

    def mtp_logits(
        self, streams, input_ids, position_ids=None, packed_seq_params=None, padding_mask=None, router_cu=None
    ):
        """Depth-1 MTP logits ``[s, b, V]`` from the main streams (position ``t`` predicts token ``t+2``). ``router_cu``:
        the pack's :func:`~hybrid_model.mtp.router_cu_seqlens` when the caller already has them."""
        h = self.mtp_hidden(streams, input_ids, position_ids, packed_seq_params, padding_mask, router_cu)[0]
        logits, _ = self.output_layer(h)
        return logits

    def mtp_hidden(
        self, streams, input_ids, position_ids=None, packed_seq_params=None, padding_mask=None, router_cu=None
    ) -> list[torch.Tensor]:
        """Every MTP depth's final hidden states ``[s, b, d]`` (the shared head's input), depth 1 first. Depth ``k``
        embeds the ids rolled left ``k`` times (0 past each document's end) and reads depth ``k - 1``'s streams."""

        cp = self.context_parallel_group
        if router_cu is None:
            rows = sequence_shard(input_ids, self.sequence_parallel_group).shape[-1]
            router_cu = router_cu_seqlens(packed_seq_params, rows, self.sequence_rows_group)

        out, ids = [], input_ids
        recompute = self.training and mtp_full_recompute(self.config, len(self.decoder.layers))
        for depth in self.mtp.depths():
            ids = mtp_roll_left(ids, packed_seq_params, cp)  # token t+k at t (CP: across rank edges)
            h, streams = run_mtp_depth(
                depth,
                self.embedding,
                streams,
                ids,
                position_ids,
                router_cu,
                recompute=recompute,
                sequence_parallel_group=self.sequence_parallel_group,
                attention_mask=None,
                packed_seq_params=packed_seq_params,
                padding_mask=padding_mask,
            )  # [s, b, d], [s, b, n, d] (None after the last depth)
            out.append(h)
        return out

    def _attach_mtp_loss(
        self, hidden, streams, input_ids, position_ids, labels, loss_mask, psp, padding_mask, router_cu
    ):

        cp = self.context_parallel_group
        hs = self.mtp_hidden(streams, input_ids, position_ids, psp, padding_mask, router_cu)  # D x [s, b, d]
        mtp_labels = labels
        mask = torch.ones_like(labels, dtype=torch.float) if loss_mask is None else loss_mask.float()
        losses = []
        for h in hs:
            mtp_labels = mtp_roll_left(mtp_labels, psp, cp)  # depth k: labels[t] = ids[t+1] -> ids[t+1+k]
            mask = mtp_roll_left(mask, psp, cp)  # a document's last k positions have no target
            if self._fused_head():
                per_token = self.head_loss(h, mtp_labels, mask)  # [b, s]
            else:
                logits, _ = self.output_layer(h)  # [s, b, V]
                per_token = self.compute_language_model_loss(mtp_labels, logits)  # [b, s]
            losses.append(cp_partial_mean(per_token, mask, cp))  # under CP this rank's partial
        self.last_mtp_losses = [x.detach() for x in losses]
        self.last_mtp_loss = torch.stack(self.last_mtp_losses).mean()
        # megatron's scaling: mtp_loss_scaling_factor / mtp_num_layers per depth; its schedule does not scale the
        # MTP loss by the CP size as it does the main and MoE losses, so the partial's gradient scale is applied here
        scale = self._step_state.mtp_loss_weight / len(losses) * partial_loss_gradient_scale(cp)
        return MTPLossAutoScaler.apply(hidden, scale * torch.stack(losses).sum())

    @property
    def context_parallel_group(self):
        """The context-parallel group (``pg_collection.cp``) when its size is > 1, else ``None``. Under CP every
        forward takes this rank's contiguous rows ``[1, L]`` of a THD pack and the *global* ``packed_seq_params``;
        ``last_mtp_loss`` is then this rank's partial (:mod:`dsv4_primitives.cp_partial_loss`)."""

        return context_parallel_group(self.pg_collection)

    @property
    def sequence_parallel_group(self):
        """The tensor-parallel group when the model runs sequence parallelism (activations ``[s/tp, b, ·]``), else
        ``None``."""
        return self.pg_collection.tp if self.config.sequence_parallel else None

    @property
    def sequence_rows_group(self):
        """The ranks that hold consecutive row slices of one THD pack, when more than one does: TP x CP under
        sequence parallelism (megatron's ``pg_collection.tp_cp``, rank ``c*TP + t`` holding rows
        ``[(c*TP + t)*L, (c*TP + t + 1)*L)``: CP's contiguous chunk ``c`` cut by SP), else CP; ``None`` otherwise.
        The routers' per-document statistics are summed over it."""
        pg = self.pg_collection
        group = getattr(pg, "tp_cp", None) if self.config.sequence_parallel else getattr(pg, "cp", None)
        return group if group is not None and group.size() > 1 else None

    def _fused_head(self) -> bool:
        """Whether losses go through :meth:`head_loss` (else the output layer's logits and
        :meth:`compute_language_model_loss`)."""
        return self.fused_linear_cross_entropy

    def head_loss(
        self, hidden: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` of the shared output head on ``hidden [s, b, d]`` against ``labels
        [b, s]``, fused: dsv4-primitives' ``linear_cross_entropy`` walks this rank's vocabulary shard of the head
        weight ``[V/tp, d]`` in chunks (bf16 GEMMs with fp32 accumulation, the fused cross-entropy kernels,
        vocab-parallel reductions over the tensor-parallel group). Under autograd it runs its gradient-in-forward
        mode (3 head GEMMs, both gradients formed in the forward), declaring ``loss_mask [b, s]`` (``None``: all
        ones) as the per-token gradient weights: the caller must reduce the returned loss with that mask up to one
        scalar, as :func:`~dsv4_primitives.cp_partial_loss.cp_partial_mean` does for the LM and MTP losses (another
        reduction is still exact eagerly, through a recompute backward, and NaN under CUDA-graph capture). Same
        values as the output layer + :meth:`compute_language_model_loss` up to the rounding of the chunked GEMMs.
        Under sequence parallelism ``hidden`` is this rank's ``[s/tp, b, d]``: it is gathered first (the loss's
        backward already sums the hidden gradient over TP, so the gather's backward only keeps this rank's
        rows)."""

        tp = self.pg_collection.tp
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=tp)
        loss = linear_cross_entropy(
            hidden,
            self.output_layer.weight,
            labels.transpose(0, 1),  # [s, b]
            tp_group=tp if tp is not None and tp.size() > 1 else None,
            grad_weight=None
            if loss_mask is None
            else loss_mask.reshape(labels.shape).transpose(0, 1).float(),
        )  # [s, b] fp32
        return loss.transpose(0, 1).contiguous()  # [b, s]

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` of ``logits [s, b, V/tp]`` (this rank's vocabulary shard).

        With ``config.cross_entropy_loss_fusion`` (our default) dsv4-primitives' fused vocab-parallel cross entropy:
        one read of the logits for the row statistics (max, sum of exponentials, target logit; combined over the
        tensor-parallel group), and a backward that writes the logits gradient into the logits buffer (the logits are
        not read again after the loss). Otherwise megatron-core's unfused fp32 path. Same values either way.
        """
        if not self.config.cross_entropy_loss_fusion:
            return super().compute_language_model_loss(labels, logits)

        tp = self.pg_collection.tp
        loss = vocab_parallel_cross_entropy(
            logits,
            labels.transpose(0, 1),  # [s, b]
            tp_group=tp if tp is not None and tp.size() > 1 else None,
            inplace_backward=logits.requires_grad,
        )  # [s, b] fp32
        return loss.transpose(0, 1).contiguous()  # [b, s]

    @torch.no_grad()
    def compute_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Main-head logits ``[B, T, V]`` of ``input_ids [B, T]`` (single pipeline stage, eval mode)."""
        if not (self.pre_process and self.post_process):
            raise ValueError("compute_logits needs the whole model on one pipeline stage")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        was_training = self.training
        self.eval()
        try:
            b, t = input_ids.shape
            pos = torch.arange(t, device=input_ids.device)[None].expand(b, t)
            return self.forward(input_ids, pos, None).float()
        finally:
            self.train(was_training)


def build_model(
    model_config: DSv4ModelConfig,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    pg_collection: ProcessGroupCollection | None = None,
    backend=None,
    fused_linear_cross_entropy: bool = True,
    vp_stage: int | None = None,
    **config_kwargs,
) -> DSv4Model:
    """Build a :class:`DSv4Model` (megatron parallel state must be initialised); ``config_kwargs`` go to
    :func:`hybrid_model.spec.transformer_config`; ``vp_stage``: the virtual pipeline chunk (with
    ``virtual_pipeline_model_parallel_size`` in ``config_kwargs``)."""

    tc = transformer_config(model_config, **config_kwargs)
    return DSv4Model(
        model_config,
        tc,
        pre_process=pre_process,
        post_process=post_process,
        pg_collection=pg_collection,
        backend=backend,
        fused_linear_cross_entropy=fused_linear_cross_entropy,
        vp_stage=vp_stage,
    )
