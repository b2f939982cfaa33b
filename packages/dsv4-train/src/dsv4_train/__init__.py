"""``dsv4 train`` on megatron-core: the training config, the trainer, data wiring, evaluation, checkpoints and the
``dsv4`` CLI, above the model package (:mod:`hybrid_model`).

Importing the package installs :mod:`dsv4_train.quiet`'s filters first (megatron-core's import-time notices that a
user can do nothing about, matched by exact message): the config's support table reads the model's symbol records,
which import megatron-core, and ``python -m dsv4_train`` / the ``dsv4`` script import this package before their own
code runs."""

from dsv4_train.quiet import quiet_known_warnings

quiet_known_warnings()

from dsv4_train.config import TrainConfig  # noqa: E402  (after the filters: megatron-core warns while importing)

__version__ = "0.6.0"

__all__ = ["TrainConfig", "__version__"]
