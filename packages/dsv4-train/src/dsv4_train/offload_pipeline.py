"""The pipelined host step of the offloaded optimizer (``dsv4 train --optimizer-cpu-offload
--optimizer-offload-overlap``).

megatron-core 0.19.2's ``HybridDeviceOptimizer`` as we configure it (:mod:`dsv4_train.offload`,
``overlap_cpu_optimizer_d2h_h2d=False``) runs the three parts of the host step one after the other: the D2H copy
of every offloaded fp32 gradient into its pinned host buffer, one torch ``AdamW(fused=True)`` step over all
offloaded fp32 masters on the CPU, then the H2D copy of every master into the model's (bf16) param shard, from
*pageable* memory (megatron pins the bf16 host copy, then ``.float()`` makes an unpinned fp32 master). The step
costs D2H + Adam + H2D.

:class:`OffloadPipeline` replaces that step (the device part, fraction < 1, is unchanged): the offloaded shards are
cut into chunks of ``chunk_numel`` elements; all D2H copies are queued on a side stream with an event per chunk;
the host waits for chunk i's event, runs torch's fused CPU AdamW kernel on chunk i's views (it uses all of torch's
intra-op threads) and queues chunk i's H2D copy on a second stream, while the copy engines move chunk i+1 down and
chunk i-1 up. The fp32 masters are pinned (``.data`` swapped for a pinned copy, the same tensor objects) so the H2D
copies are asynchronous. The step costs about max(D2H, Adam, H2D) plus one chunk.

Bitwise the same as the unpipelined step: AdamW is elementwise, the chunks run the same kernel
(``torch._fused_adamw_``, called as torch's ``AdamW(fused=True)`` calls it, with the param's one step count) on
views of the same tensors, and chunk boundaries are multiples of :data:`ALIGN` elements, so the kernel's vector
lanes and its scalar tail (the last ``numel % 16`` elements of a tensor) cover the same elements as in one call per
tensor. The Adam state lives in the CPU optimizer's ``state`` as torch creates it, so checkpoints are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: default chunk: 8 Mi elements, 32 MiB of fp32 per copy
CHUNK_NUMEL = 1 << 23
#: chunk boundaries are multiples of this many elements (torch's fused CPU Adam works in 64-byte units)
ALIGN = 64


@dataclass(frozen=True)
class HostChunk:
    """One chunk of an offloaded shard: flat views of the same element range ``[start, stop)``."""

    master: torch.Tensor  # [n] fp32 master (pinned host)
    grad: torch.Tensor  # [n] fp32 gradient (pinned host buffer)
    exp_avg: torch.Tensor  # [n] host
    exp_avg_sq: torch.Tensor  # [n] host
    step: torch.Tensor  # [] the shard's Adam step (shared by its chunks)
    group: dict  # the CPU optimizer's param group (lr, betas, weight decay, eps)
    device_param: torch.Tensor  # [n] the model's param shard (bf16 or fp32)
    device_grad: torch.Tensor | None  # [n] fp32 gradient on the device; None: nothing to copy down


def chunk_ranges(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``chunk_numel`` elements covering ``numel`` (the last one shorter)."""
    return [(a, min(a + chunk_numel, numel)) for a in range(0, numel, chunk_numel)]


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(
            f"the offload pipeline needs contiguous tensors, but a {what} is strided; run without "
            "--optimizer-offload-overlap"
        )
    return t.view(-1)


def _adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    """The param's Adam state, created as torch's ``AdamW(fused=True)`` creates it on the first step."""
    state = optimizer.state[param]
    if len(state) == 0:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _check_group(group: dict) -> None:
    if not group.get("fused") or group.get("amsgrad") or group.get("differentiable"):
        raise ValueError(
            "the offload pipeline runs torch's fused AdamW kernel, but the host optimizer's group has "
            f"fused={group.get('fused')}, amsgrad={group.get('amsgrad')}; run without --optimizer-offload-overlap"
        )


def _scalar(x):
    return x.item() if isinstance(x, torch.Tensor) else x


def adamw_chunk(c: HostChunk) -> None:
    """torch's fused AdamW on one chunk, with the arguments ``AdamW(fused=True).step()`` passes (its step count
    already advanced)."""
    g = c.group
    beta1, beta2 = g["betas"]
    torch._fused_adamw_(
        [c.master],
        [c.grad],
        [c.exp_avg],
        [c.exp_avg_sq],
        [],
        [c.step],
        amsgrad=False,
        lr=g["lr"],
        beta1=_scalar(beta1),
        beta2=_scalar(beta2),
        weight_decay=g["weight_decay"],
        eps=g["eps"],
        maximize=g["maximize"],
        grad_scale=None,
        found_inf=None,
    )


def queue_d2h(chunks: list[HostChunk], d2h) -> list:
    """Queue every chunk's gradient copy into its pinned host buffer on ``d2h``; one event per chunk."""
    arrived = []
    with torch.cuda.stream(d2h):
        for c in chunks:
            if c.device_grad is not None:
                c.grad.copy_(c.device_grad, non_blocking=True)
            arrived.append(d2h.record_event())
    return arrived


def device_master_grads(hdo) -> None:
    """What megatron's ``_set_sub_optimizer_grads`` does for the shards *not* offloaded: a bf16 shard's fp32
    master on the device gets the fp32 gradient."""
    for param, fp32_param in hdo.param_to_fp32_param.items():
        if param in hdo.gpu_params_map_cpu_copy:
            continue
        grad = getattr(param, "decoupled_grad", param.grad)
        if grad is not None:
            fp32_param.grad = grad.to(fp32_param.dtype)
            fp32_param.requires_grad = True
        else:
            fp32_param.requires_grad = False


def host_chunks(hdo, chunk_numel: int) -> tuple[list[HostChunk], list[torch.Tensor]]:
    """The chunks of every offloaded shard that AdamW steps this time, and the step counts to advance (one per
    shard). Host gradient buffers and Adam state are created as megatron and torch create them."""
    chunks, steps = [], []
    for optimizer in hdo.cpu_optimizers:
        for group in optimizer.param_groups:
            _check_group(group)
            for master in group["params"]:
                device_param = hdo.cpu_copys_map_gpu_param[master]
                device_grad = getattr(device_param, "decoupled_grad", device_param.grad)
                master.requires_grad = False
                if device_grad is not None and master not in hdo.cpu_copy_map_grad:
                    buf = torch.empty(
                        master.shape, dtype=master.dtype, pin_memory=hdo.pin_cpu_grads, device="cpu"
                    )
                    hdo.cpu_copy_map_grad[master] = master.grad = buf
                if master.grad is None:  # AdamW skips a param without a gradient
                    continue
                state = _adam_state(optimizer, master)
                steps.append(state["step"])
                flat = [
                    _flat(t, what)
                    for t, what in (
                        (master, "host master"),
                        (master.grad, "host gradient"),
                        (state["exp_avg"], "exp_avg"),
                        (state["exp_avg_sq"], "exp_avg_sq"),
                        (device_param, "device param shard"),
                    )
                ]
                dev_grad = _flat(device_grad, "device gradient") if device_grad is not None else None
                for a, b in chunk_ranges(master.numel(), chunk_numel):
                    m, g, v1, v2, d = (t[a:b] for t in flat)
                    chunks.append(
                        HostChunk(
                            m, g, v1, v2, state["step"], group, d, None if dev_grad is None else dev_grad[a:b]
                        )
                    )
    return chunks, steps


class OffloadPipeline:
    """The chunked D2H / host AdamW / H2D step of a ``HybridDeviceOptimizer`` (module doc)."""

    def __init__(self, chunk_numel: int = CHUNK_NUMEL):
        if chunk_numel <= 0 or chunk_numel % ALIGN:
            raise ValueError(
                f"offload pipeline chunk_numel must be a positive multiple of {ALIGN} elements, got {chunk_numel}"
            )
        self.chunk_numel = chunk_numel
        self._streams = None

    def streams(self):
        """(D2H stream, H2D stream), made on first use."""
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def settle(self) -> None:
        """Nothing to wait for: the step is done when it returns (:mod:`dsv4_train.offload_defer` waits here)."""

    @staticmethod
    def pin_host_masters(hdo) -> None:
        """Pin the offloaded fp32 masters in place (``.data`` swapped: the same tensor objects, so megatron's maps
        and the optimizer state keep their keys)."""
        for master in hdo.gpu_params_map_cpu_copy.values():
            if not master.is_pinned():
                master.data = master.data.pin_memory()

    @torch.no_grad()
    def step(self, hdo) -> None:
        """One step of ``hdo``: its device part as megatron runs it, its host part pipelined."""
        hdo._sync_hdo_param_groups_to_sub_optimizers()
        device_master_grads(hdo)
        chunks, steps = host_chunks(hdo, self.chunk_numel)
        d2h, h2d = self.streams()
        current = torch.cuda.current_stream()
        d2h.wait_stream(current)  # the gradients are final on the current stream
        arrived = queue_d2h(chunks, d2h)
        if hdo.gpu_optimizer is not None:  # device AdamW (and megatron's copy-back hook) meanwhile
            hdo.gpu_optimizer.step()
        if steps:
            torch._foreach_add_(steps, 1)  # as torch's fused AdamW: once per param, before the kernel
        h2d.wait_stream(current)
        for c, event in zip(chunks, arrived, strict=True):
            event.synchronize()
            adamw_chunk(c)
            with torch.cuda.stream(h2d):
                c.device_param.copy_(c.master, non_blocking=True)
        current.wait_stream(h2d)  # the next forward reads the params
        h2d.synchronize()  # the host masters are not touched before their copies are done
        hdo._sync_sub_optimizers_state_to_hdo()


__all__ = [
    "ALIGN",
    "CHUNK_NUMEL",
    "HostChunk",
    "OffloadPipeline",
    "adamw_chunk",
    "chunk_ranges",
    "host_chunks",
    "queue_d2h",
]
