"""One optimizer step of ``dsv4 train``: the forward step megatron's schedule calls per micro-batch, the
forward-backward schedule (eager or replayed as a CUDA graph), the optimizer and scheduler step, the selection-bias
update and the loss reduction over the ranks."""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from dsv4_attention import get_indexer_loss_tracker
from dsv4_primitives.cp_partial_loss import cp_partial_mean, sum_partials
from dsv4_primitives.megatron import cuda_as_cpu, release_autograd_graphs
from dsv4_train.activation_offload import ActivationOffload
from dsv4_train.config import TrainConfig
from dsv4_train.context_parallel import local_batch
from dsv4_train.cuda_graph import BATCH_FIELDS, GraphedForwardBackward, static_batch
from dsv4_train.graph_data_parallel import (
    GradReductionAfterSchedule,
    check_no_sync_in_backward,
    data_parallel_size,
)
from dsv4_train.graph_packs import static_packed_seq_params
from dsv4_train.offload_defer import DeferredHostStep
from dsv4_train.virtual_pipeline import check_vpp_microbatches, ddp_chunks
from hash_moe.megatron import release_forward_state, update_selection_biases
from hybrid_model.latent_attention import drain_dsa_indexer_losses
from mhc.megatron import make_mhc_adjust_tensor_shapes_fn, mhc_folded_seq_length

LOSS_KEYS = ("lm_loss", "mtp_loss", "balance_loss", "indexer_loss")


def loss_keys(mtp_num_depths: int) -> tuple[str, ...]:
    """The step's loss metrics: :data:`LOSS_KEYS`, plus ``mtp_loss_1 … mtp_loss_D`` with ``D > 1`` MTP depths
    (``mtp_loss`` is their mean)."""
    return LOSS_KEYS + (
        tuple(f"mtp_loss_{k}" for k in range(1, mtp_num_depths + 1)) if mtp_num_depths > 1 else ()
    )


class TrainingDiverged(RuntimeError):
    """The run produced non-finite losses / gradients ``max_nonfinite_steps`` times in a row, or non-finite weights
    were about to be saved (``dsv4 train`` exits 1 with this message)."""


def grads_finite_local(model) -> bool:
    """Whether this rank's gradient buffers of the DDP ``model`` (or its VPP chunks) hold only finite values (one reduction per buffer:
    a NaN or an infinity anywhere makes its fp32 sum non-finite)."""

    sums = [
        b.grad_data.sum(dtype=torch.float32)
        for chunk in ddp_chunks(model)
        for b in chunk.buffers + chunk.expert_parallel_buffers
    ]
    return bool(torch.isfinite(torch.stack(sums)).all()) if sums else True


def discard_router_loads(core) -> None:
    """Zero the routers' per-expert token loads of a skipped step (the selection biases are not updated from it)."""
    for module in core.modules():
        loads = getattr(module, "local_tokens_per_expert", None)
        if isinstance(loads, torch.Tensor):
            loads.zero_()


class StepRunner:
    """Runs training steps of one rank. ``model_config``: the :class:`~hybrid_model.config.DSv4ModelConfig`; ``core``: the unwrapped DSv4 model; ``model``: the DDP-wrapped one;
    ``config``: their megatron config. The caller sets the per-step state (attention phase, MTP weight) with
    ``core.set_step_state`` before each step."""

    def __init__(
        self,
        tc: TrainConfig,
        model_config,
        *,
        core,
        model,
        config,
        optimizer,
        scheduler,
        ps,
        device,
        world: int,
    ) -> None:
        self.tc, self.model_config = tc, model_config
        # --optimizer-offload-defer: the host AdamW of a step runs behind the next forward (dsv4_train.offload_defer)
        self.deferred = (
            DeferredHostStep(optimizer, ddp_chunks(model)) if tc.optimizer.optimizer_offload_defer else None
        )
        self.core, self.model, self.config = core, model, config
        self.optimizer, self.scheduler, self.ps, self.device, self.world = (
            optimizer,
            scheduler,
            ps,
            device,
            world,
        )
        self.graphed = None  # GraphedForwardBackward once the first --cuda-graph step runs
        self.lowest_lm_loss: float | None = (
            None  # the lowest finite LM loss of this process (loss explosions)
        )
        # --cuda-graph with DP > 1: the DP gradient reduction runs eagerly after the (captured) schedule
        self.grad_reduction = None
        if tc.graphs.cuda_graph and data_parallel_size(ps) > 1:
            check_no_sync_in_backward(ddp_chunks(model))
            dp_group = ps.get_data_parallel_group(with_context_parallel=True)
            self.grad_reduction = GradReductionAfterSchedule(config, dp_group, device)
        self.max_docs_per_pack: int | None = None  # --cuda-graph --packed: set by the Trainer (data capacity)
        # --offload-activations: what each micro-batch's forward saves for backward lives on the host
        self.activation_offload = (
            ActivationOffload(ddp_chunks(model)) if tc.memory.offload_activations else None
        )
        cp = core.context_parallel_group
        self.cp_group = cp
        self.cp_size, self.cp_rank = (1, 0) if cp is None else (cp.size(), cp.rank())
        # the routers' balance-loss partials cover this rank's tokens: its sequence shard under TP (sequence
        # parallelism) and its rows under CP, so they are summed over the TP x CP group (DSv4 attention's
        # indexer-loss partials likewise)
        tp_cp = ps.get_tensor_and_context_parallel_group()
        self.balance_group = tp_cp if tp_cp.size() > 1 else None

    def forward_step(self, data_iterator, model):
        """megatron's ``forward_step_func``: one micro-batch through ``model``; returns its output and loss function."""
        mb = next(data_iterator)
        unwrapped = self.core
        if isinstance(mb, dict):  # --cuda-graph: the static device buffers of a micro-batch
            psp = static_packed_seq_params(mb) if "cu_seqlens" in mb else None  # --packed: device-side bounds
            tokens, labels, loss_mask, pos, pad = (mb[k] for k in BATCH_FIELDS)
        else:
            lb = self.local_batch(mb)
            psp = lb.packed_seq_params
            tokens, labels, loss_mask = lb.tokens, lb.labels, lb.loss_mask
            pos, pad = lb.position_ids, lb.padding_mask  # pad: True on padding rows
        # padding rows never count in the MoE balance loss or the selection-bias loads (spec §7.5: valid tokens)
        offload = self.activation_offload
        with offload.hooks() if offload is not None else contextlib.nullcontext():
            out = model(
                tokens, pos, None, labels=labels, loss_mask=loss_mask, packed_seq_params=psp, padding_mask=pad
            )
        if self.deferred is not None:  # the grad buffers are zeroed behind the deferred step's D2H copies
            self.deferred.before_backward()

        cp_group = unwrapped.context_parallel_group

        def loss_func(output):

            loss = cp_partial_mean(output, loss_mask.float(), cp_group)  # under CP this rank's partial
            report = {"lm loss": loss.detach().clone()}  # megatron divides the returned loss in place
            if unwrapped.mtp_process and unwrapped.last_mtp_loss is not None:
                report["mtp loss"] = unwrapped.last_mtp_loss
                if len(unwrapped.last_mtp_losses) > 1:
                    for k, value in enumerate(unwrapped.last_mtp_losses, start=1):
                        report[f"mtp loss {k}"] = value
            return loss, report

        return out, loss_func

    def local_batch(self, mb):
        """Micro-batch ``mb`` as this rank feeds it to the model (its CP rows; ``[B, S]`` as a THD pack under CP/TP; see
        :func:`~dsv4_train.context_parallel.local_batch`)."""

        return local_batch(
            mb,
            packed=self.tc.data.packed,
            cp_rank=self.cp_rank,
            cp_size=self.cp_size,
            device=self.device,
            tp_size=self.tc.parallel.tp,
        )

    def schedule(self, batch, forward_step_func, *, forward_only: bool) -> dict:
        """The keyword arguments of megatron's forward-backward function for ``batch`` (training and evaluation
        alike): the micro-batch shape the schedule sizes its p2p buffers with, one data iterator per VPP chunk, the
        mHC stream-shape hook of the 1F1B schedule."""

        tc = self.tc
        chunks = ddp_chunks(self.model)
        kwargs = {}
        seq = (
            tc.data.seq_len
        )  # THD packs are padded to the static capacity seq_len (megatron divides it by CP)
        mbs = 1 if tc.data.packed else tc.data.micro_batch_size
        if not tc.data.packed and (
            self.cp_size > 1 or tc.parallel.tp > 1
        ):  # [B, S] under CP/TP: one THD pack
            seq, mbs = tc.data.micro_batch_size * tc.data.seq_len, 1
        data_iterator = iter(batch.microbatches)
        if tc.parallel.vpp > 1:
            # interleaved schedule: no shape hook; the mHC streams travel folded as [s*n, b, d] (mhc P3), and
            # every chunk reads every micro-batch (token ids and positions on every stage; labels on the last)

            check_vpp_microbatches(batch.num_microbatches, tc.parallel.pp)
            seq = mhc_folded_seq_length(seq, self.model_config.num_streams)
            data_iterator = [iter(batch.microbatches) for _ in chunks]
        elif tc.parallel.pp > 1:
            kwargs["adjust_tensor_shapes_fn"] = make_mhc_adjust_tensor_shapes_fn(
                self.model_config.num_streams
            )
        return dict(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=chunks,
            num_microbatches=batch.num_microbatches,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=forward_only,
            **kwargs,
        )

    def __call__(self, batch, step: int) -> dict:
        """Train on ``batch`` (one global batch's share of this rank) as optimizer step ``step`` (0-based); returns
        the step's metrics (``step`` is 1-based there)."""

        tc = self.tc
        if self.deferred is not None:  # behind the previous step's D2H copies (dsv4_train.offload_defer)
            self.deferred.zero_grad_buffers(ddp_chunks(self.model))
        else:
            for chunk in ddp_chunks(self.model):
                chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        fb = get_forward_backward_func()
        schedule = self.schedule(batch, self.forward_step, forward_only=False)
        if tc.graphs.cuda_graph:
            if self.graphed is None:
                self.graphed = GraphedForwardBackward(fb, tc.graphs.cuda_graph_warmup_steps)
            max_docs = self.max_docs_per_pack if tc.data.packed else None
            schedule["data_iterator"] = iter(
                [static_batch(mb, max_docs=max_docs, step=step) for mb in batch.microbatches]
            )
            # host-side values baked into the captured step: a change recaptures (packed: the micro-batch count too)
            key = (self.core.step_state, batch.num_microbatches) if tc.data.packed else self.core.step_state
            fb = functools.partial(self.graphed, key=key)
        if self.grad_reduction is not None:
            fb = functools.partial(self.grad_reduction, fb)
        with cuda_as_cpu():  # CPU: the schedules' and optimizer's device="cuda" bookkeeping tensors
            reports = fb(**schedule)
        # a non-finite loss or gradient on any rank skips the update on every rank (checked before the optimizer
        # step: a finite gradient has a finite norm, so clipping cannot turn it into NaN updates)
        losses, nonfinite_ranks = self.reduced_losses(
            reports, batch.num_microbatches, nonfinite_grads=not grads_finite_local(self.model)
        )
        finite = nonfinite_ranks == 0 and all(math.isfinite(v) for v in losses.values())
        exploded = finite and self.loss_exploded(losses.get("lm_loss"))
        finite = finite and not exploded
        ok, grad_norm = False, None
        if finite:
            with cuda_as_cpu():
                ok, grad_norm, _ = self.optimizer.step()
            if (
                self.deferred is not None
            ):  # the host AdamW starts; the next forward waits for it module by module
                self.deferred.launch()
            # the loads of every rank that routed other tokens: DP, CP and TP (sequence-parallel shards)
            update_selection_biases(
                self.core, group=self.ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
            )
        else:
            discard_router_loads(self.core)
        applied_lr = self.optimizer.param_groups[0]["lr"]  # the rate this step's update used (or would have)
        self.scheduler.step(increment=1)  # a skipped step keeps its place in the LR schedule
        m: dict = {"step": step + 1, "grad_norm": float(grad_norm) if grad_norm is not None else None}
        m["lr"] = applied_lr
        if self.model_config.num_nextn_predict_layers:
            m["mtp_weight"] = self.core.step_state.mtp_loss_weight
        m.update(losses)
        m["nonfinite"] = not (finite or exploded) or (
            grad_norm is not None and not math.isfinite(m["grad_norm"])
        )
        m["exploded"] = exploded
        m["skipped"] = not ok
        if self.graphed is not None:
            m["cuda_graph_replayed"] = self.graphed.captured
        # nothing sequence-sized survives the step: megatron's token dispatchers keep the last forward's routing
        # probabilities with their autograd graph, which (under full recompute) reaches the recomputed layers'
        # detached inputs and their gradients, the fp32 mHC streams [S, B, n*d]: issue 33 measured 0.63 GiB per
        # 1K tokens held between steps. The backward is done, so no graph is needed any more.
        # The integer routing state of the MoE layers (bound token ids, routing maps, permutations: ~1 KiB per token
        # of the tiny model on the GPU) is sequence-sized too; a graphed step keeps it (the graph reads it).
        for chunk in ddp_chunks(self.model):
            release_autograd_graphs(chunk)
            if self.graphed is None:
                release_forward_state(chunk)
        return m

    def loss_exploded(self, lm_loss: float | None) -> bool:
        """Whether ``lm_loss`` (finite, the same on every rank) is more than ``--max-loss-growth`` times the lowest
        LM loss of this process so far (a diverging run with finite numbers); records the lowest otherwise."""
        growth = self.tc.schedule.max_loss_growth
        if lm_loss is None:
            return False
        if growth and self.lowest_lm_loss is not None and lm_loss > growth * max(self.lowest_lm_loss, 1e-6):
            return True
        self.lowest_lm_loss = lm_loss if self.lowest_lm_loss is None else min(self.lowest_lm_loss, lm_loss)
        return False

    def reduced_losses(
        self, reports: list[dict], num_microbatches: int, *, nonfinite_grads: bool = False
    ) -> tuple[dict, int]:
        """The step's losses averaged over every rank that computed them: LM/MTP losses over the DP replicas of the
        last stage, balance/indexer losses over all MoE/CSA layers of all stages and replicas (one all-reduce of
        (sum, count) pairs over the world; each rank holds its own stage's layers and its own data); and the number
        of ranks whose gradients are not finite (``nonfinite_grads``, in the same all-reduce).

        Under CP every loss of a rank is its partial (:mod:`dsv4_primitives.cp_partial_loss`): the LM/MTP partials
        enter the world sums as they are with a count of ``1 / CP`` each, the per-layer balance and indexer partials
        are summed over the TP x CP group first (``sum_partials``, one small all-reduce: under TP each rank routes
        its sequence shard and runs the indexer loss of its rows), so every value is the global one, equal to
        CP=1's. Under TP every rank of a TP group holds the same LM/MTP losses (each counts once)."""
        keys = loss_keys(self.model_config.parsed_pattern.mtp_num_depths)
        local = torch.zeros(2 * len(keys) + 1, dtype=torch.float64, device=self.device)
        local[-1] = float(nonfinite_grads)

        def add(key: str, values: list[float], weight: float = 1.0) -> None:
            i = keys.index(key)
            local[2 * i] += sum(values)
            local[2 * i + 1] += len(values) * weight

        for key in ("lm loss", "mtp loss") + tuple(k.replace("_", " ") for k in keys[len(LOSS_KEYS) :]):
            add(key.replace(" ", "_"), [float(r[key]) for r in reports if key in r], 1.0 / self.cp_size)
        # per-layer trackers accumulate one value per micro-batch; layers of other stages stay 0

        moe_tracker = get_moe_metrics_tracker()
        entry = moe_tracker.metrics.get("seq_load_balancing_loss")
        if entry is not None:  # recorded as loss / coeff: report the applied (coefficient-scaled) loss
            values = sum_partials(entry.values, self.balance_group)
            vals = values[values != 0].double() * self.tc.loss.balance_loss_coeff / num_microbatches
            add("balance_loss", vals.tolist())
        moe_tracker.clear()
        tracker = get_indexer_loss_tracker()
        vals = getattr(tracker, "values", None)
        if isinstance(vals, torch.Tensor) and vals.numel():
            vals = sum_partials(vals, self.balance_group)  # DSv4 attention's partials: its rows under TP x CP
            add("indexer_loss", (vals[vals != 0].double() / num_microbatches).tolist())
            tracker.clean()

        dsa = drain_dsa_indexer_losses()  # megatron's DSA indexers ('D' layers; CP is refused for them)
        if dsa is not None:
            add("indexer_loss", (dsa[dsa != 0].double() / num_microbatches).tolist())
        if self.world > 1:
            dist.all_reduce(local)
        losses = {
            key: float(local[2 * i] / local[2 * i + 1]) for i, key in enumerate(keys) if local[2 * i + 1] > 0
        }
        return losses, int(local[-1])
