"""CPU shims for megatron-core's CUDA assumptions (``dsv4_primitives.megatron.cpu``)."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from dsv4_primitives.megatron import (
    apply_cpu_shims,
    cpu_shims,
    cpu_shims_applied,
    cuda_as_cpu,
    remove_cpu_shims,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="cuda_as_cpu is a null context when CUDA exists"),
]


def test_cuda_as_cpu_maps_cuda_placements_and_restores():
    synchronize, current_stream = torch.cuda.synchronize, torch.cuda.current_stream
    with cuda_as_cpu():
        z = torch.zeros([], dtype=torch.int, device="cuda")  # megatron's schedules: total_num_tokens
        assert z.device.type == "cpu"
        assert torch.empty(3, device=torch.device("cuda", 0)).device.type == "cpu"
        x = torch.ones(2)
        assert x.to("cuda").device.type == "cpu" and x.cuda() is x
        assert x.type() == "torch.cuda.FloatTensor" and x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        torch.cuda.current_stream().wait_stream(None)
        torch.cuda.synchronize()
    assert torch.cuda.synchronize is synchronize and torch.cuda.current_stream is current_stream
    assert torch.ones(2).type() == "torch.FloatTensor"


class _Tiny(nn.Module):
    def __init__(self, config):
        super().__init__()
        from megatron.core.transformer.enums import ModelType

        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 12).view(3, 4))

    def set_input_tensor(self, tensor):
        pass

    def forward(self, x):
        return (x @ self.w.t()).pow(2)


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    out = model(x)

    def loss_func(output):
        loss = output.mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def _run_schedule(model, batches):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=1,
        micro_batch_size=2,
        forward_only=False,
    )


def test_cuda_as_cpu_runs_megatron_schedules(megatron_cpu):
    """0.19.2's schedules allocate ``torch.zeros(..., device="cuda")``; inside the shim they run on CPU."""
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    batches = [torch.randn(2, 4), torch.randn(2, 4)]
    model = _Tiny(cfg)
    with pytest.raises((RuntimeError, AssertionError), match=r"(?i)cuda|nvidia"):  # what the shim is for
        _run_schedule(model, batches)
    model.w.grad = None
    with cuda_as_cpu():
        losses = _run_schedule(model, batches)
    ref = _Tiny(cfg)
    want = [ref(x).mean() for x in batches]
    mean = torch.stack(want) / len(batches)  # megatron scales each microbatch loss by 1 / num_microbatches
    mean.sum().backward()
    torch.testing.assert_close(torch.stack([d["loss"] for d in losses]), mean.detach())
    torch.testing.assert_close(model.w.grad, ref.w.grad)


def test_current_device_shim_is_explicit_and_reversible():
    """Shim 1 is a process-wide patch of ``torch.cuda.current_device``: only explicit calls apply it, and
    ``cpu_shims`` / ``cuda_as_cpu`` restore the original on exit (unless it was applied before them)."""
    real = torch.cuda.current_device
    was_applied = cpu_shims_applied()
    remove_cpu_shims()
    try:
        original = torch.cuda.current_device
        with cpu_shims():
            assert torch.cuda.current_device() == "cpu" and cpu_shims_applied()
        assert torch.cuda.current_device is original and not cpu_shims_applied()
        with cuda_as_cpu():
            assert torch.cuda.current_device() == "cpu"
        assert torch.cuda.current_device is original
        assert apply_cpu_shims() and not apply_cpu_shims()  # idempotent
        with cpu_shims():
            pass
        assert torch.cuda.current_device() == "cpu"  # applied before the block: left in place
        remove_cpu_shims()
        assert torch.cuda.current_device is original
    finally:
        if was_applied:
            apply_cpu_shims()
        else:
            torch.cuda.current_device = real


def test_imports_patch_nothing():
    """Importing dsv4_primitives and its megatron subpackage (precision included) patches nothing."""
    code = (
        "import torch\n"
        "real = torch.cuda.current_device\n"
        "import dsv4_primitives, dsv4_primitives.megatron, dsv4_primitives.megatron.precision\n"
        "assert torch.cuda.current_device is real\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
