"""``--optimizer-offload-defer`` on the GPU (:mod:`dsv4_train.offload_defer`): the deferred host step against the
pipelined one (``--optimizer-offload-overlap``) on CUDA, where the streams and CUDA events order the copies.

* Exactness: ``test_offload_defer.py``'s chain of modules (bf16 and keep-in-FP32 params, registered in another order
  than the forward runs them) for 3 steps with a slowed host thread: losses, grad norms, the value every forward
  read (cloned on the current stream right after the module's wait), params, masters, moments and step counts are
  bitwise the pipelined step's, at F = 1 and 0.5. A missing stream wait lets a forward read a param before its H2D
  copy landed, or the grad zeroing overwrite a gradient before its D2H copy.
* Speed: a chain of wide linear layers whose forward and backward take about as long as its host AdamW. The
  exposed optimizer time (the mean wall time of a whole step minus the mean of forward + backward alone, each over
  several steps after warm-ups, from before the first to after the last step's host and device work) of the deferred
  step is below three quarters of the pipelined step's (the host AdamW runs behind the next forward).

Passed on an H100 on 2026-12-07 (benchmarks/results/gpu_tests_offload_defer_h100_2026-12-07.log; no GPU in CI).
"""

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_offload_defer import _assert_same, _build, _state, _step

from dsv4_train import offload_defer
from dsv4_train.offload import offload_config_fields
from dsv4_train.offload_defer import DeferredHostStep
from dsv4_train.offload_pipeline import CHUNK_NUMEL

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning")]
SLOW_S = 0.005
WIDTH, LAYERS, TOKENS = 4096, 8, 65536  # 134 M params: host AdamW and the forward both tens of ms


@pytest.fixture
def slow_host(monkeypatch):
    """The host thread sleeps before each chunk's AdamW: the main thread's forward runs ahead and must wait."""
    adamw = offload_defer.adamw_chunk

    def slow_adamw(c):
        time.sleep(SLOW_S)
        adamw(c)

    monkeypatch.setattr(offload_defer, "adamw_chunk", slow_adamw)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_deferred_bitwise_equals_pipelined_on_cuda(megatron_cpu, slow_host, fraction):
    core, ddp, opt = _build(fraction, device="cuda")
    ref = [_step(ddp, opt, s) for s in range(3)]
    ref_seen = [(n, v.cpu()) for n, v in core.seen]
    ref_state = _state(core, ddp, opt)

    core2, ddp2, opt2 = _build(fraction, device="cuda")
    defer = DeferredHostStep(opt2, [ddp2])
    got = [_step(ddp2, opt2, s, defer) for s in range(3)]
    defer.close()
    torch.cuda.synchronize()
    assert got == ref
    seen = [(n, v.cpu()) for n, v in core2.seen]
    assert [n for n, _ in seen] == [n for n, _ in ref_seen]
    for (n, a), (_, b) in zip(ref_seen, seen, strict=True):
        assert torch.equal(a, b), n
    _assert_same(ref_state, _state(core2, ddp2, opt2))


def _wide_cls():
    from megatron.core.transformer.module import MegatronModule

    class Layer(torch.nn.Module):
        def __init__(self, g):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5)

        def forward(self, h):
            return torch.nn.functional.gelu(torch.nn.functional.linear(h, self.w))

    class Wide(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            g = torch.Generator().manual_seed(0)
            self.layers = torch.nn.ModuleList(Layer(g) for _ in range(LAYERS))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.float().pow(2).mean()

    return Wide


def _wide(defer: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from dsv4_primitives.megatron.precision import Float16ModuleKeepFP32
    from dsv4_train.optimizer import build_optimizer

    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    model = Float16ModuleKeepFP32(cfg, _wide_cls()(cfg).to("cuda"))
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=1e-4,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
        **offload_config_fields(1.0),
    )
    opt = build_optimizer(ocfg, [ddp], impl="auto", offload_chunk_numel=CHUNK_NUMEL)
    return ddp, opt, DeferredHostStep(opt, [ddp]) if defer else None


def _mean_step_s(ddp, opt, defer, x, steps=5, warmup=2) -> float:
    """Mean wall seconds of a whole step (``opt`` None: forward and backward only)."""

    def one():
        if defer is not None:
            defer.zero_grad_buffers([ddp])
        else:
            ddp.zero_grad_buffer()
        loss = ddp(x)
        if defer is not None:
            defer.before_backward()
        loss.backward()
        ddp.finish_grad_sync()
        if opt is not None:
            assert opt.step()[0]
        if defer is not None:
            defer.launch()

    def done():
        if defer is not None:
            defer.finish()
        torch.cuda.synchronize()

    for _ in range(warmup):
        one()
    done()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    done()
    return (time.perf_counter() - t0) / steps


def test_deferred_step_exposes_less_optimizer_time(megatron_cpu):
    x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16)
    ddp, opt, _ = _wide(defer=False)
    fwd_bwd = _mean_step_s(ddp, None, None, x)
    pipelined = _mean_step_s(ddp, opt, None, x) - fwd_bwd
    del ddp, opt
    ddp, opt, defer = _wide(defer=True)
    deferred = _mean_step_s(ddp, opt, defer, x) - fwd_bwd
    defer.close()
    print(
        f"fwd+bwd {fwd_bwd * 1e3:.1f} ms; exposed optimizer: pipelined {pipelined * 1e3:.1f} ms, deferred {deferred * 1e3:.1f} ms"
    )
    assert pipelined > 0.005, "the pipelined step should cost measurable time here"
    assert deferred < 0.75 * pipelined, (fwd_bwd, pipelined, deferred)
