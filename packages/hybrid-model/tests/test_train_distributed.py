"""gloo E2E on CPU: DP=2, PP=2 and EP=2 training of the tiny preset match the single-process run.

Every run starts from the same weights: the single-process reference saves its initial model as a dist checkpoint
(step 0) and the parallel runs read it with ``init_from`` (megatron resharding to their PP/EP layout), so the
comparison isolates the parallel training path: data sharding over DP, mHC stream transport between pipeline
stages (``n·d`` p2p shapes), MTP on the last stage, hash layers on the first, expert dispatch over EP, gradient
reduction, the distributed optimizer and the metric reductions. Sequences of 160 tokens give HCA (ratio 128)
entries and sparse CSA top-k selection (T > 4·k).
"""

import pytest

from dsv4_testkit import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_KEYS = ("lm_loss", "mtp_loss", "grad_norm", "lr", "balance_loss", "indexer_loss")
_BASE = dict(seq_len=160, global_batch_size=4, micro_batch_size=2, warmup_steps=1, lr=3e-3, steps=3)


def _train_worker(rank: int, world: int, kw: dict, save_initial: bool) -> list[dict]:
    from hybrid_model.training.config import TrainConfig
    from hybrid_model.training.trainer import Trainer

    trainer = Trainer(TrainConfig(progress=False, **kw))
    try:
        if save_initial:
            trainer.save_checkpoint()  # iter_0000000: the initial weights every layout starts from
        metrics = trainer.run()
    finally:
        trainer.close()
    return [{k: m.get(k) for k in _KEYS} for m in metrics]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    (metrics,) = run_distributed(_train_worker, 1, dict(_BASE, out=str(out)), True, timeout=600)
    return metrics, out / "checkpoints" / "iter_0000000"


@pytest.mark.parametrize(
    "layout",
    [dict(), dict(pp=2, micro_batch_size=1), dict(ep=2)],
    ids=["dp2", "pp2", "ep2"],
)
def test_parallel_run_matches_single_process(reference, layout, tmp_path):
    ref, init = reference
    kw = dict(_BASE, out=str(tmp_path / "run"), init_from=str(init), **layout)
    per_rank = run_distributed(_train_worker, 2, kw, False, timeout=600)
    assert per_rank[0] == per_rank[1]  # every metric is reduced over the ranks that computed it
    got = per_rank[-1]
    assert len(got) == len(ref) == _BASE["steps"]
    for step, (g, r) in enumerate(zip(got, ref, strict=True), start=1):
        for key in _KEYS:
            assert r[key] is not None, key
            # fp32 sums in another order (DP/EP reductions, PP micro-batches): equal up to rounding
            assert g[key] == pytest.approx(r[key], rel=2e-5, abs=1e-7), (layout, step, key, g[key], r[key])
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]
