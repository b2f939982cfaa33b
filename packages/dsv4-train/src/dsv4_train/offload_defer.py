"""The deferred host step of the offloaded optimizer (``dsv4 train --optimizer-cpu-offload
--optimizer-offload-overlap --optimizer-offload-defer``): step k's host AdamW runs while step k+1's forward runs.

:class:`~dsv4_train.offload_pipeline.OffloadPipeline` already overlaps the three parts of the host step (D2H of
the gradients, torch's fused CPU AdamW, H2D of the updated fp32 masters) in chunks, but ``optimizer.step()``
returns only when the last chunk is back, so the host AdamW is on the critical path of every step.
:class:`DeferredHostStep` takes it off:

* ``optimizer.step()`` (megatron's: gradient norm and clipping on the device, then each hybrid optimizer's step)
  runs the device part (``F < 1``) and advances the Adam step counts as the pipeline does, but only *collects* the
  host chunks; :meth:`DeferredHostStep.launch` (the trainer calls it right after the step) orders them as the next
  forward uses the params (the order in which the modules owning them ran their forward: embedding, layer by
  layer, MTP, head) and hands them to a host thread. That thread queues every chunk's D2H copy on a side stream,
  then per chunk waits for its copy, runs the fused CPU AdamW kernel (torch's CPU kernels release the GIL), queues
  the H2D copy into the model's param on a second stream, records a CUDA event and sets a ``threading.Event``.
* What waits where: a forward pre-hook on every module owning params waits (host side) for the chunk event of the
  last chunk of that module's params and makes the current stream wait on its CUDA event; the chunks are processed
  in order, so every earlier module's params (e.g. the tied embedding read by the head) are done too. The next
  step's grad-buffer zeroing (:meth:`zero_grad_buffers`) waits until the D2H copies are queued and zeroes on the D2H
  stream behind them; the first backward waits on that (:meth:`before_backward`). Everything else that reads or
  writes params, gradients or Adam state calls :meth:`finish` (wait for the whole host step): the next
  optimizer step, checkpoint saves and loads (also the optimizer's own ``state_dict`` / ``sharded_state_dict``),
  evaluation, the end of a run and ``Trainer.close``. An exception in the host thread is raised in the main thread
  at the next wait, chained to the host thread's traceback (the thread sets every event on the way out: no hang).
* megatron's distributed optimizer all-gathers the updated param shards right after its step; with one
  data-parallel rank that gather is a no-op on the local buffer, and it is switched off here (megatron's own
  ``_defer_param_sync``) because it would read the params while the host thread writes them. With more
  data-parallel (or context-parallel) ranks the gather needs every rank's updated shards at the end of the step,
  which deferral cannot give without changing megatron's param gather: refused (:class:`DeferredHostStep` and the
  support table).

Exactness: the chunks, the kernel and its arguments are the pipeline's (only the order of the chunks differs, and
AdamW is elementwise), the hyper-parameters are read at step time, and no value is read before it is written:
losses, gradient norms, params and Adam state are bitwise those of ``--optimizer-offload-overlap``. No new state:
checkpoints are the same and interchangeable both ways.

Why a flag of its own (needing ``--optimizer-offload-overlap``) rather than a mode of it: the pipelined step is
self-contained inside ``optimizer.step()``, while deferral changes what the rest of a step may do (hooks on the
model, the grad-buffer zeroing, the param gather) and is limited to one data-parallel rank.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_right
from dataclasses import dataclass, field, replace

import torch
from megatron.core.optimizer import ChainedOptimizer

from dsv4_train.offload import hybrid_optimizers
from dsv4_train.offload_pipeline import (
    HostChunk,
    OffloadPipeline,
    adamw_chunk,
    device_master_grads,
    host_chunks,
    queue_d2h,
)


@dataclass
class _Job:
    """One deferred host step: its chunks in forward order and what the host thread signals."""

    chunks: list[HostChunk]
    last_chunk: dict[int, int]  # id(module) -> index of the last chunk holding that module's params
    ready: list[threading.Event] = field(default_factory=list)  # chunk i's H2D copy queued
    h2d_events: list = field(default_factory=list)  # chunk i's H2D copy done (CUDA event)
    copied: threading.Event = field(default_factory=threading.Event)  # every D2H copy queued
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class DeferredPipeline(OffloadPipeline):
    """A hybrid optimizer's step whose host part is collected for :class:`DeferredHostStep` instead of run."""

    def __init__(self, owner: DeferredHostStep, chunk_numel: int):
        super().__init__(chunk_numel)
        self.owner = owner

    def settle(self) -> None:
        self.owner.finish()

    @torch.no_grad()
    def step(self, hdo) -> None:
        self.owner.wait_launched()  # the previous host step is done before this one reads its state
        hdo._sync_hdo_param_groups_to_sub_optimizers()
        device_master_grads(hdo)
        chunks, steps = host_chunks(hdo, self.chunk_numel)
        if hdo.gpu_optimizer is not None:  # device AdamW (and megatron's copy-back hook) now, on the device
            hdo.gpu_optimizer.step()
        if steps:
            torch._foreach_add_(steps, 1)  # as torch's fused AdamW: once per param, before the kernel
        hdo._sync_sub_optimizers_state_to_hdo()
        groups = {}  # the hyper-parameters of this step (the scheduler may change the groups meanwhile)
        self.owner.collect([replace(c, group=groups.setdefault(id(c.group), dict(c.group))) for c in chunks])


class ForwardOrder:
    """Which module's forward waits for which param, in the order the forward first ran the modules.

    A param belongs to the first module owning it directly (a tied embedding: the embedding). Its waiter is its
    owner if the owner's forward ran, else the nearest ancestor whose forward ran: a param read without its owner's
    forward (the DSv4 head's weight, read by the fused linear cross-entropy in the model's own forward; tests check
    this on the DSv4 model) is read inside some ancestor's forward, whose pre-hook runs before that read.
    ``record`` (a forward pre-hook on every module) notes the order."""

    def __init__(self, model_chunks: list[torch.nn.Module]):
        self.modules = [m for chunk in model_chunks for m in chunk.modules()]
        self.parent = {id(c): m for m in self.modules for c in m.children()}
        self.rank: dict[int, int] = {}  # id(module) -> place of its first forward

    def record(self, module) -> None:
        self.rank.setdefault(id(module), len(self.rank))

    def waiter(self, module) -> tuple[float, int]:
        """(rank, id) of the module whose forward waits for ``module``'s params (``inf`` if none ran yet)."""
        m = module
        while m is not None and id(m) not in self.rank:
            m = self.parent.get(id(m))
        return (math.inf, id(module)) if m is None else (self.rank[id(m)], id(m))

    def params(self) -> list[tuple[torch.nn.Parameter, torch.nn.Module]]:
        """Every param with its first owner."""
        seen, out = set(), []
        for m in self.modules:
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((p, m))
        return out


def _wrappers(optimizer) -> list:
    return optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]


class DeferredHostStep:
    """Runs the host part of ``optimizer``'s offloaded step in a host thread, behind the next forward of
    ``model_chunks`` (the DDP-wrapped model chunks); see the module doc. The optimizer must be built with the
    pipelined step (``--optimizer-offload-overlap``) on one data-parallel rank."""

    def __init__(self, optimizer, model_chunks: list[torch.nn.Module]):
        hdos = hybrid_optimizers(optimizer)
        if not hdos or any(h.pipeline is None for h in hdos):
            raise ValueError(
                "--optimizer-offload-defer defers the pipelined host step: it needs --optimizer-cpu-offload "
                "--optimizer-offload-overlap; add them"
            )
        for chunk in model_chunks:
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if group.intra_distributed_optimizer_instance_size > 1:
                    raise ValueError(
                        "--optimizer-offload-defer runs on one data-parallel rank (the distributed optimizer "
                        "all-gathers the updated param shards right after its step), got a data-parallel group "
                        f"of {group.intra_distributed_optimizer_instance_size}; drop --optimizer-offload-defer"
                    )
        self._hdos, self._wrappers = hdos, _wrappers(optimizer)
        for (
            wrapper
        ) in self._wrappers:  # one rank: the param gather is a no-op that would race the host thread
            wrapper._defer_param_sync = True
        for hdo in hdos:
            hdo.pipeline = DeferredPipeline(self, hdo.pipeline.chunk_numel)
        self._stream_pair = None  # (D2H stream, H2D stream), made on the first launch (main thread)
        self._pending: list[HostChunk] = []
        self._job: _Job | None = None
        self._zeroed = None  # CUDA event: the grad buffers are zeroed behind the D2H copies
        self.order = ForwardOrder(model_chunks)
        self._hooks = [m.register_forward_pre_hook(self._before_forward) for m in self.order.modules]

    # ------------------------------------------------------------------ the step
    def _streams(self):
        if self._stream_pair is None:
            self._stream_pair = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._stream_pair

    def collect(self, chunks: list[HostChunk]) -> None:
        """Add a hybrid optimizer's host chunks to this step (:class:`DeferredPipeline`)."""
        self._pending.extend(chunks)

    def _forward_order(self, chunks: list[HostChunk]) -> tuple[list[HostChunk], dict[int, int]]:
        spans = []  # (start address, end address, waiter) of every param
        for p, owner in self.order.params():
            spans.append(
                (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), self.order.waiter(owner))
            )
        spans.sort(key=lambda s: s[0])
        starts = [s[0] for s in spans]

        def waiter(c: HostChunk) -> tuple[float, int | None]:
            i = bisect_right(starts, c.device_param.data_ptr()) - 1
            return spans[i][2] if i >= 0 and c.device_param.data_ptr() < spans[i][1] else (math.inf, None)

        waiters = [waiter(c) for c in chunks]
        order = sorted(range(len(chunks)), key=lambda i: waiters[i][0])
        last = {waiters[i][1]: k for k, i in enumerate(order) if waiters[i][1] is not None}
        return [chunks[i] for i in order], last

    def launch(self) -> None:
        """Start the host thread on the chunks this step collected (no-op without any)."""
        if not self._pending:
            return
        self.wait_launched()
        chunks, last = self._forward_order(self._pending)
        self._pending = []
        job = _Job(chunks, last, [threading.Event() for _ in chunks], [None] * len(chunks))
        self._streams()
        grads_final = torch.cuda.current_stream().record_event()  # clipped gradients, on the current stream
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._job = job
        threading.Thread(
            target=self._run, args=(job, grads_final, device), name="dsv4-offload-defer", daemon=True
        ).start()
        if not self.order.rank:  # no forward ran yet: no order to wait in, nothing may run ahead
            self.wait_launched()

    def _run(self, job: _Job, grads_final, device) -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            d2h, h2d = self._streams()
            with torch.no_grad():
                d2h.wait_event(grads_final)
                arrived = queue_d2h(job.chunks, d2h)
                job.copied.set()
                for i, (c, event) in enumerate(zip(job.chunks, arrived, strict=True)):
                    event.synchronize()
                    adamw_chunk(c)
                    with torch.cuda.stream(h2d):
                        c.device_param.copy_(c.master, non_blocking=True)
                    job.h2d_events[i] = h2d.record_event()
                    job.ready[i].set()
                h2d.synchronize()  # the host masters are not touched (next step) before their copies are done
        except BaseException as e:  # raised in the main thread at its next wait
            job.error = e
        finally:
            job.copied.set()
            for event in job.ready:
                event.set()
            job.done.set()

    # ------------------------------------------------------------------ waits
    def _check(self, job: _Job) -> None:
        if job.error is not None:
            self._job = None
            raise RuntimeError(
                "the deferred host AdamW step (--optimizer-offload-defer) failed in its host thread: "
                f"{job.error!r} (its traceback above); the params are not all updated, do not save them"
            ) from job.error

    def wait_launched(self) -> None:
        """Wait for the running host step (not for chunks collected but not launched yet)."""
        job = self._job
        if job is None:
            return
        job.done.wait()
        self._check(job)
        self._job = None
        if job.h2d_events:  # the device work after this waits for the last H2D copy (and so for all)
            torch.cuda.current_stream().wait_event(job.h2d_events[-1])

    def finish(self) -> None:
        """Finish the deferred step: everything after this call sees the updated params and Adam state."""
        self.launch()
        self.wait_launched()

    def _before_forward(self, module, args) -> None:
        self.order.record(module)
        self.launch()
        job = self._job
        i = None if job is None else job.last_chunk.get(id(module))
        if i is None:
            return
        job.ready[i].wait()
        self._check(job)
        torch.cuda.current_stream().wait_event(job.h2d_events[i])

    def zero_grad_buffers(self, model_chunks) -> None:
        """``zero_grad_buffer()`` of each DDP chunk, behind the deferred step's D2H copies (on their stream)."""
        self.launch()
        job = self._job
        if job is None:
            for chunk in model_chunks:
                chunk.zero_grad_buffer()
            return
        job.copied.wait()
        self._check(job)
        d2h, _ = self._streams()
        with torch.cuda.stream(d2h):
            for chunk in model_chunks:
                chunk.zero_grad_buffer()
            self._zeroed = d2h.record_event()

    def before_backward(self) -> None:
        """The current stream waits for the grad buffers' zeroing (:meth:`zero_grad_buffers`) before gradients
        accumulate into them."""
        if self._zeroed is not None:
            torch.cuda.current_stream().wait_event(self._zeroed)
            self._zeroed = None

    def close(self) -> None:
        """Finish the deferred step, remove the forward hooks; the optimizer steps pipelined again."""
        try:
            self.finish()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            for hdo in self._hdos:
                hdo.pipeline = OffloadPipeline(hdo.pipeline.chunk_numel)
            for wrapper in self._wrappers:
                wrapper._defer_param_sync = False


__all__ = ["DeferredHostStep", "DeferredPipeline", "ForwardOrder"]
