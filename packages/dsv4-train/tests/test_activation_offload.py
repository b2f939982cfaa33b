"""``--offload-activations`` on CPU: the saved-tensor hooks' path, with CPU tensors standing in for CUDA ones
(``ActivationOffload(device_type="cpu")`` copies them into fresh host buffers the same way). Which saved tensors
move (large, contiguous, not parameters), that they come back bit for bit, and that full-recompute training steps
through the trainer (megatron's checkpoint saves each chunk's input through the hooks) give the losses and gradient
norms of the steps without them. The CUDA run (pinned buffers, non-blocking copies) is
``test_activation_offload_gpu.py``."""

from __future__ import annotations

import torch

from dsv4_train.activation_offload import ActivationOffload
from dsv4_train.config import TrainConfig
from dsv4_train.trainer import Trainer
from dsv4_train.virtual_pipeline import ddp_chunks


def test_large_saved_tensors_move_and_come_back_exactly():
    torch.manual_seed(0)
    w = torch.nn.Linear(256, 256, bias=False)  # a parameter: saved by the product, never moved
    x = torch.randn(512, 256, requires_grad=True)  # [T, d] fp32, 512 KiB
    small = torch.randn(4, 256, requires_grad=True)  # 4 KiB: below min_bytes

    def grads(offload):
        x.grad = small.grad = w.weight.grad = None
        with offload.hooks() if offload is not None else torch.enable_grad():
            h = torch.tanh(w(x))  # linear saves x; tanh saves h
            loss = (h**2).sum() + (small**2).sum() + (h[:, :1] * 2).sum()  # pow saves h; small stays
        loss.backward()
        return x.grad.clone(), small.grad.clone(), w.weight.grad.clone()

    reference = grads(None)
    offload = ActivationOffload([w], min_bytes=64 * 1024, device_type="cpu")
    assert all(torch.equal(a, b) for a, b in zip(reference, grads(offload), strict=True))
    assert offload.offloaded_bytes == 3 * 512 * 256 * 4  # x once, h twice; not the weight, not small


def _steps(tmp_path, name: str, offload: bool) -> tuple[list[dict], int]:
    tc = TrainConfig.from_flat(
        preset="tiny",
        steps=2,
        seq_len=128,
        global_batch_size=2,
        micro_batch_size=1,
        warmup_steps=0,
        seed=3,
        out=str(tmp_path / name),
        progress=False,
        save_final=False,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    initialised = torch.distributed.is_initialized()
    trainer = Trainer(tc)
    try:
        hooks = (
            ActivationOffload(ddp_chunks(trainer.model), min_bytes=1, device_type="cpu") if offload else None
        )
        trainer.stepper.activation_offload = hooks  # what --offload-activations sets on CUDA
        metrics = []
        for _ in range(2):
            metrics.append(trainer._train_step(next(trainer.batches)))
            trainer.step += 1
        return metrics, hooks.offloaded_bytes if hooks else 0
    finally:
        trainer.close()
        if not initialised and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_full_recompute_steps_through_the_hooks_equal_the_plain_steps(tmp_path):
    plain, _ = _steps(tmp_path, "plain", offload=False)
    moved, nbytes = _steps(tmp_path, "moved", offload=True)
    # every checkpointed chunk's input streams went through the hooks: 2 steps x 2 micro-batches x (6 main
    # sub-layers + the MTP depth's 4 chunks) x [128, 1, 4 * 64] fp32 at least
    assert nbytes >= 2 * 2 * 10 * 128 * 4 * 64 * 4
    keys = ("lm_loss", "mtp_loss", "balance_loss", "indexer_loss", "grad_norm")
    for a, b in zip(plain, moved, strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys], (a, b)
