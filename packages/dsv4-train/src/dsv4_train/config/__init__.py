"""The ``dsv4 train`` configuration: :class:`TrainConfig`, a tree of frozen sections (see
:mod:`dsv4_train.config.train_config`)."""

from dsv4_train.config.run_sections import (
    DIST_BACKENDS,
    DISTOPT_FORMATS,
    CheckpointSection,
    EvalSection,
    GraphsSection,
    LoggingSection,
    MemorySection,
    ParallelSection,
    PrecisionSection,
)
from dsv4_train.config.sections import (
    OPTIMIZER_IMPLS,
    DataSection,
    LossSection,
    ModelSection,
    OptimizerSection,
    ScheduleSection,
)
from dsv4_train.config.train_config import (
    SECTION_OF,
    SECTION_TYPES,
    TrainConfig,
    effective_config,
    flag_name,
    flat_settings,
    section_field,
)

__all__ = [
    "DISTOPT_FORMATS",
    "DIST_BACKENDS",
    "OPTIMIZER_IMPLS",
    "SECTION_OF",
    "SECTION_TYPES",
    "CheckpointSection",
    "DataSection",
    "EvalSection",
    "GraphsSection",
    "LoggingSection",
    "LossSection",
    "MemorySection",
    "ModelSection",
    "OptimizerSection",
    "ParallelSection",
    "PrecisionSection",
    "ScheduleSection",
    "TrainConfig",
    "effective_config",
    "flag_name",
    "flat_settings",
    "section_field",
]
