"""The warnings and log records of megatron-core and torch that every ``dsv4`` run printed and a user can do nothing
about, dropped by their exact message (anything else still shows). Imports nothing heavy: the filters must be in
place before megatron-core is imported (it warns while importing)."""

from __future__ import annotations

import logging
import warnings

# What every default run printed that a user can do nothing about, matched exactly by message (anything else still
# shows): megatron-core without Transformer Engine / apex (torch kernels by design), its experimental-API and
# deprecated-default notices, the DDP layout hint and the non-leaf ``.grad`` probe inside its optimizer's
# zero_grad, the deprecation of the async saver (our saves are synchronous), invalid escape sequences in its docstrings, torch's CUDA_HOME note on a machine without a GPU, and torch's single-process and argument-order notes on every checkpoint load.
QUIET_WARNINGS = (
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm"),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_modules"),
    (UserWarning, r"MimoModelConfig is experimental"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    (SyntaxWarning, r"invalid escape sequence"),
    (
        UserWarning,
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load",
    ),
    (UserWarning, r"The argument order of load has been changed"),
)
QUIET_LOG_RECORDS = (
    (
        "megatron.core.distributed.distributed_data_parallel",
        "DistributedDataParallel: full_param_layout not provided",
    ),
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
)


class _DropMessages:
    """``logging`` filter dropping the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_known_warnings() -> None:
    """Install the filters of :data:`QUIET_WARNINGS` and :data:`QUIET_LOG_RECORDS`."""
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefix in QUIET_LOG_RECORDS:
        logging.getLogger(name).addFilter(_DropMessages((prefix,)))
