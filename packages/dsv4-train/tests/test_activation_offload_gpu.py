"""``--offload-activations`` on the GPU: what the forward saves for backward goes to pinned host memory and comes
back bit for bit. From the CLI, a full-recompute run with the checkpointed layer inputs on the host gives the losses
and gradient norms of the same run that keeps them on the device (``--deterministic``: two runs of one config are
bitwise equal, so any difference is the offload's); on a small graph, exactly the large non-parameter saved tensors
move, the gradients are unchanged and less device memory is held between forward and backward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dsv4_train.activation_offload import ActivationOffload

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import ONE_PROCESS, train_metrics

_ARGS = [
    "--preset", "tiny", "--seed", "5", "--seq-len", "256", "--global-batch-size", "2", "--micro-batch-size", "1",
    "--steps", "3", "--deterministic", "--no-progress", "--no-save-final",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
]  # fmt: skip
_KEYS = ("lm_loss", "mtp_loss", "balance_loss", "indexer_loss", "grad_norm")


@pytest.mark.gpu
def test_offloaded_run_equals_device_run_bitwise(tmp_path):
    device = train_metrics(ONE_PROCESS, tmp_path / "device", *_ARGS)
    host = train_metrics(ONE_PROCESS, tmp_path / "host", *_ARGS, "--offload-activations")
    assert len(device) == len(host) == 3
    for a, b in zip(device, host, strict=True):
        assert [a[k] for k in _KEYS] == [b[k] for k in _KEYS], (a, b)


@pytest.mark.gpu
def test_large_saved_tensors_move_to_the_host_and_come_back_exactly():
    torch.manual_seed(0)
    w = torch.nn.Linear(1024, 1024, bias=False, device="cuda")  # 4 MiB parameter: saved, never moved
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)  # [T, d] fp32, 8 MiB
    small = torch.randn(16, 1024, device="cuda", requires_grad=True)  # 64 KiB: below min_bytes, stays

    def forward():
        h = torch.tanh(w(x))  # [T, d]: linear saves x and the weight, tanh its output h
        return (h**2).sum() + (small**2).sum()  # pow saves h again (the same storage) and small

    def step(offload):
        x.grad = small.grad = w.weight.grad = None
        before = torch.cuda.memory_allocated()
        with offload.hooks() if offload is not None else torch.enable_grad():
            loss = forward()
        held = torch.cuda.memory_allocated() - before  # h lives only in what autograd saved
        loss.backward()
        return held, (x.grad.clone(), small.grad.clone(), w.weight.grad.clone())

    # a first step allocates cuBLAS's workspaces (one per thread: the forward's and the autograd engine's, 32 MiB
    # each on Hopper) through the caching allocator: warm up so that neither measured step counts one
    step(None)
    held_device, grads = step(None)
    offload = ActivationOffload([w], min_bytes=1 << 20)
    held_host, grads_host = step(offload)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_host, strict=True))
    t_d = 2048 * 1024 * 4
    assert offload.offloaded_bytes == 3 * t_d  # x once, h twice; not the weight, not small
    assert held_device >= t_d  # h
    assert held_host <= held_device - t_d  # h is off the device between the passes (x is the test's own)
