"""The training loop of ``dsv4 train`` on megatron-core: parallel state, DDP + distributed optimizer, the
forward-backward schedule, dist-checkpointing with exact resume, and the run's outputs.

One process (CPU or one GPU) or ``torchrun`` (gloo on CPU, NCCL on GPU, ``--dist-backend`` to choose) with
``--pp/--ep/--cp`` (DP is the rest;
context parallelism: :mod:`~dsv4_train.context_parallel`).
Outputs in ``out``: ``metrics.jsonl`` (one JSON object per step), ``loss.png``, ``tb/`` (TensorBoard),
``checkpoints/iter_XXXXXXX`` (megatron dist checkpoints; ``latest`` names the newest).

The parts live in their own modules: :mod:`~dsv4_train.setup` (model, optimizer, scheduler, data),
:mod:`~dsv4_train.checkpoint` (save / load / RNG state), :mod:`~dsv4_train.step` (one
optimizer step and the loss reduction); :class:`Trainer` holds them and runs the loop.
"""

from __future__ import annotations

import functools
import math
import signal
import time
from array import array
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection

from dsv4_primitives.megatron import (
    apply_cpu_shims,
    destroy_model_parallel,
    init_rng_tracker,
    process_groups,
    release_autograd_graphs,
    remove_grad_accumulator_hooks,
)
from dsv4_train import determinism
from dsv4_train.atomic_save import CheckpointSaveError
from dsv4_train.checkpoint import DISTOPT_FORMAT, Checkpointer, latest_checkpoint, preflight_resume
from dsv4_train.ckpt_integrity import verify_resume
from dsv4_train.config import TrainConfig
from dsv4_train.cuda_graph import use_capture_stream
from dsv4_train.data_identity import check_same_data, data_identity
from dsv4_train.determinism import prepare_deterministic_environment
from dsv4_train.evaluation import Evaluator
from dsv4_train.gloo_cuda import host_staged_collectives
from dsv4_train.init_source import check_init_from
from dsv4_train.loss_trend import loss_is_falling, loss_trend
from dsv4_train.lost_rank import RankWatch, kill_self, test_kill_point
from dsv4_train.model_config import model_config_for
from dsv4_train.outputs import RunOutputs
from dsv4_train.run_start import announce_start
from dsv4_train.rundir import check_writable, clear_run, decide_resume
from dsv4_train.setup import (
    attach_schedule_hooks,
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    check_run,
    check_world,
    default_peak_tflops,
    init_distributed,
    reset_metric_trackers,
)
from dsv4_train.step import StepRunner, TrainingDiverged
from dsv4_train.virtual_pipeline import check_vpp_microbatches, ddp_chunks
from hybrid_model.flops import forward_flops_from_stats
from hybrid_model.mixers.gdn import check_gdn_training
from hybrid_model.mixers.registry import check_packed_graph_pattern

#: per-step metric rows a :class:`Trainer` keeps in memory (the newest; every row is in ``metrics.jsonl``), so that
#: a long run's memory does not grow with its step count (a row is about 1.5 KB)
METRICS_KEPT = 1000


class Trainer:
    """Builds everything from a :class:`TrainConfig`; :meth:`run` trains and returns the per-step metrics."""

    def __init__(self, tc: TrainConfig) -> None:

        self.tc = tc = check_run(tc)  # the effective config: auto values resolved, the support table's rules
        # the run directory rules (rundir.py) before anything is built or initialised: a clear error costs nothing
        self.out = Path(tc.checkpoint.out)
        check_writable(self.out)
        if (self.out / "checkpoints").exists():  # found now, not at the first save after the work is done
            check_writable(self.out / "checkpoints", "the checkpoint directory")
        self.resuming = decide_resume(tc)
        self.verified = True  # False: the resumed checkpoint has no manifest of checksums (older checkpoints)
        if not self.resuming:
            check_init_from(tc)
        # what the training stream is read from (recorded with every checkpoint; a resume checks it is unchanged)
        self.data_notes: list[str] = []
        if (
            self.resuming
        ):  # its files against their checksums first (dsv4_train.ckpt_integrity), then its settings
            self.verified = verify_resume(latest_checkpoint(self.out / "checkpoints"))
            self.data_identity, self.data_notes = check_same_data(preflight_resume(tc), tc)
        else:
            self.data_identity = data_identity(tc)
        self.cleared: list[str] = []
        if (
            tc.precision.deterministic  # resolved: on for every CUDA run unless --no-deterministic
        ):  # cuBLAS / NCCL read their variables at their first use: before any CUDA work
            prepare_deterministic_environment()
        apply_cpu_shims()
        self.rank, self.world = init_distributed(tc.parallel.dist_backend, tc.parallel.dist_timeout)
        check_world(tc, self.world)
        self._kill_at = test_kill_point(
            self.rank, "step"
        )  # the fault tests' hook (DSV4_TRAIN_TEST_KILL_RANK_AT_STEP)
        if not self.resuming and (tc.checkpoint.overwrite or tc.checkpoint.resume == "auto"):
            dist.barrier()  # every rank has looked at the directory before rank 0 clears it
            if self.rank == 0:
                self.cleared = clear_run(self.out)
        dist.barrier()
        self._groups_before = process_groups()  # close() destroys the groups created from here on
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tc.parallel.tp,
            pipeline_model_parallel_size=tc.parallel.pp,
            virtual_pipeline_model_parallel_size=tc.parallel.vpp if tc.parallel.vpp > 1 else None,
            expert_model_parallel_size=tc.parallel.ep,
            expert_tensor_parallel_size=1,  # routed experts are whole on their EP rank (hybrid_model.tensor_parallel)
            context_parallel_size=tc.parallel.cp,
            distributed_timeout_minutes=tc.parallel.dist_timeout / 60,  # the groups' timeout: --dist-timeout
        )
        self._unstage = None  # gloo on CUDA: megatron's coalesced collectives staged through host memory
        if torch.cuda.is_available() and dist.get_backend() == "gloo":
            staging = host_staged_collectives()
            staging.__enter__()
            self._unstage = functools.partial(staging.__exit__, None, None, None)
        self._previous_stream = None
        # several processes: a heartbeat, so that the survivors of a lost rank can name it (dsv4_train.lost_rank)
        self.watch = RankWatch(self.rank, self.world) if self.world > 1 else None
        self._restore_determinism = None  # set by _build
        try:
            self._build(tc, ps)
        except BaseException:  # leave no half-initialised megatron state behind
            if self._restore_determinism is not None:  # PyTorch's and csa-kernels' settings as they were
                self._restore_determinism()
            if self.watch is not None:
                self.watch.close()
            if self._previous_stream is not None:
                torch.cuda.set_stream(self._previous_stream)
            if self._unstage is not None:
                self._unstage()
            destroy_model_parallel(keep=self._groups_before)
            raise
        self.step = 0
        self._current = 1  # the step the loop is at (its training, evaluation and save)
        self.metrics: deque[dict] = deque(maxlen=METRICS_KEPT)  # the newest rows (all in metrics.jsonl)
        # every step's LM loss on this rank (NaN when absent or not finite; 8 bytes a step): the run summary
        self.lm_losses = array("d")
        self.interrupted_by: int | None = None  # the signal that stopped the run (its checkpoint is saved)
        self.nonfinite_steps = 0  # steps skipped for a non-finite loss or gradient (in total)
        self._nonfinite_run: list[int] = []  # the current run of consecutive non-finite steps
        self._saved_step: int | None = None

    def _build(self, tc: TrainConfig, ps) -> None:
        """Model, optimizer, scheduler, data, checkpointer and step runner of this rank (after the parallel state)."""

        # what the pattern cannot train is refused before the RNG and determinism settings change
        self.model_config = model_config_for(tc)
        check_gdn_training(
            self.model_config.layer_pattern,
            packed=tc.data.packed,
            deterministic=tc.precision.deterministic,
            cuda_graph=tc.graphs.cuda_graph,
        )
        if tc.graphs.cuda_graph and tc.data.packed:
            check_packed_graph_pattern(self.model_config.layer_pattern)
        init_rng_tracker(tc.schedule.seed, cuda_graph_safe=tc.graphs.cuda_graph)
        reset_metric_trackers()
        self.ps = ps
        self.pg = ProcessGroupCollection.use_mpu_process_groups()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

        # --deterministic (the default with CUDA) or --no-deterministic (csa-kernels' atomic kernels); a CPU run keeps
        # PyTorch's deterministic kernels either way (bit-reproducible runs)
        self._restore_determinism = determinism.use_run_determinism(
            self.device, tc.schedule.seed, tc.precision.deterministic
        )
        if tc.graphs.cuda_graph:  # the model, its gradient hooks and every step live on the capture stream
            self._previous_stream = use_capture_stream()
        self.is_logger = self.rank == self.world - 1  # the last stage sees the loss
        self._stop = False
        # the data first: bad data fail before the model is built
        self.batches, self.run_data = build_data(tc, self.model_config, ps, announce=self.is_logger)
        self.dataset = self.run_data.train
        if (
            tc.parallel.vpp > 1 and not tc.data.packed
        ):  # [B, S] batches: the micro-batch count is known now (packed: per step)
            dp = ps.get_data_parallel_world_size()
            check_vpp_microbatches(
                tc.data.global_batch_size // (dp * tc.data.micro_batch_size), tc.parallel.pp
            )
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
            tc=tc,
            data_identity=self.data_identity,
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
        if tc.data.packed:  # the packs' document capacity (the static cu_seqlens size of --cuda-graph)
            self.stepper.max_docs_per_pack = self.batches.config.max_num_seqs - 1
        self.evaluator = None  # --eval-interval: dsv4_train.evaluation
        if self.run_data.eval is not None:
            self.evaluator = Evaluator(
                tc,
                self.model_config,
                self.run_data.eval,
                stepper=self.stepper,
                ps=ps,
                device=self.device,
                world=self.world,
            )
        self.eval_metrics: deque[dict] = deque(maxlen=METRICS_KEPT)

    @property
    def _graphed(self):
        """The ``--cuda-graph`` wrapper (``None`` before the first step and in eager runs)."""
        return self.stepper.graphed

    # ------------------------------------------------------------------ one step
    def _train_step(self, batch) -> dict:
        tc = self.tc
        if self._kill_at == self.step + 1:
            kill_self()
        self.core.set_step_state(
            dense_attention=self.step < tc.schedule.dense_steps,
            mtp_loss_weight=tc.mtp_weight_at(self.step, self.model_config.mtp_loss_weight),
        )
        return self.stepper(batch, self.step)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Save the training state of this step as ``checkpoints/iter_XXXXXXX`` and point ``latest`` at it (once
        per step: a second call at the same step does not write again)."""
        path = self.checkpointer.dir / f"iter_{self.step:07d}"
        self.finish_deferred_step()
        if self._saved_step != self.step:
            path = self.checkpointer.save(self.step)
            self._saved_step = self.step
        return path

    def finish_deferred_step(self) -> None:
        """``--optimizer-offload-defer``: the last step's host AdamW is done (its error raised) before saves etc."""
        if self.stepper.deferred is not None:
            self.stepper.deferred.finish()

    def load_checkpoint(self) -> bool:
        """Restore the state of ``checkpoints/latest`` (see :meth:`Checkpointer.load_latest`); ``False`` if none."""
        step = self.checkpointer.load_latest()
        if step is None:
            return False
        self.step = self._saved_step = step
        return True

    def load_model_weights(self, path: str | Path) -> Path:
        """Initialise the weights only from a dist checkpoint (see :meth:`Checkpointer.load_weights`)."""
        return self.checkpointer.load_weights(path)

    # ------------------------------------------------------------------ run
    def _handle_signal(self, signum, frame) -> None:
        self._stop = True
        self.interrupted_by = signum

    def _count_nonfinite(self, m: dict, outputs) -> None:
        """Count a skipped non-finite (or exploded: ``--max-loss-growth``) step; :class:`TrainingDiverged` after
        ``max_nonfinite_steps`` in a row."""
        if not (m["nonfinite"] or m["exploded"]):
            self._nonfinite_run = []
            return
        self.nonfinite_steps += 1
        self._nonfinite_run.append(m["step"])
        limit = self.tc.schedule.max_nonfinite_steps
        losses = ", ".join(f"{k} {m[k]}" for k in ("lm_loss", "mtp_loss") if k in m)
        what = (
            f"LM loss {m['lm_loss']:.4g} is over --max-loss-growth {self.tc.schedule.max_loss_growth:g} x the run's "
            f"lowest {self.stepper.lowest_lm_loss:.4g}"
            if m["exploded"]
            else f"non-finite loss or gradient ({losses}, grad_norm {m['grad_norm']})"
        )
        outputs.note(
            f"step {m['step']}: {what}; update "
            f"{'skipped' if m['skipped'] else 'applied (gradient norm overflow)'} ({len(self._nonfinite_run)} in a row, "
            f"--max-nonfinite-steps {limit})"
        )
        if len(self._nonfinite_run) >= limit:
            latest = self.checkpointer.dir / "latest"
            kept = (
                f"{latest} names {latest.read_text().strip()}"
                if latest.exists()
                else "no checkpoint was written"
            )
            raise TrainingDiverged(
                f"the run diverged: steps {self._nonfinite_run[0]}-{self._nonfinite_run[-1]} ({limit} in a row, "
                f"--max-nonfinite-steps) had a non-finite or exploding loss or gradient at lr {m['lr']:.3g}; nothing was saved "
                f"({kept}). Start again with a lower --lr or a longer --warmup-steps (--init-from a checkpoint keeps "
                "its weights)"
            )

    def run(self) -> list[dict]:
        """Train to ``--steps``; the per-step metrics of this process (the newest :data:`METRICS_KEPT`)."""

        tc = self.tc
        resumed = self.resuming and self.load_checkpoint()
        self._current = self.step + 1
        if not resumed and tc.checkpoint.init_from:
            self.load_model_weights(tc.checkpoint.init_from)
        if self.is_logger:
            announce_start(
                tc,
                self.out,
                resumed=resumed,
                step=self.step,
                verified=self.verified,
                data_notes=self.data_notes,
                cleared=self.cleared,
            )
        outputs = RunOutputs(
            self.out,
            enabled=self.is_logger,
            append=resumed,
            total=tc.schedule.steps,
            progress=tc.logging.progress,
            log_interval=tc.logging.log_interval,
        )
        old = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        peak = (tc.logging.peak_tflops or default_peak_tflops()) * 1e12
        try:
            outputs.start(initial=self.step)
            for chunk in ddp_chunks(self.model):
                chunk.train()
            self._loop(outputs, peak)
        except Exception as e:
            lost = self._explain_failure(e)
            if lost is None:
                raise
            raise lost from e
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            outputs.close()
        return list(self.metrics)

    def _explain_failure(self, error: Exception):
        """Several processes: the :class:`~dsv4_train.lost_rank.RankLost` error naming the rank that stopped
        responding (or the collective that timed out) behind ``error``; ``None`` otherwise."""
        if self.watch is None or isinstance(error, ValueError | TrainingDiverged | CheckpointSaveError):
            return None
        latest = self.checkpointer.dir / "latest"
        then = (
            f"{latest} names {latest.read_text().strip()}: start the run again with --resume"
            if latest.is_file()
            else "no checkpoint was saved yet: start the run again with --resume auto"
        )
        return self.watch.explain(
            error, step=self._current, timeout_s=self.tc.parallel.dist_timeout, then=then
        )

    def _loop(self, outputs: RunOutputs, peak: float) -> None:
        """The steps, evaluations and saves of :meth:`run`."""
        tc = self.tc
        while self.step < tc.schedule.steps:
            self._current = self.step + 1  # the step this iteration trains, evaluates and saves
            batch = next(self.batches)
            t0 = time.perf_counter()
            m = self._train_step(batch)
            dt = time.perf_counter() - t0
            self.step += 1
            flops = forward_flops_from_stats(self.model_config, batch.seqlen_sum, batch.seqlen_squared_sum)
            m["tokens_per_s"] = batch.seqlen_sum / dt
            m["mfu"] = flops.training / dt / peak / self.world
            m["step_time_s"] = dt
            self.metrics.append(m)
            lm = m.get("lm_loss")
            self.lm_losses.append(lm if lm is not None else math.nan)
            outputs.log(m)
            self._count_nonfinite(m, outputs)
            if self.evaluator is not None and self.evaluator.due(self.step) and not self._stop:
                self.finish_deferred_step()
                self.eval_metrics.append(self.evaluator(self.step))
                outputs.log_eval(self.eval_metrics[-1])
            if tc.checkpoint.save_interval and self.step % tc.checkpoint.save_interval == 0:
                if m["exploded"]:  # never the weights that made the loss explode
                    outputs.note(f"step {self.step}: not saved (its loss exploded: --max-loss-growth)")
                else:
                    self.save_checkpoint()
            if self._stop:
                name = signal.Signals(self.interrupted_by).name if self.interrupted_by else "signal"
                outputs.note(f"{name} received: saving a checkpoint at step {self.step} and stopping")
                self.save_checkpoint()
                break
        else:  # a finished run leaves a final checkpoint (`--resume` / `--init-from` / `dsv4 convert`)
            if self.metrics and self.metrics[-1]["exploded"]:
                raise TrainingDiverged(
                    f"the run ended with an exploding loss (steps {self._nonfinite_run[0]}-"
                    f"{self._nonfinite_run[-1]} over --max-loss-growth); its weights are not saved. Start again "
                    "with a lower --lr or a longer --warmup-steps"
                )
            if tc.checkpoint.save_final:
                self.save_checkpoint()
        self.finish_deferred_step()  # the caller may read the trained model

    def close(self) -> None:
        """Release everything the run holds: the deferred host step (finished first; its error raised), graphs,
        streams, determinism settings, megatron's parallel state and its process groups (the model is finished
        afterwards; nothing may run on it)."""

        try:
            if self.stepper.deferred is not None:
                self.stepper.deferred.close()
        finally:
            self._release()

    def _release(self) -> None:
        if self.stepper.graphed is not None:
            self.stepper.graphed.close()
            self.stepper.graphed = None
        if self._previous_stream is not None:
            torch.cuda.synchronize()
            torch.cuda.set_stream(self._previous_stream)
            self._previous_stream = None
        self._restore_determinism()
        if self._unstage is not None:
            self._unstage()
            self._unstage = None
        if self.watch is not None:
            self.watch.close()
        # break the reference cycles through C++ autograd nodes that keep the model, its DDP and its process groups
        # (gloo threads polling at 100 Hz) alive after the trainer (dsv4_primitives.megatron.groups)
        for chunk in ddp_chunks(self.model):
            remove_grad_accumulator_hooks(chunk)
        release_autograd_graphs(self.core)
        destroy_model_parallel(keep=self._groups_before)


def train(tc: TrainConfig) -> list[dict]:
    """Run ``dsv4 train`` with ``tc``; returns the per-step metrics (rank-local)."""
    trainer = Trainer(tc)
    try:
        return trainer.run()
    finally:
        trainer.close()


__all__ = [
    "DISTOPT_FORMAT",
    "Trainer",
    "TrainingDiverged",
    "loss_is_falling",
    "loss_trend",
    "model_config_for",
    "train",
]
