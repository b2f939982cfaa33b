"""The memory model of ``dsv4 memory`` (issue 33): static and peak GiB of the busiest rank of a ``dsv4 train``
configuration, and where they go.

    peak = static                                           (:mod:`dsv4_train.memory_static`)
         + Σ_layers kept(layer) · T · in_flight               kept = the layer's activations, or with full recompute
                                                              only its chunk's input streams
         + head + embedding (+ MTP depths when not recomputed; recomputed: the streams between their sub-layers)
         + max over the backward's phases of its transient:
             one MTP sub-layer recomputed (its activations, or the depth's input projections) + the head's backward,
             one recompute chunk (its layers' activations),
             the head's backward: dW (V·d·b) + a logits chunk (min(T·V, 2^28)·b) + dh (fp32 [T, d])
             (--no-fused-linear-ce: the [T, V] fp32 logits and their gradient)
         + the residual streams' gradients (2 · 4·n·d per token)

Tensor parallelism with sequence parallelism (``--tp P``): the static memory holds ``1 / P`` of the TP-split
parameters (:mod:`dsv4_train.memory_static`); a rank's activations per token of its TP group's ``T`` rows are
``split / P + full`` (:mod:`hybrid_model.activation_memory`: sequence rows ``T / P`` for the norms, mHC, router,
routed experts and replicated projections, ``n_h / P`` heads for the head-split parts, the gathered latent / KV /
entries / indices whole); the head's backward holds ``V / P`` of the vocabulary (dW and the logits chunk) and the
gathered ``dh`` fp32 ``[T, d]``; the residual streams' gradients are ``1 / P``. The per-rank TP communication is
:mod:`hybrid_model.tp_comm` (``dsv4 memory --comm``).

``T`` = micro-batch tokens per CP rank (``micro_batch_size · seq_len / CP``); ``in_flight`` = micro-batches whose
activations a pipeline stage holds under 1F1B (``min(PP - stage, M)``; interleaved VPP: megatron's warm-up count
``2·(PP - stage - 1) + (VPP - 1)·PP + 1`` chunk-micro-batches). Activations per token and layer kind:
:mod:`hybrid_model.activation_memory`; context parallelism adds the halo and gathered-entry terms of
:mod:`hybrid_model.cp_memory`. Every stage is evaluated; the report is the stage with the highest peak.

``--offload-activations``: the activations above (what the forward saves) are host memory
(``host_activations``); the device holds one recompute chunk's input copied back during the backward.

Not modelled: selective recompute (refused), the allocator's fragmentation (``reserved - allocated``), CUDA /
NCCL workspaces, the deterministic sparse-attention backward's pair buffer (``--deterministic``, the default with
CUDA: at most csa-kernels' ``launch_config.PAIR_BYTES``, 1 GiB, during one layer's backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4_train.config import TrainConfig
from dsv4_train.memory_static import StaticMemory, stage_params, static_memory
from dsv4_train.model_config import model_config_for
from hybrid_model.activation_memory import (
    checkpoint_bytes,
    embedding_bytes,
    hyper_head_bytes,
    layer_activation_bytes,
    mtp_extra_bytes,
)
from hybrid_model.cp_memory import cp_activation_memory

GIB = 2**30
_LOGITS_CHUNK = 1 << 28  # dsv4_primitives.linear_cross_entropy's logits elements per vocabulary chunk


@dataclass
class MemoryReport:
    """Bytes of the busiest rank: ``static`` (between steps) and ``activations`` / ``transient`` (their parts at
    the peak); ``stage`` its pipeline stage."""

    stage: int
    static: StaticMemory
    activations: dict[str, float] = field(default_factory=dict)
    transient: dict[str, float] = field(default_factory=dict)
    host_offloaded: float = 0.0
    host_activations: float = 0.0  # --offload-activations: the saved activations kept in host memory

    @property
    def peak(self) -> float:
        return self.static.total + sum(self.activations.values()) + sum(self.transient.values())

    def to_dict(self) -> dict:
        gib = lambda parts: {k: v / GIB for k, v in parts.items()}
        return {
            "stage": self.stage,
            "static_gib": self.static.total / GIB,
            "peak_gib": self.peak / GIB,
            "static": gib(self.static.parts()),
            "activations": gib(self.activations),
            "transient": gib(self.transient),
            "host_offloaded_gib": self.host_offloaded / GIB,
            "host_activations_gib": self.host_activations / GIB,
        }


def _in_flight(pp: int, vpp: int, stage: int, microbatches: int) -> float:
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - stage, microbatches))
    chunks = 2 * (pp - stage - 1) + (vpp - 1) * pp + 1
    return min(chunks, microbatches * vpp) / vpp


def _chunks(n_layers: int, method: str | None, num: int | None) -> tuple[int, int]:
    """(layers recomputed, largest chunk) of a stage of ``n_layers`` layers under full recompute."""
    num = num or 1
    if method == "block":
        return min(num, n_layers), 1 if num else 0
    return n_layers, min(num, n_layers)


def estimate_memory(
    tc: TrainConfig, *, dp: int, path: str = "kernels", tp: int | None = None
) -> MemoryReport:
    """The :class:`MemoryReport` of the busiest rank of ``tc`` on ``dp`` data-parallel replicas (world =
    ``dp · tp · pp · cp``; ``path``: ``"kernels"`` on CUDA, ``"reference"`` for the CPU references; ``tp``: the TP
    size modelled, ``tc.parallel.tp`` by default)."""
    par, mem = tc.parallel, tc.memory
    if dp < 1:
        raise ValueError(f"--dp must be >= 1, got {dp}")
    if mem.recompute_granularity == "selective":
        raise ValueError(
            "the memory model covers no recompute and --recompute-granularity full; selective recompute is not "
            "modelled yet"
        )
    tp = par.tp if tp is None else tp
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if (dp * par.cp * tp) % par.ep:
        raise ValueError(f"--ep {par.ep} must divide DP x CP x TP = {dp * par.cp * tp} (the experts' ranks)")
    cfg = model_config_for(tc)
    bf16 = True if tc.precision.bf16 is None else tc.precision.bf16
    b = 2 if bf16 else 4
    seq, mbs = tc.data.seq_len, (1 if tc.data.packed else tc.data.micro_batch_size)
    if (seq * mbs) % (par.cp * tp):
        raise ValueError(
            f"--seq-len x micro-batch ({seq * mbs}) must be a multiple of --cp x --tp ({par.cp * tp}): the sequence "
            "is split over both"
        )
    tokens = seq * mbs / par.cp
    microbatches = max(1, tc.data.global_batch_size // (mbs * dp))
    stages = par.pp * par.vpp
    params = stage_params(cfg, stages, tp)
    full = mem.recompute_granularity == "full"
    n, d, V = cfg.num_streams, cfg.hidden_size, cfg.vocab_size
    reports = []
    for rank in range(par.pp):
        chunks = [rank + v * par.pp for v in range(par.vpp)]  # this rank's virtual stages
        sp = [params[s] for s in chunks]
        merged = type(sp[0])(
            *(sum(getattr(p, f) for p in sp) for f in ("dense_lp", "dense_fp32", "expert", "buffers"))
        )
        static = static_memory(
            merged,
            ep=par.ep,
            dp_shard=dp * par.cp,
            expert_dp_shard=dp * par.cp * tp // par.ep,
            bf16=bf16,
            offload_fraction=tc.optimizer.optimizer_offload_fraction
            if tc.optimizer.optimizer_cpu_offload
            else 0.0,
        )
        report = MemoryReport(rank, static, host_offloaded=static.offloaded)
        flight = _in_flight(par.pp, par.vpp, rank, microbatches)
        acts, trans = report.activations, report.transient
        layers = [li for li in cfg.layers() if not li.mtp_depth and li.stage in chunks]
        per = [layer_activation_bytes(cfg, li.symbol, seq, bf16=bf16, path=path, tp=tp) for li in layers]
        if full:
            recomputed, largest = _chunks(
                len(layers) // par.vpp, mem.recompute_method, mem.recompute_num_layers
            )
            kept = per[recomputed * par.vpp :]
            acts["layers (recompute checkpoints)"] = (
                recomputed * par.vpp * checkpoint_bytes(cfg, b, tp) * tokens * flight
            )
            if kept:
                acts["layers (not recomputed)"] = sum(kept) * tokens * flight
            if largest:
                window = max(sum(per[i : i + largest]) for i in range(len(per) - largest + 1)) if per else 0.0
                trans["recompute chunk"] = window * tokens
        elif per:
            acts["layers"] = sum(per) * tokens * flight
        if par.cp > 1 and layers:
            cp_mem = cp_activation_memory(cfg, seq * mbs, par.cp, pp=stages, path=path)
            acts["CP halo + gathered entries"] = (cp_mem.halo + cp_mem.gathered) * flight * par.vpp
        if rank == 0:
            acts["embedding"] = embedding_bytes(cfg, b, tp) * tokens * flight
        if rank == par.pp - 1:
            acts["final norm + HyperHead + loss input"] = hyper_head_bytes(cfg, b, tp) * tokens
            if tc.precision.fused_linear_ce:  # the rank's V / TP vocabulary; dh of the gathered rows
                head = V * d * b / tp + min(tokens * V / tp, _LOGITS_CHUNK) * b + 4 * d * tokens
            else:
                head = V * d * b / tp + 2 * 4 * tokens * V / tp
            mtp = cfg.parsed_pattern
            sub = [layer_activation_bytes(cfg, s, seq, bf16=bf16, path=path, tp=tp) for s in mtp.mtp_pattern]
            extra = mtp_extra_bytes(cfg, b, tp)
            depth = (sum(sub) + extra) * tokens
            if mtp.mtp_num_depths and full and (mem.recompute_method != "block" or recomputed == len(layers)):
                # one recompute chunk per sub-layer (hybrid-model's run_mtp_depth): the streams between the chunks
                # are kept, a backward recomputes the projections or one layer at a time
                acts["MTP depth checkpoints"] = (
                    (len(sub) + 1) * checkpoint_bytes(cfg, b, tp) * tokens * mtp.mtp_num_depths
                )
                trans["MTP sub-layer recomputed + head backward"] = max([*sub, extra]) * tokens + head
            else:
                if mtp.mtp_num_depths:
                    acts["MTP depths"] = depth * mtp.mtp_num_depths
                trans["head backward (dW, logits chunk, dh)"] = head
            if len(trans) > 1:  # the phases follow one another: only the largest counts
                top = max(trans, key=trans.get)
                report.transient = trans = {top: trans[top]}
        # --offload-activations: what the forward saved lives in host memory until backward reads it
        if tc.memory.offload_activations:
            report.host_activations = sum(acts.values())
            acts.clear()
            if full:  # one chunk's input back on the device while its recompute runs
                acts["a recompute chunk's input, copied back"] = checkpoint_bytes(cfg, b, tp) * tokens
        streams = 4 * n * d if cfg.enable_mhc_connections else b * d
        trans["residual-stream gradients"] = 2 * streams * tokens / tp
        reports.append(report)
    return max(reports, key=lambda r: r.peak)


__all__ = ["GIB", "MemoryReport", "estimate_memory"]
