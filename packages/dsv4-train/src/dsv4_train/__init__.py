"""``dsv4 train`` on megatron-core: the training config, the trainer, data wiring, evaluation, checkpoints and the
``dsv4`` CLI, above the model package (:mod:`hybrid_model`)."""

from dsv4_train.config import TrainConfig

__version__ = "0.3.0"

__all__ = ["TrainConfig", "__version__"]
