"""Bit-reproducible training: ``dsv4 train --deterministic`` (the default with CUDA), ``--no-deterministic``, and the
CPU default.

**CPU default.** With more than one intra-op thread, PyTorch's CPU ``index_put_(..., accumulate=True)`` on float
tensors of at least ``GRAIN_SIZE`` (32768) elements adds with parallel atomics, so the summation order changes from
run to run. That op is the backward of every advanced-indexing gather ``x[idx]``, e.g. the ``kv[indices]`` gather of
the sparse / window attention reference (csa-kernels) that a CPU run uses: two ``--packed`` runs with the same seed
(and a resumed run against an uninterrupted one) drifted apart in the last bits after a few steps. A CPU run
therefore always uses PyTorch's deterministic kernels (:func:`use_deterministic_cpu_kernels`, ``warn_only``); its
``--deterministic`` resolves to off (the strict mode below only on request), as before.

**Default with CUDA: ``--deterministic``** (``precision.deterministic = None`` resolves to on when CUDA is visible;
:func:`use_run_determinism`). ``--no-deterministic`` keeps PyTorch's defaults and tells csa-kernels to use its
fp32-atomic sparse-attention ``dkv`` / indexer ``dk`` (``csa_kernels.set_deterministic_default(False)`` for the
run; restored by ``Trainer.close``): faster, but their summation order varies from run to run.

**``--deterministic``** (:func:`use_deterministic_training`): every kernel of a training step gives the same bits
for the same inputs, so two runs with the same seed give bitwise-identical losses and gradients (eager and
``--cuda-graph``). What it switches:

* ``torch.use_deterministic_algorithms(True)`` (strict: an op without a deterministic implementation raises
  instead of warning). PyTorch then runs the sort-based ``index_put_`` / ``index_add`` / ``scatter_add_``
  (embedding backward, reference gathers, hash-moe's balance statistics) and our Triton kernels that take
  ``deterministic=None`` follow it (csa-kernels' own default is deterministic too, and the run sets it on):
  csa-kernels' inverted-index sparse-attention ``dkv`` and key-major indexer ``dk`` instead of fp32 atomics (the
  only atomics of the step; every other kernel — compressor, mHC, hash-moe permute / gathers, RMSNorm, RoPE, cross
  entropy, linear cross entropy — reduces in a fixed order always; audit table in the csa-kernels README);
* megatron's ``deterministic_mode`` (its vocab-parallel embedding gathers with ``weight[ids]`` instead of
  ``F.embedding``), cuDNN's deterministic algorithms (no benchmarking);
* cuBLAS: ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS and PyTorch read once, at the first cuBLAS call of the
  process: :func:`prepare_deterministic_environment` sets it (the CLI calls it before anything touches CUDA) and
  :func:`use_deterministic_training` checks with one tiny GEMM that it took effect;
* NCCL (several GPUs): ``NCCL_ALGO`` must not allow NVLS / NVLSTree (NVLink SHARP reduces inside the switch, in
  no fixed order); unset, it becomes ``^NVLS,NVLSTree``; a user's exclusion list that leaves one of them out (a
  cluster's ``^NVLS``) gets the missing one appended, with a note (it only narrows what the user already excluded);
  an explicit list that names one of them is refused;
* the seeds of Python's and PyTorch's generators (the model init and data order already follow ``--seed``).

Uninitialised memory is not filled (``torch.utils.deterministic.fill_uninitialized_memory = False``): every kernel
writes every element it later reads (the test suites allocate with NaN poisoning to check that), and filling every
``torch.empty`` would add bandwidth to the measured cost without changing a bit.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable

import torch

import csa_kernels

CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the two values PyTorch accepts as deterministic
NCCL_NONDETERMINISTIC_ALGOS = ("nvls", "nvlstree")  # NVLink SHARP: the reduction runs in the switch
NCCL_DEFAULT_ALGO = "^NVLS,NVLSTree"  # NCCL's exclusion syntax: every algorithm but these


def _nccl_algo_problem(value: str) -> str | None:
    """Why an explicit ``NCCL_ALGO=value`` list may reduce in a varying order (``None`` when it cannot, and for
    exclusion lists ``^...``, which :func:`_completed_exclusion` completes). megatron's deterministic mode allows
    the same set: Ring, Tree, CollNet, or an exclusion list that removes NVLS."""
    if value.strip().startswith("^"):
        return None
    names = {a.strip().lower() for a in value.split(",") if a.strip()}
    bad = sorted(names & set(NCCL_NONDETERMINISTIC_ALGOS))
    return f"it allows {', '.join(bad)}" if bad else None


def _completed_exclusion(value: str) -> str | None:
    """An exclusion list ``^A,B`` with the in-switch algorithms it leaves out appended (``None`` when it already
    excludes both, or is not an exclusion list): ``^NVLS`` -> ``^NVLS,NVLSTree``."""
    if not value.strip().startswith("^"):
        return None
    names = {a.strip().lower() for a in value.strip()[1:].split(",") if a.strip()}
    missing = [a for a in NCCL_DEFAULT_ALGO[1:].split(",") if a.lower() not in names]
    return ",".join([value.strip(), *missing]) if missing else None


def prepare_deterministic_environment(environ: dict[str, str] | None = None) -> None:
    """Set the environment ``--deterministic`` needs before any CUDA work: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and
    (for NCCL) an ``NCCL_ALGO`` without in-switch reductions, unless the user set them. ``ValueError`` when the user
    set a list that names an in-switch algorithm; an exclusion list that leaves one out is completed (with a note on
    stderr). ``environ`` defaults to ``os.environ``."""
    env = os.environ if environ is None else environ
    cublas, algo = env.get(CUBLAS_VAR), env.get("NCCL_ALGO")
    if cublas is not None and cublas not in CUBLAS_DETERMINISTIC:
        raise ValueError(
            f"--deterministic: {CUBLAS_VAR}={cublas!r} makes cuBLAS GEMMs non-deterministic; unset it (dsv4 train "
            f"then sets {CUBLAS_DETERMINISTIC[0]}) or export one of {' / '.join(CUBLAS_DETERMINISTIC)}"
        )
    if algo is not None and (problem := _nccl_algo_problem(algo)) is not None:
        raise ValueError(
            f"--deterministic: NCCL_ALGO={algo!r} can reduce in a varying order ({problem}: NVLink SHARP reduces "
            f"inside the switch); unset it (dsv4 train then sets {NCCL_DEFAULT_ALGO}) or choose Ring / Tree"
        )
    env.setdefault(CUBLAS_VAR, CUBLAS_DETERMINISTIC[0])
    env.setdefault("NCCL_ALGO", NCCL_DEFAULT_ALGO)
    if algo is not None and (completed := _completed_exclusion(algo)) is not None:
        env["NCCL_ALGO"] = completed
        print(
            f"dsv4 train: --deterministic: NCCL_ALGO={algo!r} still allows an in-switch (NVLink SHARP) reduction, "
            f"which has no fixed order; using NCCL_ALGO={completed!r}",
            file=sys.stderr,
        )


def _check_cublas_took_effect() -> None:
    """One tiny GEMM under deterministic mode: PyTorch raises when the cuBLAS workspace config it read at the
    process's first cuBLAS call was not a deterministic one (the variable was set too late)."""
    a = torch.ones(2, 2, device="cuda")
    try:
        a @ a
    except RuntimeError as e:
        if CUBLAS_VAR not in str(e):
            raise
        raise ValueError(
            f"--deterministic: cuBLAS was used in this process before {CUBLAS_VAR} was set, and it reads the "
            f"variable only once; export {CUBLAS_VAR}={CUBLAS_DETERMINISTIC[0]} before starting the process (or "
            "call dsv4_train.determinism.prepare_deterministic_environment() before any CUDA work)"
        ) from None


def use_deterministic_training(device: torch.device, seed: int) -> Callable[[], None]:
    """Switch every kernel of a training step to its deterministic form (see the module docstring) and seed the
    generators with ``seed``. Call :func:`prepare_deterministic_environment` first, before any CUDA work (the
    Trainer does; ``ValueError`` if cuBLAS already runs with another workspace config). Returns the function that
    restores PyTorch's previous settings (the environment variables stay: cuBLAS has read them)."""
    import torch.utils.deterministic as det

    prepare_deterministic_environment()
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def restore() -> None:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        det.fill_uninitialized_memory = previous[2]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[3], previous[4]

    if device.type == "cuda":
        try:
            _check_cublas_took_effect()
        except BaseException:
            restore()
            raise
    random.seed(seed)
    torch.manual_seed(seed)  # all devices
    return restore


def use_deterministic_cpu_kernels(device: torch.device) -> Callable[[], None]:
    """On a CPU ``device``: switch PyTorch to deterministic algorithms (``warn_only``: an op without a
    deterministic implementation warns instead of failing the run; uninitialised memory is not filled, as before).
    Returns the function that restores the previous settings (a no-op for other devices)."""
    if device.type != "cpu":
        return lambda: None
    import torch.utils.deterministic as det

    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = False

    def restore() -> None:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        det.fill_uninitialized_memory = previous[2]

    return restore


def use_run_determinism(device: torch.device, seed: int, deterministic: bool) -> Callable[[], None]:
    """The determinism settings of a run with the resolved ``--deterministic``: csa-kernels' default of
    ``deterministic=None`` set to ``deterministic`` (``--no-deterministic``: its fp32-atomic kernels), then
    :func:`use_deterministic_training` when on, else :func:`use_deterministic_cpu_kernels` (a CPU run's PyTorch
    kernels stay deterministic; nothing else changes on CUDA). Returns the function that restores all of it."""
    previous = csa_kernels.set_deterministic_default(deterministic)
    try:
        restore = (
            use_deterministic_training(device, seed)
            if deterministic
            else use_deterministic_cpu_kernels(device)
        )
    except BaseException:
        csa_kernels.set_deterministic_default(previous)
        raise

    def restore_all() -> None:
        restore()
        csa_kernels.set_deterministic_default(previous)

    return restore_all


__all__ = [
    "CUBLAS_DETERMINISTIC",
    "prepare_deterministic_environment",
    "use_deterministic_cpu_kernels",
    "use_deterministic_training",
    "use_run_determinism",
]
