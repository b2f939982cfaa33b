"""pytest plugin of the workspace (registered through the ``pytest11`` entry point).

- Sets ``TRITON_INTERPRET=1`` before any test module (and so any kernel module) is imported on a machine without
  CUDA.
- Skips ``gpu``-marked tests when CUDA is absent, and ``benchmark``-marked tests unless ``--run-benchmarks``.
- Provides fixtures ``megatron_cpu`` (megatron-core parallel state, world size 1) and ``seed``.
"""

from __future__ import annotations

import pytest

from dsv4_testkit.triton_env import ensure_interpreter_if_no_cuda

ensure_interpreter_if_no_cuda()


def pytest_addoption(parser):
    parser.addoption(
        "--run-benchmarks", action="store_true", default=False, help="run benchmark-marked tests"
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


@pytest.fixture
def megatron_cpu():
    """megatron-core parallel state with TP=PP=EP=CP=1 (gloo on CPU); yields ``parallel_state``."""
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    with megatron_cpu_context() as ps:
        yield ps


@pytest.fixture
def seed():
    import torch

    torch.manual_seed(0)
    return 0
