"""``dsv4 train --init-from PATH`` checked at the start of a run, before the data are read or the model is built.

``--init-from`` reads megatron dist checkpoints (an ``iter_XXXXXXX`` directory, a run directory with
``checkpoints/latest``, or a ``dsv4 convert`` output). A Hugging Face DeepSeek-V4 directory (``config.json`` +
safetensors) is refused with the command that converts it; its ``config.json`` is read and mapped first, so a
wrongly typed or unsupported field is named (file, key, expected and found type) instead of the advice.
"""

from __future__ import annotations

from pathlib import Path

from dsv4_train.config import TrainConfig
from hybrid_model.hf.config_map import model_config_from_hf
from hybrid_model.hf.io import read_config


def check_init_from(tc: TrainConfig) -> None:
    """``ValueError`` (one line) when ``tc.checkpoint.init_from`` is missing or names an HF checkpoint directory
    (module docstring); nothing for megatron checkpoints (:meth:`~dsv4_train.checkpoint.Checkpointer.load_weights`
    reads and checks them)."""
    given = tc.checkpoint.init_from
    if not given:
        return
    p = Path(given)
    if not p.exists():
        raise ValueError(
            f"--init-from {given} does not exist: give an iter_XXXXXXX directory, a run directory with "
            "checkpoints/latest or a dsv4 convert output"
        )
    megatron = (p / "metadata.json").is_file() or (p / "checkpoints" / "latest").is_file()
    if (p / "config.json").is_file() and not megatron:
        model_config_from_hf(read_config(p), name=p.name, source=str(p / "config.json"))
        raise ValueError(
            f"--init-from {given} is a Hugging Face checkpoint directory (config.json + safetensors); --init-from "
            f"reads megatron dist checkpoints: convert it first with 'dsv4 convert {given} NEW_DIR', then pass "
            "--init-from NEW_DIR with the --preset / --model-overrides of its model"
        )


__all__ = ["check_init_from"]
