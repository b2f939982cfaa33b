"""Losing a rank (issue 29): ``torchrun --nproc-per-node 2 -m dsv4_train train`` on gloo, where rank 1 kills itself
(SIGKILL, the test hook ``DSV4_TRAIN_TEST_KILL_RANK_AT_STEP=1:4:save``) in the middle of the checkpoint save of
step 4, after writing its shard file and before the ranks agree to publish it.

Rank 0 stops within seconds (its gloo connection to rank 1 closes; the heartbeat probe names the rank) with one line
naming rank 1 and the checkpoint ``latest`` still names; exit status non-zero, no traceback of ours. The half-written
save of step 4 is removed and ``iter_0000002`` stays loadable (its manifest verifies). ``--resume`` with the same
command continues from step 2: steps 3 and 4 have bitwise the losses the killed run logged for them (it logged step 4
before its save; same machine, same process layout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4_train.ckpt_integrity import verify_checkpoint
from dsv4_train.lost_rank import KILL_HOOK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_ARGS = ["--pattern", "W-", "--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "1"]
_ARGS += ["--steps", "4", "--save-interval", "2", "--warmup-steps", "0", "--log-interval", "1"]
_ARGS += ["--dist-timeout", "60"]
#: seconds from the killed rank's last metrics row to the end of torchrun (the survivor's probe takes 3)
STOP_BOUND_S = 60


def _torchrun(out: Path, *extra: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "dsv4_train", "train", *_ARGS]
    env = {k: v for k, v in os.environ.items() if k != KILL_HOOK_ENV} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*cmd, "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=env | (env_extra or {}),
    )


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lm_loss"] for r in rows}


def test_a_lost_rank_stops_the_others_and_resume_is_exact(tmp_path):
    out = tmp_path / "run"
    killed = _torchrun(out, env_extra={KILL_HOOK_ENV: "1:4:save"})
    ended = time.time()
    assert killed.returncode != 0, killed.stdout[-3000:]
    ours = [x for x in killed.stderr.splitlines() if x.startswith("dsv4 train: error:")]
    assert ours == [
        f"dsv4 train: error: rank 1 of 2 stopped responding during step 4 (its process ended or hangs): rank 0 "
        f"stops too; {out}/checkpoints/latest names iter_0000002: start the run again with --resume"
    ], killed.stdout[-2000:] + killed.stderr[-4000:]
    assert "[rank0]: Traceback" not in killed.stderr, killed.stderr[-5000:]
    assert ended - (out / "metrics.jsonl").stat().st_mtime < STOP_BOUND_S
    ckpt = out / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest"]  # no partial save of step 4
    assert (ckpt / "latest").read_text() == "iter_0000002" and verify_checkpoint(ckpt / "iter_0000002")
    before = _losses(out)
    assert sorted(before) == [1, 2, 3, 4]

    resumed = _torchrun(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"resuming {out}/checkpoints/iter_0000002 at step 2" in resumed.stdout
    after = _losses(out)
    assert sorted(after) == [1, 2, 3, 4]
    assert [after[s] for s in (3, 4)] == [before[s] for s in (3, 4)]
    assert (ckpt / "latest").read_text() == "iter_0000004" and verify_checkpoint(ckpt / "iter_0000004")
