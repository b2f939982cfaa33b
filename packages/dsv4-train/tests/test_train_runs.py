"""``dsv4 train`` runs that go wrong (issue #21), on CPU with the tiny preset and a few steps: non-finite steps are
skipped and counted and stop the run after ``--max-nonfinite-steps`` in a row, a NaN model is never saved, a
checkpoint is written once per step, resume refuses changed schedules and names unreadable checkpoints; through
the CLI: an existing run directory is never overwritten, ``--resume auto`` says what it did, SIGTERM saves and
exits 143, progress is one line per step when stdout is a pipe, and megatron's unactionable warnings are gone."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_BASE = [
    "--seq-len",
    "64",
    "--global-batch-size",
    "2",
    "--micro-batch-size",
    "2",
    "--warmup-steps",
    "0",
    "--log-interval",
    "1",
]

_RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from dsv4_train import step as step_mod
    from dsv4_train.checkpoint import Checkpointer
    from dsv4_train.config import TrainConfig
    from dsv4_train.outputs import read_metrics
    from dsv4_train.trainer import Trainer, TrainingDiverged

    POISON, current, saves, snap = set(), {"step": -1}, [], {}
    orig_call, orig_fwd, orig_save = step_mod.StepRunner.__call__, step_mod.StepRunner.forward_step, Checkpointer.save

    def call(self, batch, step):  # remember the step; snapshot the weights around the first poisoned one
        current["step"] = step
        first = step in POISON and "before" not in snap
        if first:
            snap["before"] = [p.detach().clone() for p in self.core.parameters()]
        m = orig_call(self, batch, step)
        if first:
            snap["unchanged"] = all(torch.equal(a, p) for a, p in zip(snap["before"], self.core.parameters()))
        return m

    def fwd(self, it, model):  # a NaN in the per-token LM losses of a poisoned step: NaN loss and gradients
        out, loss_func = orig_fwd(self, it, model)
        return (out * float("nan") if current["step"] in POISON else out), loss_func

    def save(self, step):
        saves.append(step)
        return orig_save(self, step)

    step_mod.StepRunner.__call__, step_mod.StepRunner.forward_step, Checkpointer.save = call, fwd, save

    if __name__ == "__main__":
        out, res = Path(sys.argv[1]), {}
        base = dict(seq_len=64, global_batch_size=2, micro_batch_size=2, warmup_steps=0, progress=False)
        latest = lambda run: (out / run / "checkpoints" / "latest").read_text()

        # one poisoned step (the 2nd) is skipped and counted; the run completes and saves step 3 once
        POISON.add(1)
        t = Trainer(TrainConfig.from_flat(steps=3, save_interval=3, out=str(out / "one"), **base))
        ms = t.run()
        t.close()
        rows = read_metrics(out / "one" / "metrics.jsonl")
        res["one"] = dict(
            nonfinite=[m["nonfinite"] for m in ms], skipped=[m["skipped"] for m in ms],
            lm=[r.get("lm_loss") for r in rows], grad_norm=[r.get("grad_norm") for r in rows],
            lr=[r["lr"] for r in rows], total=t.nonfinite_steps, saves=list(saves), latest=latest("one"),
            unchanged=snap["unchanged"],
        )

        # resume with another LR: refused with the reason, before anything is loaded
        try:
            Trainer(TrainConfig.from_flat(steps=3, lr=1e-3, resume=True, out=str(out / "one"), **base))
            res["lr_change"] = "accepted"
        except ValueError as e:
            res["lr_change"] = str(e)

        # a truncated shard: the error names the file, the checkpoint and what to do (dsv4_train.ckpt_integrity)
        shard = sorted((out / "one" / "checkpoints" / "iter_0000003").glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
        try:
            Trainer(TrainConfig.from_flat(steps=3, resume=True, out=str(out / "one"), **base))
            res["corrupt"] = "loaded"
        except ValueError as e:
            res["corrupt"] = str(e)

        # poisoned from the 2nd step on: stops after 2 in a row, nothing saved after the last finite step
        POISON.update(range(1, 10))
        saves.clear()
        t = Trainer(TrainConfig.from_flat(steps=6, save_interval=1, max_nonfinite_steps=2, out=str(out / "two"), **base))
        try:
            t.run()
            res["two"] = "completed"
        except TrainingDiverged as e:
            res["two"] = dict(error=str(e), saves=list(saves), latest=latest("two"))
        with torch.no_grad():  # a NaN model is never saved
            next(t.core.parameters()).fill_(float("nan"))
        try:
            t.save_checkpoint()
            res["nan_save"] = "saved"
        except TrainingDiverged as e:
            res["nan_save"] = dict(error=str(e), latest=latest("two"))
        t.close()
        print("RESULTS " + json.dumps(res))
    """
)


def test_nonfinite_steps_checkpoints_and_resume_checks(tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(_RUNNER)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")][-1][len("RESULTS ") :])
    one = res["one"]
    assert one["nonfinite"] == [False, True, False] and one["skipped"] == [False, True, False]
    assert one["unchanged"]  # the skipped step did not touch the weights
    assert one["lm"][1] is None and one["grad_norm"][1] is None  # strict JSON: null for the non-finite loss
    assert None not in (one["lm"][0], one["lm"][2]) and one["total"] == 1
    assert one["lr"][1] > one["lr"][2]  # the skipped step kept its place in the LR schedule
    assert one["saves"] == [3] and one["latest"] == "iter_0000003"  # interval and final save: one write
    assert "--lr 0.001 (checkpoint: 0.003; it defines the LR schedule)" in res["lr_change"]
    assert "--init-from" in res["lr_change"]
    assert "iter_0000003: its file __0_0.distcp is truncated (100 bytes" in res["corrupt"], res["corrupt"]
    assert "latest" in res["corrupt"]
    two = res["two"]
    assert isinstance(two, dict), two
    assert "steps 2-3" in two["error"] and "lower --lr" in two["error"]
    assert two["saves"] == [1, 2] and two["latest"] == "iter_0000002"
    assert "non-finite weights" in res["nan_save"]["error"] and res["nan_save"]["latest"] == "iter_0000002"


def _cli(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run(
        [sys.executable, "-m", "dsv4_train", "train", *_BASE, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        **kw,
    )


def test_cli_run_directory_exit_codes_and_output(tmp_path, capsys):
    from dsv4_train.cli import main
    from dsv4_train.quiet import QUIET_LOG_RECORDS, QUIET_WARNINGS

    run = tmp_path / "run"
    first = _cli(["--steps", "2", "--out", str(run)])
    assert first.returncode == 0, first.stderr[-4000:]
    lines = [x for x in first.stdout.splitlines() if x.startswith("dsv4 train: step ")]
    assert [x.split(" | ")[0] for x in lines] == ["dsv4 train: step 1/2", "dsv4 train: step 2/2"]
    assert "\r" not in first.stdout + first.stderr
    for _, message in QUIET_WARNINGS + tuple((None, m) for _, m in QUIET_LOG_RECORDS):
        assert message.replace("\\", "")[:30] not in first.stderr, (message, first.stderr)
    metrics = (run / "metrics.jsonl").read_bytes()

    # no --resume, no --overwrite: refused before anything is built, nothing changed (in this process: the same
    # main() as the command, without paying another interpreter start and imports)
    capsys.readouterr()
    again = main(["train", *_BASE, "--steps", "2", "--out", str(run)])
    err = capsys.readouterr().err
    assert again == 2 and "already holds a run" in err, err[-2000:]
    assert (run / "metrics.jsonl").read_bytes() == metrics

    # --resume auto on a fresh directory starts a new run and says so; SIGTERM saves and exits 143
    run2 = tmp_path / "run2"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-m", "dsv4_train", "train", *_BASE, "--steps", "6", "--out", str(run2)]
    proc = subprocess.Popen(
        [*cmd, "--resume", "auto"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("dsv4 train: step 2/6"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=600)
    seen.append(out)
    text = "".join(seen)
    assert proc.returncode == 143, (text, err[-3000:])
    assert "--resume auto: no checkpoint" in text and "interrupted at step" in text
    saved = (run2 / "checkpoints" / "latest").read_text()
    step = int(saved.removeprefix("iter_"))
    assert 2 <= step < 6

    resumed = subprocess.run([*cmd, "--resume", "auto"], capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming {run2 / 'checkpoints' / saved} at step {step}" in resumed.stdout
    rows = [json.loads(x) for x in (run2 / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))


def test_an_exploding_loss_stops_the_run_and_saves_nothing(tmp_path, capsys):
    """A diverging run whose numbers stay finite (``--lr 1e4``): each step whose LM loss is over
    ``--max-loss-growth`` x the lowest so far is skipped like a non-finite one, ``--max-nonfinite-steps`` of them in a
    row stop the run (exit 1), and no checkpoint holds the exploded weights."""
    from dsv4_train.cli import main
    from dsv4_train.config import TrainConfig

    out = tmp_path / "run"
    argv = ["train", "--steps", "6", "--seq-len", "64", "--global-batch-size", "2", "--micro-batch-size", "2"]
    argv += ["--lr", "1e4", "--warmup-steps", "0", "--save-interval", "1", "--max-nonfinite-steps", "2"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "is over --max-loss-growth 10 x the run's lowest" in captured.out
    assert "the run diverged" in captured.err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["exploded"] for r in rows] == [False, True, True]
    saved = sorted(p.name for p in (out / "checkpoints").glob("iter_*"))
    assert saved == ["iter_0000001"]  # the step before the explosion; never an exploded one
    with pytest.raises(ValueError, match="--max-loss-growth must be 0 \\(off\\) or > 1"):
        TrainConfig.from_flat(max_loss_growth=0.5)
