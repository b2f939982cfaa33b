"""``dsv4 train`` on megatron-core: :class:`TrainConfig`, :class:`Trainer`, :func:`train`."""

from hybrid_model.training.config import TrainConfig

__all__ = ["TrainConfig"]
