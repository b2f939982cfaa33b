"""A short soak of ``dsv4 train`` (issue 29; the long one is ``benchmarks/soak.py``): 60 steps of the tiny preset with a
one-layer pattern (``W-``) in this process, an evaluation and a checkpoint save every 10 steps. After the warm-up
(the first 20 steps: lazy imports, allocator pools, the writer's first files) the open file descriptors and threads
do not grow at all and resident memory grows by less than :data:`RSS_BOUND_MB` over the remaining 40 steps and 4
saves (a leaked checkpoint buffer of this model would be ~2 MB per save, an unclosed writer one fd per save)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsv4_train.config import TrainConfig
from dsv4_train.trainer import Trainer

pytestmark = pytest.mark.slow

#: RSS growth allowed from step 20 to step 60 (MB)
RSS_BOUND_MB = 8.0


def _sample(step: int) -> dict:
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next(int(x.split()[1]) for x in status if x.startswith("VmRSS:")) / 1024
    return dict(
        step=step,
        rss_mb=rss,
        fds=len(os.listdir("/proc/self/fd")),
        threads=len(os.listdir("/proc/self/task")),
    )


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_fds_threads_and_memory_stay_flat_over_saves_and_evaluations(tmp_path):
    samples: list[dict] = []

    class Sampled(Trainer):
        def save_checkpoint(self):
            path = super().save_checkpoint()
            if not samples or samples[-1]["step"] != self.step:
                samples.append(_sample(self.step))
            return path

    tc = TrainConfig.from_flat(
        model_overrides={"hybrid_layer_pattern": "W-"},
        seq_len=32,
        global_batch_size=1,
        micro_batch_size=1,
        warmup_steps=0,
        steps=60,
        save_interval=10,
        eval_interval=10,
        eval_iters=1,
        progress=False,
        out=str(tmp_path / "run"),
    )
    trainer = Sampled(tc)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert [s["step"] for s in samples] == list(range(10, 61, 10))
    warm = [s for s in samples if s["step"] >= 20]
    table = "\n".join(str(s) for s in samples)
    assert max(s["fds"] for s in warm) == warm[0]["fds"], table
    assert max(s["threads"] for s in warm) == warm[0]["threads"], table
    assert max(s["rss_mb"] for s in warm) - warm[0]["rss_mb"] < RSS_BOUND_MB, table
    assert len(list((tmp_path / "run" / "checkpoints").glob("iter_*"))) == 6
