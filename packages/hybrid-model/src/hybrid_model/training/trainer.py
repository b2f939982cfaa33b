"""The training loop of ``dsv4 train`` on megatron-core: parallel state, DDP + distributed optimizer, the
forward-backward schedule, dist-checkpointing with exact resume, and the run's outputs.

One process (CPU or one GPU) or ``torchrun`` (gloo on CPU, NCCL on GPU) with ``--pp/--ep`` (DP is the rest).
Outputs in ``out``: ``metrics.jsonl`` (one JSON object per step), ``loss.png``, ``tb/`` (TensorBoard),
``checkpoints/iter_XXXXXXX`` (megatron dist checkpoints; ``latest`` names the newest).
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4_primitives.megatron_cpu import cuda_as_cpu
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.presets import get_preset
from hybrid_model.training.config import TrainConfig

DISTOPT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def _init_distributed() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, rank=rank, world_size=world)
        return rank, world
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=0, world_size=1)
    return 0, 1


def model_config_for(tc: TrainConfig) -> DSv4ModelConfig:
    cfg = get_preset(tc.preset)
    changes = dict(tc.model_overrides)
    if tc.pp > 1:
        changes.setdefault("pipeline_stages", tc.pp)
    return cfg.replace(**changes) if changes else cfg


class Trainer:
    """Builds everything from a :class:`TrainConfig`; :meth:`run` trains and returns the per-step metrics."""

    def __init__(self, tc: TrainConfig) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        from dsv4_primitives.megatron_cpu import apply_cpu_shims, init_rng_tracker

        self.tc = tc
        apply_cpu_shims()
        self.rank, self.world = _init_distributed()
        if self.world % (tc.pp * tc.tp):
            raise ValueError(f"world size {self.world} is not divisible by pp={tc.pp} x tp={tc.tp}")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tc.tp,
            pipeline_model_parallel_size=tc.pp,
            expert_model_parallel_size=tc.ep,
        )
        init_rng_tracker(tc.seed, cuda_graph_safe=tc.cuda_graph)
        _reset_metric_trackers()
        self.ps = ps
        self.pg = ProcessGroupCollection.use_mpu_process_groups()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.model_config = model_config_for(tc)
        self._previous_stream = None
        self._graphed = None
        if tc.cuda_graph:  # the model, its gradient hooks and every step live on the capture stream
            from hybrid_model.training.cuda_graph import use_capture_stream

            self._previous_stream = use_capture_stream()
        self.out = Path(tc.out)
        self.is_logger = self.rank == self.world - 1  # the last stage sees the loss
        self._stop = False
        self._build_model_and_optimizer()
        self._build_data()
        self.step = 0
        self.metrics: list[dict] = []

    # ------------------------------------------------------------------ construction
    def _build_model_and_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from dsv4_primitives.precision.megatron import get_megatron_optimizer_keep_fp32
        from hybrid_model.model import build_model

        tc, ps = self.tc, self.ps
        pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        torch.manual_seed(tc.seed)
        # bf16 as megatron's training loop does it: params (and the pipeline p2p buffers) in bf16, the model wrapped
        # in a Float16Module (bf16 first-stage inputs, fp32 last-stage outputs); the keep-in-fp32 tensors (mHC,
        # sinks, compressor ape, router selection bias) stay fp32. ``config.bf16`` alone makes the mHC layers cast
        # activations to bf16, which then meet fp32 weights ("expected mat1 and mat2 to have the same dtype").
        params_dtype = torch.bfloat16 if tc.bf16 else torch.float32
        with cuda_as_cpu():  # PP + MTP: megatron moves the last stage's embedding copy with .cuda()
            model = build_model(
                self.model_config,
                pre_process=pre,
                post_process=post,
                pg_collection=self.pg,
                pipeline_model_parallel_size=tc.pp,
                expert_model_parallel_size=tc.ep,
                balance_loss_coeff=tc.balance_loss_coeff,
                indexer_loss_coeff=tc.indexer_loss_coeff,
                bf16=tc.bf16,
                params_dtype=params_dtype,
            ).to(self.device)
        self.core = model  # the DSv4Model itself (under the Float16Module and DDP wrappers)
        self.config = model.config
        if tc.bf16:
            from dsv4_primitives.precision.megatron import Float16ModuleKeepFP32

            model = Float16ModuleKeepFP32(self.config, model)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
        )
        with cuda_as_cpu():
            self.model = DistributedDataParallel(self.config, ddp_config, model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=tc.lr,
            min_lr=tc.min_lr,
            weight_decay=tc.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            clip_grad=tc.clip_grad,
            use_distributed_optimizer=True,
            bf16=tc.bf16,
            params_dtype=params_dtype,
        )
        with cuda_as_cpu():
            # megatron 0.19.2's distributed optimizer on torch Adam loses the restored Adam ``step`` (overwritten
            # by the loading template, then shared by all params) — the primitives subclass fixes both
            self.optimizer = get_megatron_optimizer_keep_fp32(opt_config, [self.model])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=tc.lr,
            min_lr=tc.min_lr,
            lr_warmup_steps=min(tc.warmup_steps, tc.steps - 1),
            lr_decay_steps=max(tc.steps, 2),
            lr_decay_style="WSD" if tc.lr_decay_style == "wsd" else "cosine",
            wsd_decay_steps=tc.lr_wsd_decay_steps if tc.lr_decay_style == "wsd" else None,
            lr_wsd_decay_style="cosine" if tc.lr_decay_style == "wsd" else None,
            start_wd=tc.weight_decay,
            end_wd=tc.weight_decay,
            wd_incr_steps=tc.steps,
            wd_incr_style="constant",
        )
        from megatron.core.distributed import finalize_model_grads

        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = None
        self.config.no_sync_func = self.model.no_sync

    def _build_data(self) -> None:
        from thd_packing import (
            BatchConfig,
            PackedBatchIterator,
            RawTextDataset,
            TextDatasetConfig,
            default_corpus_dataset,
        )

        tc = self.tc
        if tc.data:
            ds = RawTextDataset.from_paths(tc.data, TextDatasetConfig(tc.seq_len), tc.tokenizer)
        else:
            ds = default_corpus_dataset(tc.seq_len, tokenizer=tc.tokenizer)
        vocab = ds.tokenizer.vocab_size if hasattr(ds, "tokenizer") else None
        if vocab is not None and vocab > self.model_config.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} ids but preset {tc.preset!r} has vocab_size={self.model_config.vocab_size}; "
                "choose a larger preset or set model_overrides.vocab_size in the config file"
            )
        dp_size, dp_rank = self.ps.get_data_parallel_world_size(), self.ps.get_data_parallel_rank()
        if tc.global_batch_size % dp_size:
            raise ValueError(
                f"--global-batch-size {tc.global_batch_size} must be divisible by DP size {dp_size}"
            )
        self.batches = PackedBatchIterator(
            ds,
            BatchConfig(
                global_batch_size=tc.global_batch_size,
                max_seqlen_per_dp_cp_rank=tc.seq_len,
                layout="thd" if tc.packed else "sbhd",
                micro_batch_size=tc.micro_batch_size,
                dp_size=dp_size,
                dp_rank=dp_rank,
                static_shape=True,
                seed=tc.seed,
            ),
        )
        self.dataset = ds

    # ------------------------------------------------------------------ one step
    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        unwrapped = self.core
        if isinstance(mb, dict):  # --cuda-graph: the static device buffers of a fixed-length micro-batch
            from hybrid_model.training.cuda_graph import BATCH_FIELDS

            psp = None
            tokens, labels, loss_mask, pos, pad = (mb[k] for k in BATCH_FIELDS)
        elif self.tc.packed:
            psp = mb.packed_seq_params()
            tokens, labels = mb.tokens[None].to(self.device), mb.labels[None].to(self.device)
            loss_mask = mb.loss_mask[None].to(self.device)
            pos = mb.position_ids[None].to(self.device)
            pad = mb.padding_mask[None].to(self.device)  # [1, T] True on padding rows
        else:
            psp = None
            tokens, labels = mb.tokens.to(self.device), mb.labels.to(self.device)
            loss_mask, pos = mb.loss_mask.to(self.device), mb.position_ids.to(self.device)
            pad = mb.padding_mask.to(self.device)  # [b, s]
        # padding rows never count in the MoE balance loss or the selection-bias loads (spec §7.5: valid tokens)
        out = model(
            tokens, pos, None, labels=labels, loss_mask=loss_mask, packed_seq_params=psp, padding_mask=pad
        )

        def loss_func(output):
            mask = loss_mask.float()
            num = mask.sum().clamp(min=1.0)
            loss = (output.float() * mask).sum() / num
            report = {"lm loss": loss.detach().clone()}  # megatron divides the returned loss in place
            if unwrapped.mtp_process and unwrapped.last_mtp_loss is not None:
                report["mtp loss"] = unwrapped.last_mtp_loss
            return loss, report

        return out, loss_func

    def _train_step(self, batch) -> dict:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from hash_moe.megatron import update_selection_biases

        tc = self.tc
        self.config.csa_dense_mode = self.step < tc.dense_steps
        self.config.mtp_loss_scaling_factor = tc.mtp_weight_at(self.step, self.model_config.mtp_loss_weight)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        fb = get_forward_backward_func()
        kwargs = {}
        seq = tc.seq_len  # THD packs are padded to the static capacity seq_len
        mbs = 1 if tc.packed else tc.micro_batch_size
        if tc.pp > 1:
            from mhc.megatron import make_mhc_adjust_tensor_shapes_fn

            kwargs["adjust_tensor_shapes_fn"] = make_mhc_adjust_tensor_shapes_fn(self.model_config.hc_mult)
        schedule = dict(
            forward_step_func=self._forward_step,
            data_iterator=iter(batch.microbatches),
            model=[self.model],
            num_microbatches=batch.num_microbatches,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
            **kwargs,
        )
        if tc.cuda_graph:
            from hybrid_model.training.cuda_graph import GraphedForwardBackward, static_batch

            if self._graphed is None:
                self._graphed = GraphedForwardBackward(fb, tc.cuda_graph_warmup_steps)
            schedule["data_iterator"] = iter([static_batch(mb) for mb in batch.microbatches])
            # host-side values baked into the captured step: a change recaptures
            fb = functools.partial(
                self._graphed, key=(self.config.csa_dense_mode, self.config.mtp_loss_scaling_factor)
            )
        with cuda_as_cpu():  # CPU: the schedules' and optimizer's device="cuda" bookkeeping tensors
            reports = fb(**schedule)
            ok, grad_norm, _ = self.optimizer.step()
        update_selection_biases(self.core, group=self.ps.get_data_parallel_group(with_context_parallel=True))
        self.scheduler.step(increment=1)
        m: dict = {"step": self.step + 1, "grad_norm": float(grad_norm) if grad_norm is not None else None}
        m["lr"] = self.optimizer.param_groups[0]["lr"]
        if self.model_config.num_nextn_predict_layers:
            m["mtp_weight"] = self.config.mtp_loss_scaling_factor
        m.update(self._reduced_losses(reports, batch.num_microbatches))
        m["skipped"] = not ok
        if self._graphed is not None:
            m["cuda_graph_replayed"] = self._graphed.captured
        return m

    _LOSS_KEYS = ("lm_loss", "mtp_loss", "balance_loss", "indexer_loss")

    def _reduced_losses(self, reports: list[dict], num_microbatches: int) -> dict:
        """The step's losses averaged over every rank that computed them: LM/MTP losses over the DP replicas of the
        last stage, balance/indexer losses over all MoE/CSA layers of all stages and replicas (one all-reduce of
        (sum, count) pairs over the world; each rank holds its own stage's layers and its own data)."""
        local = torch.zeros(2 * len(self._LOSS_KEYS), dtype=torch.float64, device=self.device)

        def add(key: str, values: list[float]) -> None:
            i = self._LOSS_KEYS.index(key)
            local[2 * i] += sum(values)
            local[2 * i + 1] += len(values)

        for key in ("lm loss", "mtp loss"):
            add(key.replace(" ", "_"), [float(r[key]) for r in reports if key in r])
        # per-layer trackers accumulate one value per micro-batch; layers of other stages stay 0
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        from dsv4_attention import get_indexer_loss_tracker

        moe_tracker = get_moe_metrics_tracker()
        entry = moe_tracker.metrics.get("seq_load_balancing_loss")
        if entry is not None:  # recorded as loss / coeff: report the applied (coefficient-scaled) loss
            vals = entry.values[entry.values != 0].double() * self.tc.balance_loss_coeff / num_microbatches
            add("balance_loss", vals.tolist())
        moe_tracker.clear()
        tracker = get_indexer_loss_tracker()
        vals = getattr(tracker, "values", None)
        if isinstance(vals, torch.Tensor) and vals.numel():
            add("indexer_loss", (vals[vals != 0].double() / num_microbatches).tolist())
            tracker.clean()
        if self.world > 1:
            dist.all_reduce(local)
        return {
            key: float(local[2 * i] / local[2 * i + 1])
            for i, key in enumerate(self._LOSS_KEYS)
            if local[2 * i + 1] > 0
        }

    # ------------------------------------------------------------------ checkpoints
    def _rng_layout(self) -> tuple[int, int, int]:
        ps = self.ps
        return (
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_data_parallel_world_size(with_context_parallel=True),
        )

    def _rng_state(self):
        """This rank's RNG state (CPU generator, CUDA generator + megatron's tracker on GPU) as one ShardedObject
        at (pp rank, tp rank, dp rank): every rank keeps its own stream across a resume."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        ps = self.ps
        state = {"cpu": torch.get_rng_state(), "cuda": None, "tracker": None}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
            # graph-safe trackers (--cuda-graph) hold generators: saved as their state tensors, the same format
            state["tracker"] = {
                name: st.get_state() if isinstance(st, torch.Generator) else st
                for name, st in get_cuda_rng_tracker().get_states().items()
            }
        offset = (
            ps.get_pipeline_model_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(with_context_parallel=True),
        )
        return ShardedObject("rng_state", state, self._rng_layout(), offset, replica_id=0)

    def _set_rng_state(self, state: dict) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.set_rng_state(state["cpu"])
        if torch.cuda.is_available() and state.get("cuda") is not None:
            torch.cuda.set_rng_state(state["cuda"])
            tracker = get_cuda_rng_tracker()
            live = tracker.get_states()
            restored = {}
            for name, st in state["tracker"].items():
                if isinstance(
                    live.get(name), torch.Generator
                ):  # keep the generator objects (graphs hold them)
                    live[name].set_state(st.get_state() if isinstance(st, torch.Generator) else st)
                    restored[name] = live[name]
                else:
                    restored[name] = st
            tracker.set_states(restored)

    def _sharded_state(self, loading: bool, *, with_rng: bool = True):
        model_sd = self.core.sharded_state_dict()
        state = {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(
                self.core.sharded_state_dict(), is_loading=loading, metadata=DISTOPT_FORMAT
            ),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "data": self.batches.state_dict(),  # the global iteration (identical on every rank)
            "rng_layout": list(self._rng_layout()),
        }
        if with_rng:
            state["rng_state"] = self._rng_state()
        return state

    def save_checkpoint(self) -> Path:
        from megatron.core import dist_checkpointing

        _sync_saver_queue()
        path = self.out / "checkpoints" / f"iter_{self.step:07d}"
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with cuda_as_cpu():
            dist_checkpointing.save(self._sharded_state(loading=False), str(path))
        dist.barrier()
        if self.rank == 0:
            (self.out / "checkpoints" / "latest").write_text(path.name)
        return path

    def load_checkpoint(self) -> bool:
        """Restore model, optimizer (Adam moments + per-param step), LR scheduler, data position and RNG state of
        ``checkpoints/latest``; ``False`` when there is none. The RNG streams are restored only when the
        parallel layout (PP, TP, DP) is the saved one."""
        from megatron.core import dist_checkpointing

        latest = self.out / "checkpoints" / "latest"
        if not latest.exists():
            return False
        path = self.out / "checkpoints" / latest.read_text().strip()
        common = dist_checkpointing.load_common_state_dict(str(path))
        same_layout = list(common.get("rng_layout", [])) == list(self._rng_layout())
        with cuda_as_cpu():
            state = dist_checkpointing.load(
                self._sharded_state(loading=True, with_rng=same_layout), str(path)
            )
            self.core.load_state_dict(state["model"])
            with torch.no_grad():
                self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.batches.load_state_dict(state["data"])
        if same_layout:
            self._set_rng_state(state["rng_state"])
        return True

    def load_model_weights(self, path: str | Path) -> Path:
        """Initialise the model (weights and buffers only) from the dist checkpoint ``path``: an ``iter_XXXXXXX``
        directory, or a run directory (its ``checkpoints/latest``). Any PP/EP/DP layout can read a checkpoint
        written by another (megatron resharding); optimizer, scheduler, data and RNG state start fresh."""
        from megatron.core import dist_checkpointing

        p = Path(path)
        if (p / "checkpoints" / "latest").exists():
            p = p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()
        if not dist_checkpointing.check_is_distributed_checkpoint(str(p)):
            raise ValueError(
                f"--init-from {path}: not a megatron dist checkpoint (give an iter_XXXXXXX directory or a run "
                "directory with checkpoints/latest)"
            )
        with cuda_as_cpu():
            state = dist_checkpointing.load({"model": self.core.sharded_state_dict()}, str(p))
            self.core.load_state_dict(state["model"])
            self.optimizer.reload_model_params()  # main (fp32) copies follow the loaded weights
        return p

    # ------------------------------------------------------------------ run
    def _handle_signal(self, signum, frame) -> None:
        self._stop = True

    def run(self) -> list[dict]:
        from hybrid_model.flops import forward_flops_from_stats
        from hybrid_model.training.outputs import RunOutputs

        tc = self.tc
        resumed = tc.resume and self.load_checkpoint()
        if not resumed and tc.init_from:
            self.load_model_weights(tc.init_from)
        outputs = RunOutputs(
            self.out, enabled=self.is_logger, append=resumed, total=tc.steps, progress=tc.progress
        )
        old = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        peak = (tc.peak_tflops or _default_peak_tflops()) * 1e12
        try:
            outputs.start(initial=self.step)
            self.model.train()
            while self.step < tc.steps:
                batch = next(self.batches)
                t0 = time.perf_counter()
                m = self._train_step(batch)
                dt = time.perf_counter() - t0
                self.step += 1
                flops = forward_flops_from_stats(
                    self.model_config, batch.seqlen_sum, batch.seqlen_squared_sum
                )
                m["tokens_per_s"] = batch.seqlen_sum / dt
                m["mfu"] = flops.training / dt / peak / self.world
                m["step_time_s"] = dt
                self.metrics.append(m)
                outputs.log(m)
                if tc.save_interval and self.step % tc.save_interval == 0:
                    self.save_checkpoint()
                if self._stop:
                    outputs.note(f"signal received: saving a checkpoint at step {self.step} and stopping")
                    self.save_checkpoint()
                    break
            else:  # a finished run leaves a final checkpoint (`--resume` / `--init-from` / `dsv4 convert`)
                if tc.save_final:
                    self.save_checkpoint()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            outputs.close()
        return self.metrics

    def close(self) -> None:
        if self._graphed is not None:
            self._graphed.close()
            self._graphed = None
        if self._previous_stream is not None:
            torch.cuda.synchronize()
            torch.cuda.set_stream(self._previous_stream)
            self._previous_stream = None
        self.ps.destroy_model_parallel()


def _reset_metric_trackers() -> None:
    """Process-wide per-layer loss trackers are sized by the first model that records: start each run fresh."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from dsv4_attention import get_indexer_loss_tracker

    destroy_moe_metrics_tracker()
    get_indexer_loss_tracker().reset()


def _sync_saver_queue() -> None:
    """Single-process (sync) saves collect their write results in-process instead of through a spawned manager."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def _default_peak_tflops() -> float:
    """Dense BF16 peak of the device for MFU (H200 989 TFLOP/s); a nominal 1 TFLOP/s on CPU."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if "H200" in name or "H100" in name:
            return 989.0
        return 312.0
    return 1.0


def train(tc: TrainConfig) -> list[dict]:
    """Run ``dsv4 train`` with ``tc``; returns the per-step metrics (rank-local)."""
    trainer = Trainer(tc)
    try:
        return trainer.run()
    finally:
        trainer.close()


def loss_is_falling(metrics: list[dict], key: str = "lm_loss") -> bool:
    vals = [m[key] for m in metrics if key in m and m[key] is not None and math.isfinite(m[key])]
    if len(vals) < 4:
        return False
    k = max(1, len(vals) // 5)
    return sum(vals[-k:]) / k < sum(vals[:k]) / k


__all__ = ["Trainer", "loss_is_falling", "train"]
