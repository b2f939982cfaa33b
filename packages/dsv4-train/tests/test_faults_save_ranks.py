"""A save that fails on one rank of two (gloo, DP2; issue 29): ``ENOSPC`` injected into rank 1's shard writer at the
save of step 2. Both ranks raise the same ``CheckpointSaveError`` naming the checkpoint, the failing rank and its
cause (megatron reports the write failure on its coordinator only: the ranks gather their causes), nothing is
published and ``latest`` still names step 1's checkpoint on disk."""

from __future__ import annotations

import errno
import functools
import os

import pytest

from dsv4_testkit import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _fail_rank1_second_save(rank: int, world: int, out: str):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from dsv4_train.atomic_save import CheckpointSaveError
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    kw = dict(model_overrides={"hybrid_layer_pattern": "W-"}, steps=2, seq_len=32, global_batch_size=2)
    t = Trainer(TrainConfig.from_flat(micro_batch_size=1, save_interval=1, progress=False, out=out, **kw))
    original, real_save, saves = filesystem_async._write_item, t.checkpointer.save, []

    def counted_save(step):
        try:
            return real_save(step)
        finally:
            saves.append(step)

    @functools.wraps(original)  # keeps the signature megatron inspects
    def write_item(*args, **kwargs):
        if rank == 1 and saves:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(*args, **kwargs)

    t.checkpointer.save = counted_save
    filesystem_async._write_item = write_item
    try:
        t.run()
        result = "completed"
    except CheckpointSaveError as e:
        result = str(e)
    finally:
        filesystem_async._write_item = original
        t.close()
    return result, sorted(os.listdir(os.path.join(out, "checkpoints")))


def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path):
    out = tmp_path / "run"
    results = run_distributed(_fail_rank1_second_save, 2, str(out), timeout=600)
    expected = (
        f"saving the checkpoint of step 2 into {out}/checkpoints/iter_0000002 failed (rank 1: [Errno 28] No space "
        f"left on device); nothing was published ({out}/checkpoints/latest still names iter_0000001): fix the cause "
        "(e.g. free disk space) and continue with --resume"
    )
    assert results == [(expected, ["iter_0000001", "latest"])] * 2, results
