"""The training loop of ``dsv4 train`` on megatron-core: parallel state, DDP + distributed optimizer, the
forward-backward schedule, dist-checkpointing with exact resume, and the run's outputs.

One process (CPU or one GPU) or ``torchrun`` (gloo on CPU, NCCL on GPU) with ``--pp/--ep`` (DP is the rest).
Outputs in ``out``: ``metrics.jsonl`` (one JSON object per step), ``loss.png``, ``tb/`` (TensorBoard),
``checkpoints/iter_XXXXXXX`` (megatron dist checkpoints; ``latest`` names the newest).

The parts live in their own modules: :mod:`~hybrid_model.training.setup` (model, optimizer, scheduler, data),
:mod:`~hybrid_model.training.checkpoint` (save / load / RNG state), :mod:`~hybrid_model.training.step` (one
optimizer step and the loss reduction); :class:`Trainer` holds them and runs the loop.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch

from hybrid_model.training.checkpoint import DISTOPT_FORMAT, Checkpointer
from hybrid_model.training.config import TrainConfig
from hybrid_model.training.setup import (
    attach_schedule_hooks,
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    default_peak_tflops,
    init_distributed,
    model_config_for,
    reset_metric_trackers,
)
from hybrid_model.training.step import StepRunner


class Trainer:
    """Builds everything from a :class:`TrainConfig`; :meth:`run` trains and returns the per-step metrics."""

    def __init__(self, tc: TrainConfig) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        from dsv4_primitives.megatron import apply_cpu_shims, init_rng_tracker

        self.tc = tc
        apply_cpu_shims()
        self.rank, self.world = init_distributed()
        if self.world % (tc.pp * tc.tp):
            raise ValueError(f"world size {self.world} is not divisible by pp={tc.pp} x tp={tc.tp}")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tc.tp,
            pipeline_model_parallel_size=tc.pp,
            expert_model_parallel_size=tc.ep,
        )
        init_rng_tracker(tc.seed, cuda_graph_safe=tc.cuda_graph)
        reset_metric_trackers()
        self.ps = ps
        self.pg = ProcessGroupCollection.use_mpu_process_groups()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        from hybrid_model.training.determinism import use_deterministic_cpu_kernels

        self._restore_determinism = use_deterministic_cpu_kernels(self.device)  # CPU: bit-reproducible runs
        self.model_config = model_config_for(tc)
        self._previous_stream = None
        if tc.cuda_graph:  # the model, its gradient hooks and every step live on the capture stream
            from hybrid_model.training.cuda_graph import use_capture_stream

            self._previous_stream = use_capture_stream()
        self.out = Path(tc.out)
        self.is_logger = self.rank == self.world - 1  # the last stage sees the loss
        self._stop = False
        # the data first: bad data fail before the model is built
        self.batches, self.dataset = build_data(tc, self.model_config, ps, announce=self.is_logger)
        parts = build_model(tc, self.model_config, ps, self.pg, self.device)
        self.core = parts.core  # the DSv4Model itself (under the Float16Module and DDP wrappers)
        self.model, self.config = parts.model, parts.config
        self.optimizer = build_optimizer(tc, self.model)
        self.scheduler = build_scheduler(tc, self.optimizer)
        attach_schedule_hooks(self.config, self.model)
        self.checkpointer = Checkpointer(
            core=self.core,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            batches=self.batches,
            ps=ps,
            out=self.out,
            rank=self.rank,
        )
        self.stepper = StepRunner(
            tc,
            self.model_config,
            core=self.core,
            model=self.model,
            config=self.config,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            ps=ps,
            device=self.device,
            world=self.world,
        )
        self.step = 0
        self.metrics: list[dict] = []

    @property
    def _graphed(self):
        """The ``--cuda-graph`` wrapper (``None`` before the first step and in eager runs)."""
        return self.stepper.graphed

    # ------------------------------------------------------------------ one step
    def _train_step(self, batch) -> dict:
        tc = self.tc
        self.core.set_step_state(
            dense_attention=self.step < tc.dense_steps,
            mtp_loss_weight=tc.mtp_weight_at(self.step, self.model_config.mtp_loss_weight),
        )
        return self.stepper(batch, self.step)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Save the training state of this step as ``checkpoints/iter_XXXXXXX`` and point ``latest`` at it."""
        return self.checkpointer.save(self.step)

    def load_checkpoint(self) -> bool:
        """Restore the state of ``checkpoints/latest`` (see :meth:`Checkpointer.load_latest`); ``False`` if none."""
        step = self.checkpointer.load_latest()
        if step is None:
            return False
        self.step = step
        return True

    def load_model_weights(self, path: str | Path) -> Path:
        """Initialise the weights only from a dist checkpoint (see :meth:`Checkpointer.load_weights`)."""
        return self.checkpointer.load_weights(path)

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
        peak = (tc.peak_tflops or default_peak_tflops()) * 1e12
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
        if self.stepper.graphed is not None:
            self.stepper.graphed.close()
            self.stepper.graphed = None
        if self._previous_stream is not None:
            torch.cuda.synchronize()
            torch.cuda.set_stream(self._previous_stream)
            self._previous_stream = None
        self._restore_determinism()
        self.ps.destroy_model_parallel()


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


__all__ = ["DISTOPT_FORMAT", "Trainer", "loss_is_falling", "model_config_for", "train"]
