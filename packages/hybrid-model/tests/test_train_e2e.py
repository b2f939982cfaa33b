"""End-to-end CPU training: loss falls, same seed -> same losses, save at k + resume == uninterrupted run."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_RUNNER = textwrap.dedent(
    """
    import json, sys
    from hybrid_model.training.config import TrainConfig
    from hybrid_model.training.trainer import train

    if __name__ == "__main__":
        kw = json.loads(sys.argv[1])
        ms = train(TrainConfig(progress=False, **kw))
        print("METRICS " + json.dumps([m["lm_loss"] for m in ms]))
    """
)


def _train(tmp_path, **kw) -> list[float]:
    """One training run in a fresh process (megatron's global state starts clean)."""
    script = tmp_path / "run_train.py"
    script.write_text(_RUNNER)
    base = dict(seq_len=64, global_batch_size=4, micro_batch_size=2, warmup_steps=2, lr=3e-3)
    base.update(kw)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(base)], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("METRICS ")][-1]
    return json.loads(line[len("METRICS ") :])


def test_loss_falls_and_outputs_written(tmp_path):
    out = tmp_path / "run"
    losses = _train(tmp_path, steps=30, out=str(out))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, losses
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in (
        "lm_loss",
        "mtp_loss",
        "indexer_loss",
        "balance_loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "mfu",
    ):
        assert key in rows[-1], key
    assert (out / "loss.png").stat().st_size > 0
    assert any((out / "tb").iterdir())


def test_same_seed_same_losses(tmp_path):
    full = _train(tmp_path, steps=4, out=str(tmp_path / "full"))
    again = _train(tmp_path, steps=4, out=str(tmp_path / "again"), save_interval=2)
    assert again == full  # same seed, same losses (checkpointing does not perturb training)


@pytest.mark.xfail(
    strict=True,
    reason="known bug: after --resume the first step matches but later steps drift (optimizer state restore); "
    "reported in the hybrid-model README",
)
def test_exact_resume(tmp_path):
    full = _train(tmp_path, steps=6, out=str(tmp_path / "full"))
    run = tmp_path / "run"
    _train(tmp_path, steps=6, out=str(run), save_interval=3)
    # resume from the checkpoint at step 3: steps 4..6 must equal the uninterrupted run
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(rows[:3]) + "\n")
    (run / "checkpoints" / "latest").write_text("iter_0000003")
    tail = _train(tmp_path, steps=6, out=str(run), resume=True)
    assert tail[0] == full[3]  # the restored model reproduces step 4 exactly
    assert tail == full[3:]
