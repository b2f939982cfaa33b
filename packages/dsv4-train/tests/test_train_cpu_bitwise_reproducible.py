"""Bit-reproducible CPU training with several threads: ``--packed`` runs with the same seed are identical, and a
resumed ``--packed`` run matches an uninterrupted one bit for bit (the ``[B, S]`` case is in test_train_e2e)."""

import sys
from pathlib import Path

import pytest
import torch

from dsv4_train.determinism import use_deterministic_cpu_kernels

sys.path.insert(0, str(Path(__file__).parent))
from test_train_e2e import _train_runs


def _gather_grads(reps: int) -> list[torch.Tensor]:
    """The gradient of ``kv`` through the sparse-attention reference's ``kv[indices]`` gather, ``reps`` times."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(512, 64, generator=g, requires_grad=True)
    idx = torch.randint(0, 512, (512, 128), generator=g)  # [T, K] window rows: many repeats per kv row
    up = torch.randn(512, 128, 64, generator=g)
    out = []
    for _ in range(reps):
        kv.grad = None
        (kv[idx] * up).sum().backward()
        out.append(kv.grad.clone())
    return out


def test_cpu_gather_backward_is_bit_identical_with_two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        restore = use_deterministic_cpu_kernels(torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled()
        try:
            grads = _gather_grads(8)
        finally:
            restore()
        assert all(torch.equal(grads[0], x) for x in grads[1:])
        assert (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ) == before
        use_deterministic_cpu_kernels(torch.device("meta"))()  # other devices: nothing changes
        assert torch.are_deterministic_algorithms_enabled() == before[0]
    finally:
        torch.set_num_threads(threads)


#: packed runs (each run's overrides apply on top)
PACKED_BASE = dict(seq_len=128, global_batch_size=4, micro_batch_size=2, warmup_steps=2, packed=True, steps=4)


@pytest.mark.slow
def test_packed_runs_and_resume_are_bit_identical(tmp_path):
    """The uninterrupted run in one process; the saving run and its resume from step 2 one after the other in
    another (two processes: the runs agree across processes, not only within one)."""
    (full,) = _train_runs(tmp_path, dict(out=str(tmp_path / "full"), save_final=False), base=PACKED_BASE)
    run = str(tmp_path / "run")
    saved, tail = _train_runs(
        tmp_path,
        dict(out=run, save_interval=2),
        dict(out=run, resume=True, latest="iter_0000002"),
        base=PACKED_BASE,
    )
    assert saved == full  # two --packed runs, same seed: every loss, grad norm and lr bit-identical
    assert tail == full[2:]
