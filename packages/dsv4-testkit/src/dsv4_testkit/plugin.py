"""pytest plugin of the workspace (registered through the ``pytest11`` entry point).

- Sets ``TRITON_INTERPRET=1`` before any test module (and so any kernel module) is imported on a machine without
  CUDA.
- Skips ``gpu``-marked tests when CUDA is absent, and ``benchmark``-marked tests unless ``--run-benchmarks``.
- Provides fixtures ``megatron_cpu`` (megatron-core parallel state, world size 1) and ``seed``.
- Under the Triton interpreter, every test starts with pristine ``triton.language`` namespaces (autouse fixture
  ``pristine_triton_language``; Triton 3.6's interpreter leaks patches, see :mod:`dsv4_testkit.triton_env`).
- NaN poisoning is on for every test (autouse fixture ``nan_poison_allocations``): fresh ``torch.empty``-family
  allocations come back filled with NaN (integers: a sentinel), so a kernel that leaves an output slot unwritten
  fails its comparison with the reference. Opt out per test with ``@pytest.mark.no_nan_poison`` (a test that
  legitimately reads uninitialised memory), or for a run with ``--no-nan-poison``.
- Every test leaves megatron-core's MoE metrics tracker and dsv4-attention's indexer-loss tracker empty (autouse
  fixture ``fresh_metric_trackers``): both are process globals sized by the first model that records into them, and
  a later test with more layers would index past their end.
"""

from __future__ import annotations

import pytest

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from dsv4_testkit.poison import poison_allocations
from dsv4_testkit.triton_env import (
    ensure_interpreter_if_no_cuda,
    interpreting,
    restore_triton_language,
    snapshot_triton_language,
)

ensure_interpreter_if_no_cuda()


def pytest_addoption(parser):
    parser.addoption(
        "--run-benchmarks", action="store_true", default=False, help="run benchmark-marked tests"
    )
    parser.addoption(
        "--no-nan-poison",
        action="store_true",
        default=False,
        help="do not fill fresh torch.empty allocations with NaN (the testkit's default for every test)",
    )


def pytest_configure(config):
    if interpreting():  # before any kernel runs: the pristine triton.language namespaces
        snapshot_triton_language()
    config.addinivalue_line(
        "markers",
        "no_nan_poison: this test reads uninitialised memory on purpose; torch.empty allocations are not NaN-filled",
    )


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    run_bench = config.getoption("--run-benchmarks")
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run with `nox -s gpu` on a GPU machine)")
    skip_bench = pytest.mark.skip(reason="benchmark: run with `nox -s bench` / --run-benchmarks")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "benchmark" in item.keywords and not run_bench:
            item.add_marker(skip_bench)


@pytest.fixture(autouse=True)
def pristine_triton_language():
    """Autouse: under the Triton interpreter, every test starts with the ``triton.language`` namespaces of the session
    start (the interpreter leaks patches of ``tl.core`` through device-function calls such as ``tl.sum``; see
    :mod:`dsv4_testkit.triton_env`), so no test depends on which interpreted kernels ran before it."""
    if interpreting():
        snapshot_triton_language()
        restore_triton_language()
    yield
    if interpreting():
        restore_triton_language()


@pytest.fixture(autouse=True)
def nan_poison_allocations(request):
    """Autouse: NaN-poison fresh ``torch.empty``-family allocations during the test (see
    :func:`dsv4_testkit.poison.poison_allocations`); off for ``@pytest.mark.no_nan_poison`` or ``--no-nan-poison``."""
    if request.node.get_closest_marker("no_nan_poison") or request.config.getoption("--no-nan-poison"):
        yield False
        return

    with poison_allocations():
        yield True


@pytest.fixture(autouse=True)
def fresh_metric_trackers():
    """Autouse: after each test, reset megatron-core's MoE metrics tracker and dsv4-attention's indexer-loss tracker
    (process globals sized by the first model that records into them) where those modules are loaded; nothing is
    imported for it."""
    yield
    import sys

    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if moe_logging is not None:
        moe_logging.destroy_moe_metrics_tracker()
    dsv4_attention = sys.modules.get("dsv4_attention")
    if dsv4_attention is not None:
        dsv4_attention.get_indexer_loss_tracker().reset()


@pytest.fixture
def megatron_cpu():
    """megatron-core parallel state with TP=PP=EP=CP=1 (gloo on CPU); yields ``parallel_state``."""
    with megatron_cpu_context() as ps:
        yield ps


@pytest.fixture
def seed():
    import torch

    torch.manual_seed(0)
    return 0
