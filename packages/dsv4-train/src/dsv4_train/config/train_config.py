"""``TrainConfig``: a ``dsv4 train`` run as a tree of small frozen sections (:mod:`dsv4_train.config.sections`).

Each section validates itself; the rules between sections (which features combine) are the support table's
(:mod:`dsv4_train.support`), checked when the tree is built. Nothing here touches a device or the environment:
values left to the machine (``precision.bf16``, ``precision.deterministic``, ``parallel.dist_backend``) stay
``None`` until :func:`effective_config` resolves them at the start of a run.

Three spellings of the same settings: the tree (``tc.data.seq_len``), a nested dict / ``--config`` JSON file with
the section names as keys (``{"data": {"seq_len": 512}}``), and the flat field names of the command-line flags
(``seq_len=512`` for ``--seq-len 512``; :meth:`TrainConfig.from_flat`). Field names are unique across sections, so
a run directory written by an older version (a flat JSON object) still reads.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_train.config.fields import flag_of, has_type, type_name
from dsv4_train.config.run_sections import (
    CheckpointSection,
    EvalSection,
    GraphsSection,
    LoggingSection,
    MemorySection,
    ParallelSection,
    PrecisionSection,
)
from dsv4_train.config.sections import (
    DataSection,
    LossSection,
    ModelSection,
    OptimizerSection,
    ScheduleSection,
)
from dsv4_train.mock_data import check_mock_data, is_mock
from dsv4_train.recompute import recompute_config
from dsv4_train.support import check_config_relations


@dataclass(frozen=True)
class TrainConfig:
    """The settings of a ``dsv4 train`` run besides the architecture (a preset + overrides), by section."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    loss: LossSection = field(default_factory=LossSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    memory: MemorySection = field(default_factory=MemorySection)
    graphs: GraphsSection = field(default_factory=GraphsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), SECTION_TYPES[f.name]):
                raise ValueError(
                    f"TrainConfig.{f.name} must be a {SECTION_TYPES[f.name].__name__}, got "
                    f"{type(getattr(self, f.name)).__name__} (TrainConfig.from_flat takes flag names)"
                )
        check_config_relations(self)
        self._check_values()

    def _check_values(self) -> None:
        """The rules between values of different sections (the rules between features are the support table's)."""
        steps, opt = self.schedule.steps, self.optimizer
        if opt.lr_decay_style == "wsd" and not 0 < opt.lr_wsd_decay_steps <= steps:
            raise ValueError(
                f"--lr-decay-style wsd needs 0 < --lr-wsd-decay-steps <= --steps ({steps}), "
                f"got {opt.lr_wsd_decay_steps}"
            )
        cp, tp, seq_len = self.parallel.cp, self.parallel.tp, self.data.seq_len
        # under CP every CP rank holds seq_len / cp rows per sequence (static shapes); under TP x CP sequence
        # parallelism cuts them over TP as well (under TP alone a pack is padded to a multiple of TP instead)
        div = cp * tp if tp > 1 else cp
        if cp > 1 and seq_len % div:
            what = "pack capacity" if self.data.packed else "sequence length"
            need = f"--cp {cp}" if tp == 1 else f"--cp x --tp ({cp} x {tp} = {div})"
            why = "" if tp == 1 else ", which sequence parallelism cuts over the TP ranks"
            raise ValueError(
                f"--seq-len {seq_len} (the {what}) must be a multiple of {need}: every CP rank holds the same "
                f"number of rows (static shapes){why}; use --seq-len {(seq_len // div + 1) * div} or another multiple"
            )
        if any(is_mock(s) for s in self.eval.eval_data):
            raise ValueError(
                "--eval-data takes text sources; with --data mock[:...] the evaluation reads a separate mock stream "
                "by itself"
            )
        check_mock_data(self)  # the mock spec against --seq-len; text-only flags refused with mock data
        recompute_config(self)  # the --recompute-* combination

    # --- the three spellings --------------------------------------------------------------------------------------

    @classmethod
    def from_flat(cls, **values: Any) -> TrainConfig:
        """A config from flat field names (the flags' names: ``seq_len=512``); unknown names are refused."""
        values = {LEGACY_KEYS.get(k, k): v for k, v in values.items()}
        unknown = sorted(set(values) - set(SECTION_OF))
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}; valid fields: {sorted(SECTION_OF)}")
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            by_section.setdefault(SECTION_OF[name], {})[name] = value
        return cls(**{s: SECTION_TYPES[s](**kw) for s, kw in by_section.items()})

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "config") -> TrainConfig:
        """A config from a nested dict (section names as keys) or a flat one (field names, as older run
        directories wrote it); ``ValueError`` naming ``where`` and the key for an unknown key or a wrong type."""
        return cls.from_flat(**flatten(data, where=where))

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """Read a JSON config file (nested by section, or flat); ``overrides`` (explicit flags, flat names) win.
        ``model_overrides`` merges key by key: the file's entries stay unless a flag (``--model-overrides``,
        ``--pattern``, ``--no-mhc``) sets the same key."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError as e:
            raise ValueError(f"config file {p} does not exist") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {p} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a JSON object of TrainConfig sections")
        flat = flatten(data, where=f"config file {p}")
        if isinstance(flat.get("model_overrides"), dict) and isinstance(
            overrides.get("model_overrides"), dict
        ):
            overrides = {
                **overrides,
                "model_overrides": {**flat["model_overrides"], **overrides["model_overrides"]},
            }
        flat = {k: v for k, v in flat.items() if k not in overrides}
        try:
            return cls.from_flat(**flat, **overrides)
        except ValueError as e:
            raise ValueError(f"config file {p} (with the command-line flags on top): {e}") from e

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The nested dict (section -> field -> JSON value) that ``--config`` files and run directories hold."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def flat(self) -> dict[str, Any]:
        """Field name -> value (the flags' names)."""
        return {name: value for section in self.to_dict().values() for name, value in section.items()}

    def replace(self, **values: Any) -> TrainConfig:
        """A copy with some fields (flat names) changed; the result is validated like any config."""
        return TrainConfig.from_flat(**{**self.flat(), **values})

    # --- derived schedule -----------------------------------------------------------------------------------------

    def lr_decay_start(self) -> int:
        """0-based index of the first optimizer step whose LR is below the peak: the step after the warm-up
        (cosine) or after the constant phase (WSD), with the scheduler's warm-up ``min(warmup_steps, steps - 1)``
        (megatron's scheduler is at the peak exactly at the end of the warm-up / the constant phase)."""
        steps, opt = self.schedule.steps, self.optimizer
        warmup = min(opt.warmup_steps, steps - 1)
        if opt.lr_decay_style == "wsd":
            return max(warmup, steps - opt.lr_wsd_decay_steps) + 1
        return warmup + 1

    def mtp_weight_at(self, step: int, base_weight: float) -> float:
        """MTP loss weight of optimizer step ``step`` (0-based): ``base_weight`` until the LR decay starts,
        ``loss.mtp_loss_weight_decay`` from its first step on. A base weight of 0 (MTP switched off by weight) and
        ``mtp_loss_weight_decay=None`` keep the base weight throughout."""
        decay = self.loss.mtp_loss_weight_decay
        if decay is None or base_weight == 0 or step < self.lr_decay_start():
            return base_weight
        return decay


#: section name -> its dataclass
SECTION_TYPES: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}
#: flat field name -> the section that holds it (field names are unique across sections)
SECTION_OF: dict[str, str] = {
    f.name: section for section, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)
}
assert len(SECTION_OF) == sum(len(dataclasses.fields(c)) for c in SECTION_TYPES.values()), (
    "duplicate field names"
)


def section_field(name: str) -> dataclasses.Field:
    """The dataclass field of flat name ``name``."""
    return {f.name: f for f in dataclasses.fields(SECTION_TYPES[SECTION_OF[name]])}[name]


#: flat keys of older run directories (and of the flags' names) that a field of a section now holds
LEGACY_KEYS = {"data": "sources"}


def flag_name(name: str) -> str:
    """The command-line flag of the flat field ``name`` (``--data`` for ``sources``)."""
    return flag_of(section_field(LEGACY_KEYS.get(name, name)))


def flat_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """Flat field names of a saved config as a run directory holds it (nested by section, or flat as older
    versions wrote it), unvalidated, its data and tokenizer paths absolute as :func:`effective_config` makes them
    (older run configs hold them as given): what the resume checks compare."""
    flat: dict[str, Any] = {}
    for key, value in saved.items():
        if key in SECTION_TYPES and isinstance(value, dict):
            flat.update(value)
        else:
            flat[LEGACY_KEYS.get(key, key)] = value
    for name in ("sources", "eval_data"):
        if isinstance(flat.get(name), list):
            flat[name] = [_resolved(s) if isinstance(s, str) else s for s in flat[name]]
    if isinstance(flat.get("tokenizer"), str):
        flat["tokenizer"] = _resolved(flat["tokenizer"])
    return flat


def flatten(data: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Flat field names of a nested (section -> fields) or flat dict, type-checked (``ValueError`` naming
    ``where`` and the key as written)."""
    flat: dict[str, tuple[str, Any]] = {}  # field -> (the key as written, value)
    for key, value in data.items():
        if key in SECTION_TYPES and isinstance(value, dict):
            for name, v in value.items():
                if SECTION_OF.get(name) != key:
                    known = sorted(f.name for f in dataclasses.fields(SECTION_TYPES[key]))
                    raise ValueError(f"{where}: section {key!r} has no key {name!r}; its keys: {known}")
                flat[name] = (f"{key}.{name}", v)
        elif LEGACY_KEYS.get(key, key) in SECTION_OF:
            flat[LEGACY_KEYS.get(key, key)] = (key, value)
        else:
            raise ValueError(
                f"{where}: unknown key {key!r}; sections: {sorted(SECTION_TYPES)} (or flat field names: "
                f"{sorted(SECTION_OF)})"
            )
    out: dict[str, Any] = {}
    for name, (key, value) in flat.items():
        if isinstance(value, str) and name in ("sources", "eval_data"):  # "data": "path" means one source
            value = [value]
        hint = typing.get_type_hints(SECTION_TYPES[SECTION_OF[name]])[name]
        if not has_type(value, hint):
            raise ValueError(
                f"{where}: key {key!r} must be {type_name(hint)}, got {value!r} ({type(value).__name__})"
            )
        out[name] = value
    return out


def _resolved(path: str) -> str:
    """``path`` made absolute when it names an existing file or directory (mock specs and missing paths as given):
    a run resumed from another working directory names the same sources."""
    p = Path(path)
    return str(p.resolve()) if not is_mock(path) and p.exists() else path


def effective_config(tc: TrainConfig, *, cuda_available: bool) -> TrainConfig:
    """``tc`` with the values left to the machine resolved: ``precision.bf16`` and ``precision.deterministic`` (on
    with CUDA; a CPU run uses PyTorch's deterministic kernels without the strict flag), ``parallel.dist_backend``
    (NCCL on CUDA, gloo on CPU; NCCL without CUDA is refused) and the data, evaluation and tokenizer paths made
    absolute. The run prints, saves and trains with this config."""
    changes: dict[str, Any] = {
        "sources": [_resolved(s) for s in tc.data.sources],
        "eval_data": [_resolved(s) for s in tc.eval.eval_data],
    }
    if tc.data.tokenizer is not None:
        changes["tokenizer"] = _resolved(tc.data.tokenizer)
    if tc.precision.bf16 is None:
        changes["bf16"] = cuda_available
    if tc.precision.deterministic is None:
        changes["deterministic"] = cuda_available
    backend = tc.parallel.dist_backend
    if backend is None:
        changes["dist_backend"] = "nccl" if cuda_available else "gloo"
    elif backend == "nccl" and not cuda_available:
        raise ValueError(
            "--dist-backend nccl needs CUDA devices (none is visible); use --dist-backend gloo on CPU"
        )
    return tc.replace(**changes)
