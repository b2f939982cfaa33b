"""``--optimizer-offload-defer``: the host AdamW of step k behind step k+1's forward (:mod:`dsv4_train.offload_defer`)
against the pipelined step it defers (``--optimizer-offload-overlap``), on CPU under
:func:`offload_sim.simulated_device` (CPU tensors play the GPU, pinned copies the host; streams and CUDA events order
nothing there, so every ordering below rests on the host thread's events, which these tests exercise).

The toy is a chain of modules each reading its own param in its forward (``loss = sum_p <p, G_p>``: gradients
independent of the params, the loss not), registered in another order than the forward runs them (head first). The
host thread is slowed down (a sleep before its D2H copies and before each chunk's AdamW) so that every wait the
deferred step needs is exercised: a missing one lets the main thread read or write a value the host thread has not
finished, and the losses, params or Adam state then differ from the pipelined step's.
"""

import sys
import time
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
from offload_sim import simulated_device
from test_optimizer_impl import _load, _save
from test_optimizer_offload import _hybrid_state, _model_params

from dsv4_train import offload_defer
from dsv4_train.config import TrainConfig
from dsv4_train.offload import hybrid_optimizers, offload_config_fields
from dsv4_train.offload_defer import DeferredHostStep, ForwardOrder
from dsv4_train.offload_pipeline import OffloadPipeline
from dsv4_train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CHUNK = 64  # elements: the [16, 16] params are 4 chunks each
SLOW_S = 0.01  # the host thread's extra time per chunk (and before its D2H copies)
SPARE_S = 0.1  # for the chunk no forward waits for: the next optimizer step must
SIZES = {
    "head": (5, 16),
    "embed": (16, 8),
    "mix": (16, 16),
    "layer0": (16, 16),
    "layer1": (16, 16),
    "spare": (32,),
}
FORWARD = ("embed", "layer0", "mix", "layer1", "head")  # "spare" never runs: its param is only stepped


def _chain_cls():
    from megatron.core.transformer.module import MegatronModule

    from dsv4_primitives import mark_keep_in_fp32

    class Leaf(torch.nn.Module):
        def __init__(self, name, shape, g, seen):
            super().__init__()
            self.name, self.seen = name, seen
            w = torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.3)
            self.w = mark_keep_in_fp32(w) if name == "mix" else w

        def forward(self, grad):
            self.seen.append((self.name, self.w.detach().clone()))  # the value this forward reads
            return (self.w.float() * grad.float()).sum()

    class Chain(MegatronModule):
        """bf16 leaves and one keep-in-FP32 leaf, registered head first, run embed -> layers -> head."""

        def __init__(self, config):
            super().__init__(config)
            g = torch.Generator().manual_seed(0)
            self.seen = []
            self.leaves = torch.nn.ModuleDict({n: Leaf(n, s, g, self.seen) for n, s in SIZES.items()})

        def forward(self, grads):
            return sum(self.leaves[n](grads[n]) for n in FORWARD)

    return Chain


def _build(fraction, chunk=CHUNK, device="cpu"):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from dsv4_primitives.megatron.precision import Float16ModuleKeepFP32
    from dsv4_train.optimizer import build_optimizer

    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    core = _chain_cls()(cfg).to(device)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(cfg, ddp_cfg, Float16ModuleKeepFP32(cfg, core))
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
        **offload_config_fields(fraction),
    )
    return core, ddp, build_optimizer(ocfg, [ddp], impl="auto", offload_chunk_numel=chunk)


def _grads(step, device):
    gen = torch.Generator().manual_seed(100 + step)
    return {
        n: (10.0 ** (-3 + (i + step) % 4) * torch.randn(s, generator=gen)).to(device)
        for i, (n, s) in enumerate(SIZES.items())
    }


def _step(ddp, opt, step, defer=None):
    """One training step as the trainer runs it (:class:`~dsv4_train.step.StepRunner`); the loss and grad norm."""
    if defer is None:
        ddp.zero_grad_buffer()
    else:
        defer.zero_grad_buffers([ddp])
    opt.zero_grad()
    loss = ddp(_grads(step, next(ddp.parameters()).device))
    if defer is not None:
        defer.before_backward()
    loss.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    assert ok
    if defer is not None:
        defer.launch()
    return float(loss), float(grad_norm)


def _state(core, ddp, opt):
    steps = [
        float(h.state[p]["step"]) for h in hybrid_optimizers(opt) for g in h.param_groups for p in g["params"]
    ]
    return _model_params(ddp), _hybrid_state(opt), steps


def _assert_same(a, b):
    (pa, sa, ka), (pb, sb, kb) = a, b
    for n, x in pa.items():
        assert x.dtype == pb[n].dtype and torch.equal(x, pb[n]), n
    for i, (x, y) in enumerate(zip(sa, sb, strict=True)):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), i
    assert ka == kb


@pytest.fixture
def slow_host(monkeypatch):
    """The host thread sleeps before its D2H copies and before each chunk's AdamW (the main thread runs ahead),
    longest before the chunk of the param no forward reads."""
    d2h, adamw = offload_defer.queue_d2h, offload_defer.adamw_chunk

    def slow_d2h(chunks, stream):
        time.sleep(5 * SLOW_S)
        return d2h(chunks, stream)

    def slow_adamw(c):
        time.sleep(SPARE_S if c.master.numel() == SIZES["spare"][0] else SLOW_S)
        adamw(c)

    monkeypatch.setattr(offload_defer, "queue_d2h", slow_d2h)
    monkeypatch.setattr(offload_defer, "adamw_chunk", slow_adamw)


def _runs(fraction, steps=3):
    """The pipelined run and the deferred one: per-step (loss, grad norm), the values each forward read, the final
    state, and how many chunks each deferred forward found done."""
    core, ddp, opt = _build(fraction)
    ref = [_step(ddp, opt, s) for s in range(steps)]
    ref_seen, ref_state = list(core.seen), _state(core, ddp, opt)
    core2, ddp2, opt2 = _build(fraction)
    defer = DeferredHostStep(opt2, [ddp2])
    done_at = []
    hook = core2.leaves["embed"].register_forward_pre_hook(  # after the deferred step's own hook
        lambda m, a: done_at.append(
            None if defer._job is None else (sum(e.is_set() for e in defer._job.ready), len(defer._job.ready))
        )
    )
    got = [_step(ddp2, opt2, s, defer) for s in range(steps)]
    defer.close()
    hook.remove()
    return (ref, ref_seen, ref_state), (got, list(core2.seen), _state(core2, ddp2, opt2)), done_at, defer


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_deferred_steps_bitwise_equal_pipelined(megatron_cpu, slow_host, fraction):
    """3 steps: losses, grad norms, every value a forward read, params, masters, moments and step counts are the
    pipelined step's; the embedding's forward ran while later chunks were still on the host thread (it waited for
    its own chunks only: the forward order, not the registration order)."""
    from dsv4_primitives.megatron import cuda_as_cpu

    with cuda_as_cpu(), simulated_device():
        (ref, ref_seen, ref_state), (got, seen, state), done_at, defer = _runs(fraction)
    assert got == ref
    assert [n for n, _ in seen] == [n for n, _ in ref_seen] == list(FORWARD) * 3
    for (n, a), (_, b) in zip(ref_seen, seen, strict=True):
        assert torch.equal(a, b), n
    _assert_same(ref_state, state)
    assert done_at[0] is None  # step 1: nothing deferred yet
    # embed's chunks (F = 1: the first 2; F = 0.5: embed stays on the device) done, not all of the later ones
    assert all((2 if fraction == 1.0 else 0) <= done < total for done, total in done_at[1:]), done_at
    assert defer._hooks == [] and defer._job is None
    assert all(type(h.pipeline) is OffloadPipeline for h in defer._hdos)  # closed: pipelined again


def test_deferred_checkpoint_resumes_in_either_mode(megatron_cpu, slow_host, tmp_path):
    """A checkpoint saved while a step is deferred (the save finishes it) resumes pipelined, and a pipelined one
    resumes deferred: the next step is bitwise the uninterrupted run's."""
    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_train.checkpoint import sync_saver_queue

    sync_saver_queue()
    with cuda_as_cpu(), simulated_device():
        core, ddp, opt = _build(0.5)
        for s in range(3):
            _step(ddp, opt, s)
        _save(ddp, opt, tmp_path / "pipelined", True)
        _step(ddp, opt, 3)
        want = _state(core, ddp, opt)

        _, ddp1, opt1 = _build(0.5)
        defer1 = DeferredHostStep(opt1, [ddp1])
        for s in range(3):
            _step(ddp1, opt1, s, defer1)
        assert defer1._job is not None  # step 3's host part is still running: the save must finish it
        _save(ddp1, opt1, tmp_path / "deferred", True)
        for saved, deferred in ((tmp_path / "deferred", False), (tmp_path / "pipelined", True)):
            core2, ddp2, opt2 = _build(0.5)
            defer2 = DeferredHostStep(opt2, [ddp2]) if deferred else None
            _load(ddp2, opt2, saved, True)
            _step(ddp2, opt2, 3, defer2)
            if defer2 is not None:
                defer2.close()
            _assert_same(want, _state(core2, ddp2, opt2))
        defer1.close()


def test_next_optimizer_step_waits_for_the_deferred_one(megatron_cpu, slow_host):
    """Two optimizer steps with no forward between them (the second on the same gradients): the second waits for
    the first's host part (its D2H copies) before it reads and clips the gradients again; the result is the
    pipelined steps'."""
    from dsv4_primitives.megatron import cuda_as_cpu

    def run(deferred):
        core, ddp, opt = _build(1.0)
        defer = DeferredHostStep(opt, [ddp]) if deferred else None
        _step(ddp, opt, 0, defer)
        assert opt.step()[0]
        if defer is not None:
            defer.launch()
            defer.close()
        return _state(core, ddp, opt)

    with cuda_as_cpu(), simulated_device():
        _assert_same(run(False), run(True))


def test_step_before_any_forward_is_not_deferred(megatron_cpu):
    """Without a forward yet there is no order to wait in: a step launched before any forward (a checkpoint load's
    allocation step, say) finishes at once."""
    from dsv4_primitives.megatron import cuda_as_cpu

    with cuda_as_cpu(), simulated_device():
        _, ddp, opt = _build(1.0)
        defer = DeferredHostStep(opt, [ddp])
        for p in ddp.parameters():
            p.main_grad.normal_()
        assert opt.step()[0]
        defer.launch()
        assert defer._job is None and not defer._pending
        defer.close()


def test_host_thread_error_is_raised_in_the_main_thread(megatron_cpu, monkeypatch):
    """An exception in the host thread's AdamW is raised at the main thread's next wait (the next forward's hook),
    chained to the original with its traceback; nothing hangs, and ``close`` afterwards does not raise again."""
    from dsv4_primitives.megatron import cuda_as_cpu

    calls = []

    def failing(c):
        calls.append(c)
        if len(calls) == 3:
            raise FloatingPointError("injected host failure")

    monkeypatch.setattr(offload_defer, "adamw_chunk", failing)
    with cuda_as_cpu(), simulated_device():
        _, ddp, opt = _build(1.0)
        defer = DeferredHostStep(opt, [ddp])
        _step(ddp, opt, 0, defer)
        with pytest.raises(RuntimeError, match="failed in its host thread") as info:
            _step(ddp, opt, 1, defer)
        defer.close()
    assert isinstance(info.value.__cause__, FloatingPointError)
    assert info.value.__cause__.__traceback__ is not None


def test_refusals(megatron_cpu):
    from dsv4_primitives.megatron import cuda_as_cpu

    with cuda_as_cpu(), simulated_device():
        _, ddp, opt = _build(1.0, chunk=None)
        with pytest.raises(ValueError, match="needs --optimizer-cpu-offload --optimizer-offload-overlap"):
            DeferredHostStep(opt, [ddp])


def test_cli_flag():
    from dsv4_train.cli import build_parser, train_config_from_args
    from dsv4_train.config import TrainConfig

    def tc_of(*argv):
        return train_config_from_args(build_parser().parse_args(["train", *argv]))

    on = ("--optimizer-cpu-offload", "--optimizer-offload-overlap", "--optimizer-offload-defer")
    assert tc_of(*on).optimizer.optimizer_offload_defer
    assert tc_of(*on[:2]).optimizer.optimizer_offload_defer is False
    with pytest.raises(ValueError, match="needs --optimizer-offload-overlap"):
        tc_of("--optimizer-cpu-offload", "--optimizer-offload-defer")
    with pytest.raises(ValueError, match="needs --optimizer-offload-overlap"):
        TrainConfig.from_flat(optimizer_offload_defer=True)


class _Recorder:
    """Stands in for the trainer's :class:`DeferredHostStep` (the offload needs CUDA params) and logs its calls."""

    def __init__(self, log):
        self.log = log

    def zero_grad_buffers(self, chunks):
        self.log.append("zero")
        for chunk in chunks:
            chunk.zero_grad_buffer()

    def before_backward(self):
        self.log.append("before_backward")

    def launch(self):
        self.log.append("launch")

    def finish(self):
        self.log.append("finish")

    def close(self):
        self.log.append("close")


class _EvalRecorder:
    def __init__(self, evaluator, log):
        self.evaluator, self.log = evaluator, log

    def due(self, step):
        return self.evaluator.due(step)

    def __call__(self, step):
        self.log.append("eval")
        return self.evaluator(step)


class _ParamReads(TorchFunctionMode):
    """Inside the model's forward: every op reading a param whose waiter (:class:`ForwardOrder`: the module whose
    forward pre-hook waits for it) has not begun its forward yet is recorded, i.e. a read the deferred step's hooks
    would not have waited for. Metadata (dtype, shape, ...) is no read."""

    METADATA = ("__get__", "dim", "size", "numel", "stride", "is_contiguous", "data_ptr", "element_size")

    def __init__(self, chunks):
        super().__init__()
        self.order, self.reached, self.late = ForwardOrder(chunks), -1, []
        names = {id(p): n for c in chunks for n, p in c.named_parameters()}
        self.owner = {id(p): (m, names[id(p)]) for p, m in self.order.params()}  # first owners
        for m in self.order.modules:
            m.register_forward_pre_hook(self._begin)

    def begin_forward(self) -> None:
        self.reached = -1
        self.__enter__()

    def _begin(self, module, args):
        self.order.record(module)
        self.reached = max(self.reached, self.order.rank[id(module)])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in self.METADATA:
            for a in (*args, *(kwargs or {}).values()):
                if isinstance(a, torch.nn.Parameter) and id(a) in self.owner:
                    owner, name = self.owner[id(a)]
                    if self.order.waiter(owner)[0] > self.reached:
                        self.late.append(name)
        return func(*args, **(kwargs or {}))


def test_trainer_waits_for_the_deferred_step(tmp_path):
    """The trainer's wait points, on the real (tiny, CPU) training loop: each step zeroes the grad buffers through
    the deferred step, waits before each micro-batch's backward and launches after the optimizer step; every
    evaluation and checkpoint save, the end of the run and ``close`` finish the deferred step first.

    And the hooks suffice for the DSv4 model (embedding, mHC, CSA/HCA attention, hash and learned MoE, MTP, tied
    head): a third step's forward reads no param before its owner's forward (or a later module's) has begun, in the
    order the first forward ran them."""
    tc = TrainConfig.from_flat(
        preset="tiny",
        steps=2,
        seq_len=64,
        global_batch_size=2,
        micro_batch_size=1,
        warmup_steps=0,
        out=str(tmp_path / "run"),
        progress=False,
        save_interval=1,
        eval_interval=2,
        eval_iters=1,
    )
    initialised = torch.distributed.is_initialized()
    log = []
    trainer = Trainer(tc)
    try:
        trainer.stepper.deferred = _Recorder(log)
        trainer.evaluator = _EvalRecorder(trainer.evaluator, log)
        save = trainer.checkpointer.save
        trainer.checkpointer.save = lambda step: (log.append("save"), save(step))[1]
        reads = _ParamReads([trainer.model])
        trainer.run()
        at_end = list(log)
        trainer.model.register_forward_pre_hook(lambda m, a: reads.begin_forward())
        trainer.model.register_forward_hook(lambda m, a, out: reads.__exit__(None, None, None))
        trainer._train_step(next(trainer.batches))
    finally:
        trainer.close()
        if not initialised and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    step = ["zero", "before_backward", "before_backward", "launch"]
    evaluation = [
        "finish",
        "eval",
        "before_backward",
        "before_backward",
    ]  # its forward steps wait too (no-op)
    assert at_end == [*step, "finish", "save", *step, *evaluation, "finish", "save", "finish", "finish"]
    assert log[-1] == "close"
    assert len(reads.order.rank) > 20 and reads.late == [], sorted(set(reads.late))
