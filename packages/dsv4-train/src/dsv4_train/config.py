"""``TrainConfig``: everything ``dsv4 train`` needs besides the model architecture (a preset + overrides)."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_train.cuda_graph import check_cuda_graph_config


@dataclass
class TrainConfig:
    """Training-run settings (CLI flags map 1:1 onto these fields; a JSON/YAML-free ``--config`` file may set any).

    ``model_overrides`` changes fields of the preset's :class:`~hybrid_model.config.DSv4ModelConfig`.
    ``init_from`` initialises the weights from a dist checkpoint (any parallel layout) when not resuming.
    ``bf16``: mixed precision as in megatron's training loop (bf16 params and activations, fp32 main params and
    gradient reduction in the optimizer, the keep-in-fp32 tensors — mHC, attention sinks, compressor ``ape``, the
    router selection bias — fp32); ``None`` (the default) resolves to ``True`` on CUDA and ``False`` on CPU.
    ``lr_decay_style``: ``"cosine"`` (warm-up, then cosine decay to ``min_lr``) or ``"wsd"`` (warm-up, constant
    ``lr``, then a cosine anneal over the last ``lr_wsd_decay_steps`` steps). ``mtp_loss_weight_decay``: the MTP loss
    weight from the first step of the LR decay on (spec §8: the preset's 0.3, then 0.1); ``None`` (config file:
    ``null``) keeps the preset's weight throughout. See :meth:`lr_decay_start` and :meth:`mtp_weight_at`.
    ``cuda_graph``: capture each training step's forward + backward (all micro-batches) in one CUDA graph with
    megatron-core's ``FullCudaGraphWrapper`` after ``cuda_graph_warmup_steps`` eager steps, then replay it (the
    optimizer step stays eager). One model-parallel rank (TP = PP = EP = CP = 1); fixed-length ``[B, S]`` batches at
    any number of data-parallel ranks (the DP gradient reduction runs eagerly after each replay:
    :mod:`dsv4_train.graph_data_parallel`), or ``packed`` batches on one process (static-shape THD with
    device-side document boundaries, :mod:`dsv4_train.graph_packs`); see
    :mod:`dsv4_train.cuda_graph`.
    ``dist_backend``: the ``torch.distributed`` backend of a multi-process run, ``"nccl"`` or ``"gloo"``; ``None``
    resolves to ``"nccl"`` on CUDA and ``"gloo"`` on CPU. ``"gloo"`` on CUDA runs several processes on one GPU
    (tests; :mod:`dsv4_train.gloo_cuda`).
    ``max_docs_per_pack``: the document capacity of a packed micro-batch (``None``: derived, see
    :func:`dsv4_train.graph_packs.max_docs_per_pack`).
    ``data``: text sources read in order (empty: the embedded default corpus); ``long_docs``: ``"split"`` documents
    longer than ``seq_len`` into several sequences or ``"truncate"`` them; ``skip_bad_records``: skip and count bad
    records instead of stopping at the first (see :mod:`dsv4_train.data`).
    ``optimizer_impl``: the kernel of megatron's torch AdamW (:mod:`dsv4_train.optimizer`): ``"auto"``
    (fused on CUDA, megatron's own choice on CPU), ``"fused"``, ``"foreach"`` or ``"unfused"`` (megatron's
    optimizer as built); checkpoints are the same whichever is used. ``optimizer_cpu_offload``: megatron's
    ``HybridDeviceOptimizer`` keeps the fp32 masters and Adam moments of ``optimizer_offload_fraction`` of the
    params in host memory and steps them on the CPU (:mod:`dsv4_train.offload`; CUDA only; checkpoints
    interchangeable with non-offloaded runs). ``fused_linear_ce``: the main and MTP head
    losses through dsv4-primitives' ``linear_cross_entropy`` (no ``[s, b, V]`` logits); ``False``: the output
    layer's logits, then the fused cross entropy.
    ``resume``: ``False`` (a new run; ``out`` must not hold one unless ``overwrite``), ``True`` (continue from
    ``out/checkpoints/latest``, which must exist) or ``"auto"`` (continue when there is a checkpoint, else start
    fresh: job requeues). ``overwrite``: delete the previous run's outputs in ``out`` (metrics, TensorBoard events,
    checkpoints) before a new run. ``max_nonfinite_steps``: a step with a non-finite loss or gradient is skipped
    (no update); this many in a row stop the run (:class:`~dsv4_train.step.TrainingDiverged`).
    ``deterministic``: every kernel of a step deterministic, so two runs with the same seed give bitwise-identical
    losses and gradients (eager and ``--cuda-graph``; see :mod:`dsv4_train.determinism`).
    ``vpp``: virtual pipeline stages per pipeline rank (megatron's interleaved schedule; each rank holds ``vpp``
    model chunks, see :mod:`dsv4_train.virtual_pipeline`). ``ckpt_format``: the distributed optimizer's
    checkpoint format, ``"dp_reshardable"`` (resumable at another DP size) or ``"fully_reshardable"`` (also at
    another PP size; gathers each stage's optimizer state over DP to write it).
    ``recompute_*`` / ``mhc_recompute_layer_num``: activation recompute (:mod:`dsv4_train.recompute`).
    ``data`` may instead be ``["mock[:KEY=VALUE,...]"]``, thd-packing's mock variable-length dataset
    (:mod:`dsv4_train.mock_data`). ``eval_interval``: evaluate every N steps and at the end (0: never) on
    ``eval_iters`` global batches of ``eval_data`` (text sources), else of a held-out split of the training data or a
    separate mock stream (:mod:`dsv4_train.eval_data`, :mod:`dsv4_train.evaluation`).
    """

    preset: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    steps: int = 150
    seq_len: int = 256
    global_batch_size: int = 8
    micro_batch_size: int = 4
    packed: bool = False
    max_docs_per_pack: int | None = None
    dense_steps: int = 0
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    lr_decay_style: str = "cosine"
    lr_wsd_decay_steps: int = 0
    mtp_loss_weight_decay: float | None = 0.1
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    balance_loss_coeff: float = 1e-4
    indexer_loss_coeff: float = 1.0
    seed: int = 1234
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    cp: int = 1
    cp_layout: str = "contiguous"
    data: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    long_docs: str = "split"
    skip_bad_records: bool = False
    out: str = "runs/dsv4"
    resume: bool | str = False
    overwrite: bool = False
    init_from: str | None = None
    save_interval: int = 0
    save_final: bool = True
    ckpt_format: str = "dp_reshardable"
    log_interval: int = 10
    peak_tflops: float | None = None
    progress: bool = True
    bf16: bool | None = None
    cuda_graph: bool = False
    cuda_graph_warmup_steps: int = 2
    dist_backend: str | None = None
    optimizer_impl: str = "auto"
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    fused_linear_ce: bool = True
    max_nonfinite_steps: int = 5
    deterministic: bool = False
    recompute_granularity: str | None = None
    recompute_modules: list[str] = field(default_factory=list)
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    mhc_recompute_layer_num: int | None = None
    eval_interval: int = 0
    eval_iters: int = 10
    eval_data: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.data, str):  # a config file's "data": "path" means one source
            self.data = [self.data]
        if isinstance(self.eval_data, str):
            self.eval_data = [self.eval_data]
        check_field_types(self)
        if self.bf16 is None:
            import torch

            self.bf16 = torch.cuda.is_available()
        from dsv4_train.setup import resolve_dist_backend

        self.dist_backend = resolve_dist_backend(self.dist_backend)
        for name in (
            "steps",
            "seq_len",
            "global_batch_size",
            "micro_batch_size",
            "tp",
            "pp",
            "vpp",
            "ep",
            "cp",
            "log_interval",
            "max_nonfinite_steps",
            "eval_iters",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.vpp > 1:
            from dsv4_train.virtual_pipeline import check_vpp_config

            check_vpp_config(self)
        if self.max_docs_per_pack is not None and not self.packed:
            raise ValueError("--max-docs-per-pack only applies with --packed")
        if self.max_docs_per_pack is not None and self.max_docs_per_pack < 1:
            raise ValueError(f"--max-docs-per-pack must be >= 1, got {self.max_docs_per_pack}")
        if self.cuda_graph_warmup_steps < 1:
            raise ValueError(f"--cuda-graph-warmup-steps must be >= 1, got {self.cuda_graph_warmup_steps}")
        from dsv4_train.context_parallel import check_context_parallel_config

        check_context_parallel_config(self)
        if not 0.0 < self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"--optimizer-offload-fraction must be in (0, 1], got {self.optimizer_offload_fraction}"
            )
        if self.optimizer_cpu_offload and self.optimizer_impl not in ("auto", "unfused"):
            raise ValueError(
                f"--optimizer-cpu-offload uses megatron's hybrid optimizer (torch AdamW(fused=True) on the host and "
                f"the GPU); --optimizer-impl {self.optimizer_impl} cannot apply: use --optimizer-impl auto"
            )
        if self.optimizer_cpu_offload and self.cuda_graph:
            raise ValueError(
                "--optimizer-cpu-offload with --cuda-graph: not supported (the graphs capture forward+backward; the "
                "offloaded step and its host copies stay eager, but megatron's hybrid optimizer was not tested "
                "with the graphed runner); drop one of them"
            )
        if self.cuda_graph:
            check_cuda_graph_config(self)
        from dsv4_train.optimizer import OPTIMIZER_IMPLS

        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(
                f"--optimizer-impl must be one of {OPTIMIZER_IMPLS}, got {self.optimizer_impl!r}"
            )
        from dsv4_train.recompute import recompute_config

        recompute_config(self)  # the --recompute-* flags
        if self.dense_steps < 0 or self.save_interval < 0 or self.warmup_steps < 0:
            raise ValueError("--dense-steps, --save-interval and --warmup-steps must be >= 0")
        if self.tp != 1:
            raise ValueError(
                "--tp must be 1: DSv4 attention supports tensor parallelism 1 only (use DP/PP/EP)"
            )
        from dsv4_train.checkpoint import DISTOPT_FORMATS

        if self.ckpt_format not in DISTOPT_FORMATS:
            raise ValueError(f"--ckpt-format must be one of {DISTOPT_FORMATS}, got {self.ckpt_format!r}")
        if self.long_docs not in ("split", "truncate"):
            raise ValueError(f"--long-docs must be 'split' or 'truncate', got {self.long_docs!r}")
        if self.lr_decay_style not in ("cosine", "wsd"):
            raise ValueError(f"--lr-decay-style must be 'cosine' or 'wsd', got {self.lr_decay_style!r}")
        if self.lr_decay_style == "wsd" and not 0 < self.lr_wsd_decay_steps <= self.steps:
            raise ValueError(
                f"--lr-decay-style wsd needs 0 < --lr-wsd-decay-steps <= --steps ({self.steps}), "
                f"got {self.lr_wsd_decay_steps}"
            )
        if self.lr_decay_style != "wsd" and self.lr_wsd_decay_steps:
            raise ValueError("--lr-wsd-decay-steps only applies to --lr-decay-style wsd")
        if self.mtp_loss_weight_decay is not None and not self.mtp_loss_weight_decay >= 0:
            raise ValueError(f"--mtp-loss-weight-decay must be >= 0, got {self.mtp_loss_weight_decay}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(
                f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={self.lr}, min_lr={self.min_lr}"
            )
        for name in ("weight_decay", "clip_grad", "balance_loss_coeff", "indexer_loss_coeff", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be > 0, got {self.peak_tflops}")
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"resume must be true, false or 'auto', got {self.resume!r}")
        if self.resume is True and self.init_from:
            raise ValueError(
                "--init-from starts a new run from other weights, --resume continues from this run's checkpoint: "
                "drop one (with --resume auto, --init-from applies when the run starts fresh)"
            )
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: continue the run or replace it")
        if self.eval_interval < 0:
            raise ValueError(f"--eval-interval must be >= 0 (0: no evaluation), got {self.eval_interval}")
        if self.eval_data and not self.eval_interval:
            raise ValueError("--eval-data only applies with --eval-interval N (N > 0)")
        from dsv4_train.mock_data import check_mock_data, is_mock

        if any(is_mock(s) for s in self.eval_data):
            raise ValueError(
                "--eval-data takes text sources; with --data mock[:...] the evaluation reads a separate mock stream "
                "by itself"
            )
        check_mock_data(self)

    def lr_decay_start(self) -> int:
        """0-based index of the first optimizer step whose LR is below the peak: the step after the warm-up
        (cosine) or after the constant phase (WSD), with the scheduler's warm-up ``min(warmup_steps, steps - 1)``
        (megatron's scheduler is at the peak exactly at the end of the warm-up / the constant phase)."""
        warmup = min(self.warmup_steps, self.steps - 1)
        if self.lr_decay_style == "wsd":
            return max(warmup, self.steps - self.lr_wsd_decay_steps) + 1
        return warmup + 1

    def mtp_weight_at(self, step: int, base_weight: float) -> float:
        """MTP loss weight of optimizer step ``step`` (0-based): ``base_weight`` until the LR decay starts,
        ``mtp_loss_weight_decay`` from its first step on. A base weight of 0 (MTP switched off by weight) and
        ``mtp_loss_weight_decay=None`` keep the base weight throughout."""
        if self.mtp_loss_weight_decay is None or base_weight == 0 or step < self.lr_decay_start():
            return base_weight
        return self.mtp_loss_weight_decay

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """Read a JSON config file (keys = field names); ``overrides`` (explicit CLI flags) win."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError as e:
            raise ValueError(f"config file {p} does not exist") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {p} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a JSON object of TrainConfig fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config file {p}: unknown keys {unknown}; valid keys: {sorted(known)}")
        for key in ("data", "eval_data"):
            if isinstance(data.get(key), str):  # "data": "path" means one source
                data[key] = [data[key]]
        hints = typing.get_type_hints(cls)
        for key, value in data.items():
            if key not in overrides and not _has_type(value, hints[key]):
                raise ValueError(
                    f"config file {p}: key {key!r} must be {_type_name(hints[key])}, got {value!r} "
                    f"({type(value).__name__})"
                )
        data.update(overrides)
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"config file {p} (with the command-line flags on top): {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _has_type(value: Any, hint: Any) -> bool:
    """Whether the JSON value ``value`` fits the field annotation ``hint`` (ints are floats; bools are not numbers;
    numbers must be finite)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, h) for h in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_has_type(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        type(None): "null",
    }
    if hint in names:
        return names[hint]
    origin = typing.get_origin(hint)
    if origin is list:
        return f"a list of {_type_name(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "an object"
    return getattr(hint, "__name__", str(hint))


def check_field_types(tc: TrainConfig) -> None:
    """``ValueError`` naming the field, the expected type and the value when a field of ``tc`` has the wrong type
    (or a non-finite number): the one check behind the CLI flags, ``--config`` files and Python callers."""
    hints = typing.get_type_hints(type(tc))
    for f in dataclasses.fields(tc):
        value = getattr(tc, f.name)
        if not _has_type(value, hints[f.name]):
            raise ValueError(
                f"--{f.name.replace('_', '-')} ({f.name}) must be {_type_name(hints[f.name])}, got {value!r}"
            )
