"""Evaluation of ``dsv4 train`` (``--eval-interval N``, ``--eval-iters K``, ``--eval-data PATH``): every ``N`` steps
and after the last step, ``K`` global batches of the evaluation data (:mod:`dsv4_train.eval_data`) go
through megatron's forward-only schedule (the same schedule function and arguments as training,
:meth:`~dsv4_train.step.StepRunner.schedule`: with PP the pipelined one with the mHC stream shapes between
stages, with ``--vpp`` the interleaved one over every model chunk with the folded streams) with the model in eval
mode under ``torch.no_grad``. Under ``--cp N`` the evaluation batches are sharded like the training batches: over DP
only, each CP rank taking its contiguous rows of every pack (``[B, S]`` rows as one THD pack, then sliced).

Eval mode changes, compared with a training forward of the same weights and batch: no CSA indexer KL loss and no
MoE balance loss are computed or recorded (they only shape gradients), the routers count no expert loads (the
selection-bias update of the next training step sees training tokens only), nothing is recorded in the per-layer
metric trackers; the attention phase (dense warm-up / sparse) is the current training step's. The LM and MTP losses
are those of a training forward (the same per-token values), with the MTP head evaluated in eval mode too.

Reduction: per token. Each rank sums ``loss x mask`` and the mask over its micro-batches (LM loss, and the MTP loss
over its rolled mask, the positions that have a ``t + 2`` target; under CP over its own rows, the MTP mask rolled
across the CP ranks' edges as in training); one all-reduce of the sums over the world adds the DP replicas, the CP
ranks (each holds other rows of the same packs) and the EP ranks (which hold their own data) of the last pipeline
stage, where the losses are; other stages add zeros. This is the token weighting of training (a CP rank's loss is
its partial, :mod:`dsv4_primitives.cp_partial_loss`). ``eval_lm_loss = sum / tokens`` (nats per token) and ``eval_ppl = exp(eval_lm_loss)``, the
same numbers at every parallel layout.

Record, one line of ``metrics.jsonl`` after the step's training row (strict JSON; training rows never carry
``eval``): ``{"step": S, "eval": true, "eval_lm_loss", "eval_ppl", "eval_mtp_loss" (with MTP), "eval_tokens",
"eval_iters", "eval_time_s"}``; TensorBoard ``eval/lm_loss``, ``eval/ppl``, ``eval/mtp_loss``; points on
``loss.png``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from dsv4_primitives.cp_partial_loss import cp_token_count, loss_denominator
from dsv4_primitives.megatron import cuda_as_cpu
from dsv4_train.config import TrainConfig
from dsv4_train.data import build_batches
from dsv4_train.virtual_pipeline import ddp_chunks
from hybrid_model.mtp import mtp_roll_left


class Evaluator:
    """Evaluates the trainer's model on ``eval_dataset`` (see the module docstring); ``stepper``: the run's
    :class:`~dsv4_train.step.StepRunner` (its ``forward_step`` feeds each micro-batch to the model)."""

    def __init__(
        self, tc: TrainConfig, model_config, eval_dataset, *, stepper, ps, device, world: int
    ) -> None:
        self.tc, self.model_config, self.dataset = tc, model_config, eval_dataset
        self.stepper, self.ps, self.device, self.world = stepper, ps, device, world

    def due(self, step: int) -> bool:
        """Whether an evaluation follows step ``step`` (1-based): every ``--eval-interval`` steps and the last."""
        return step % self.tc.eval.eval_interval == 0 or step == self.tc.schedule.steps

    def batches(self):
        """A fresh iterator over this rank's share of the evaluation batches (the same ones at every evaluation;
        sharded over DP, each CP rank taking its rows of every pack as in training)."""

        return build_batches(
            self.dataset,
            self.tc,
            vocab_size=self.model_config.vocab_size,
            dp_size=self.ps.get_data_parallel_world_size(),
            dp_rank=self.ps.get_data_parallel_rank(),
            cp_size=self.stepper.cp_size,
            cp_rank=self.stepper.cp_rank,
        )

    def _forward_step(self, data_iterator, model):
        """megatron's ``forward_step_func`` of the evaluation: the training forward of one micro-batch, with a
        loss function that reports per-token sums (module docstring)."""

        mb = next(data_iterator)
        out, _ = self.stepper.forward_step(iter([mb]), model)
        core = self.stepper.core
        cp_group = self.stepper.cp_group
        lb = self.stepper.local_batch(mb)  # this rank's rows (under CP: its slice of the pack)
        mask = lb.loss_mask.float()  # [b, s]

        def loss_func(output):
            tokens = mask.sum()
            lm_sum = (output.float() * mask).sum()
            report = {"lm_sum": lm_sum, "lm_tokens": tokens}
            if core.mtp_process and core.last_mtp_loss is not None:
                mtp_mask = mtp_roll_left(mask, lb.packed_seq_params, cp_group)
                # the model's MTP loss is a partial over its rolled mask: times its denominator, this rank's sum
                denominator = loss_denominator(cp_token_count(mtp_mask, cp_group))
                report["mtp_sum"] = core.last_mtp_loss.double() * denominator
                report["mtp_tokens"] = mtp_mask.sum()
            return lm_sum / tokens.clamp(min=1.0), report

        return out, loss_func

    def __call__(self, step: int) -> dict:
        """Evaluate now (after step ``step``); returns the record (module docstring; every rank the same)."""

        tc = self.tc
        t0 = time.perf_counter()
        fb = get_forward_backward_func()
        chunks = ddp_chunks(self.stepper.model)
        sums = torch.zeros(
            4, dtype=torch.float64, device=self.device
        )  # lm sum, lm tokens, mtp sum, mtp tokens
        batches = self.batches()
        for chunk in chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                for _ in range(tc.eval.eval_iters):
                    batch = next(batches)
                    with cuda_as_cpu():
                        reports = fb(**self.stepper.schedule(batch, self._forward_step, forward_only=True))
                    for r in reports:
                        for i, key in enumerate(("lm_sum", "lm_tokens", "mtp_sum", "mtp_tokens")):
                            if key in r:
                                sums[i] += r[key].double()
        finally:
            for chunk in chunks:
                chunk.train()
        if self.world > 1:
            dist.all_reduce(sums)
        lm = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
        m = {
            "step": step,
            "eval": True,
            "eval_lm_loss": lm,
            "eval_ppl": math.exp(lm) if lm < 700 else math.inf,
        }
        if self.model_config.num_nextn_predict_layers:
            m["eval_mtp_loss"] = float(sums[2] / sums[3]) if sums[3] > 0 else float("nan")
        m.update(
            eval_tokens=int(sums[1]), eval_iters=tc.eval.eval_iters, eval_time_s=time.perf_counter() - t0
        )
        return m


def eval_line(m: dict) -> str:
    """The progress note of an evaluation record."""
    parts = [f"eval at step {m['step']}: lm loss {m['eval_lm_loss']:.4f}", f"ppl {m['eval_ppl']:.3f}"]
    if "eval_mtp_loss" in m:
        parts.append(f"mtp loss {m['eval_mtp_loss']:.4f}")
    parts.append(f"{m['eval_tokens']:,} tokens in {m['eval_iters']} batches, {m['eval_time_s']:.1f} s")
    return " | ".join(parts)


__all__ = ["Evaluator", "eval_line"]
