"""``dsv4 train`` settings and files at the boundary (issue #21), without training: numeric flags, ``--config``
value types, ``--help`` defaults, the run-directory rules, resume conflicts, checkpoint pointers, strict
``metrics.jsonl`` and the non-interactive progress lines."""

import dataclasses
import json
import math

import pytest

from dsv4_train.checkpoint import latest_checkpoint, resume_conflicts
from dsv4_train.cli import build_parser, main, train_config_from_args
from dsv4_train.config import SECTION_TYPES, TrainConfig
from dsv4_train.outputs import RunOutputs, read_metrics, strict_json_row
from dsv4_train.rundir import check_writable, clear_run, decide_resume


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--lr", "inf"], "--lr .* finite"),
        (["--lr", "nan"], "--lr .* finite"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr <= --lr"),
        (["--lr", "0"], "--lr > 0"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--clip-grad", "-1"], "--clip-grad must be >= 0"),
        (["--weight-decay", "inf"], "--weight-decay .* finite"),
        (["--max-nonfinite-steps", "0"], "--max-nonfinite-steps must be >= 1"),
        (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
        (["--log-interval", "0"], "--log-interval must be >= 1"),
        (["--model-overrides", '{"nope": 1}'], "--model-overrides: .*'nope'.*DSv4ModelConfig fields"),
        (
            ["--pp", "2", "--vpp", "8"],
            r"--pp 2 --vpp 8 with --preset tiny: pipeline_stages must be in \[1, 6\]",
        ),
        (["--cuda-graph-warmup-steps", "3"], "only applies with --cuda-graph"),
        (["--ep", "2"], r"world size 1 is not divisible by ep=2 x tp=1 x pp=1"),
        (["--packed", "--micro-batch-size", "2"], "--micro-batch-size only applies to"),
        (["--resume", "--overwrite"], "contradict"),
        (["--resume", "--init-from", "runs/x"], "--init-from"),
    ],
)
def test_invalid_numbers_and_modes_exit_2_with_one_message(flags, match, capsys, tmp_path):
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 train: error: ") and len(err.strip().splitlines()) == 1, err
    assert __import__("re").search(match, err), err
    assert not (tmp_path / "run").exists()  # refused before anything was created


@pytest.mark.parametrize(
    "value, expected",
    [
        ({"steps": "10"}, "an integer"),
        ({"lr": "3e-3"}, "a finite number"),
        ({"data": ["a.txt", 3]}, "a list of strings"),
        ({"packed": 1}, "a boolean"),
        ({"steps": 2.5}, "an integer"),
        ({"model_overrides": []}, "an object"),
    ],
)
def test_config_file_values_of_the_wrong_type_name_key_file_and_type(tmp_path, value, expected):
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps(value))
    (key,) = value
    with pytest.raises(ValueError) as e:
        TrainConfig.from_file(cfg)
    assert str(cfg) in str(e.value) and repr(key) in str(e.value) and expected in str(e.value)
    # a non-finite number in the file (Python's json reads NaN) is refused too
    cfg.write_text('{"lr": NaN}')
    with pytest.raises(ValueError, match="'lr' must be a finite number"):
        TrainConfig.from_file(cfg)


def test_every_config_field_is_a_flag_with_its_default_in_help():
    parser = build_parser()
    train = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "train")[1]
    dests = {a.dest: a for a in train._actions}
    for section in SECTION_TYPES.values():
        for f in dataclasses.fields(section):
            assert f.name in dests, f"{section.__name__}.{f.name} has no dsv4 train flag"
            assert "default" in (dests[f.name].help or ""), f"--{f.name} shows no default"
    text = train.format_help()
    assert "(default: 0.003)" in text and "(default: 5)" in text and "Exit codes" in text
    args = parser.parse_args(
        ["train", "--min-lr", "1e-5", "--warmup-steps", "3", "--model-overrides", '{"seed": 1}']
    )
    assert (args.min_lr, args.warmup_steps, args.model_overrides) == (1e-5, 3, {"seed": 1})
    assert parser.parse_args(["train", "--resume"]).resume is True
    assert parser.parse_args(["train", "--resume", "auto"]).resume == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--resume", "yes"])
    tc = train_config_from_args(parser.parse_args(["train", "--mtp-loss-weight-decay", "none"]))
    assert tc.loss.mtp_loss_weight_decay is None


def _run_dir(tmp_path, *, checkpoint: bool, metrics: bool = True):
    out = tmp_path / "run"
    (out / "tb").mkdir(parents=True)
    if metrics:
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
    if checkpoint:
        (out / "checkpoints" / "iter_0000001").mkdir(parents=True)
        (out / "checkpoints" / "iter_0000001" / "metadata.json").write_text("{}")
        (out / "checkpoints" / "latest").write_text("iter_0000001")
    return out


def test_run_directory_rules(tmp_path):
    missing = tmp_path / "nothing"
    with pytest.raises(ValueError, match=r"does not exist.*--resume auto"):
        decide_resume(TrainConfig.from_flat(out=str(missing), resume=True))
    assert decide_resume(TrainConfig.from_flat(out=str(missing), resume="auto")) is False
    assert decide_resume(TrainConfig.from_flat(out=str(missing))) is False
    out = _run_dir(tmp_path, checkpoint=False)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        decide_resume(TrainConfig.from_flat(out=str(out), resume=True))
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl, tb\).*--resume.*--overwrite"):
        decide_resume(TrainConfig.from_flat(out=str(out)))
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing touched
    assert decide_resume(TrainConfig.from_flat(out=str(out), overwrite=True)) is False
    (out / "notes.txt").write_text("mine")
    assert clear_run(out) == ["metrics.jsonl", "tb"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # only the run's own outputs are deleted
    out2 = _run_dir(tmp_path / "b", checkpoint=True)
    assert decide_resume(TrainConfig.from_flat(out=str(out2), resume=True)) is True
    assert decide_resume(TrainConfig.from_flat(out=str(out2), resume="auto")) is True


def test_unwritable_out_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_writable(blocker)
    with pytest.raises(ValueError, match="is not writable"):
        check_writable(blocker / "run")
    check_writable(tmp_path / "new" / "run")
    assert list((tmp_path / "new" / "run").iterdir()) == []  # the probe file is gone


def test_resume_conflicts_name_each_setting_and_the_reason():
    tc = TrainConfig.from_flat(lr=1e-3, steps=20)
    saved = {
        **TrainConfig.from_flat().to_dict(),
        "clip_grad": 0.5,
        "micro_batch_size": 2,
    }  # these two may change
    lines = resume_conflicts(tc, saved, {})
    assert len(lines) == 2, lines
    assert "--lr 0.001 (checkpoint: 0.003; it defines the LR schedule)" in lines[0]
    assert lines[1].startswith("--steps 20 (checkpoint: 150")
    assert resume_conflicts(TrainConfig.from_flat(), saved, {}) == []
    # checkpoints without the config file: megatron's scheduler state is compared
    sched = {"max_lr": 0.003, "min_lr": 3e-4, "lr_warmup_steps": 10, "lr_decay_steps": 150, "start_wd": 0.1}
    assert resume_conflicts(TrainConfig.from_flat(), None, sched) == []
    (line,) = resume_conflicts(TrainConfig.from_flat(lr=1e-3), None, sched)
    assert line.startswith("--lr")


def test_latest_pointer_errors_name_the_file(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "latest").write_text("iter_0000009\n")
    with pytest.raises(ValueError, match=r"latest names 'iter_0000009', which is not a checkpoint"):
        latest_checkpoint(ckpts)
    (ckpts / "iter_0000009").mkdir()
    (ckpts / "iter_0000009" / "metadata.json").write_text("{}")
    assert latest_checkpoint(ckpts) == ckpts / "iter_0000009"


def test_metrics_are_strict_json_and_corrupt_rows_are_named(tmp_path):
    row = strict_json_row({"step": 3, "lm_loss": math.nan, "grad_norm": math.inf, "lr": 1e-3})

    def no_constants(name):
        raise AssertionError(f"not strict JSON: {name}")

    assert json.loads(row, parse_constant=no_constants) == {
        "step": 3,
        "lm_loss": None,
        "grad_norm": None,
        "lr": 1e-3,
    }
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lm_lo')  # the last row was cut off by a kill
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a metrics row"):
        read_metrics(path)


def test_non_interactive_progress_is_one_line_every_log_interval(tmp_path, capsys):
    outputs = RunOutputs(tmp_path, enabled=True, append=False, total=5, progress=True, log_interval=2)
    outputs.start()
    for step in range(1, 6):
        lm = math.nan if step == 4 else 5.0 - step
        outputs.log(
            {
                "step": step,
                "lm_loss": lm,
                "grad_norm": 1.0,
                "lr": 1e-3,
                "tokens_per_s": 10.0,
                "mfu": 0.01,
                "nonfinite": step == 4,
                "skipped": step == 4,
            }
        )
    outputs.close()
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == [
        "dsv4 train: step 2/5",
        "dsv4 train: step 4/5",
        "dsv4 train: step 5/5",
    ]
    assert "\r" not in "".join(lines) and "NON-FINITE" in lines[1] and "update skipped" in lines[1]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[3]["lm_loss"] is None and rows[4]["lm_loss"] == 0.0
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_an_unusable_checkpoint_directory_is_refused_at_start(tmp_path, capsys):
    """A --resume auto run whose checkpoints/ cannot be written (here: a file in its place) stops before any work,
    naming the directory, instead of at the first save."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")
    assert main(["train", "--steps", "1", "--out", str(out), "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint directory {out / 'checkpoints'} is a file, not a directory" in err, err


def test_resume_refusal_advice_fits_what_changed(tmp_path):
    """A changed LR schedule may start a new run from the checkpoint's weights (--init-from); a changed model may
    not (those weights are the old model's), so its refusal does not suggest --init-from."""
    from dsv4_train.checkpoint import TRAIN_CONFIG_FILE, check_resumable

    ck = tmp_path / "iter_0000002"
    ck.mkdir()
    (ck / TRAIN_CONFIG_FILE).write_text(json.dumps(TrainConfig.from_flat().to_dict()))
    with pytest.raises(ValueError, match=r"(?s)--lr 0.01 .*--init-from .*iter_0000002 --out NEW_DIR"):
        check_resumable(TrainConfig.from_flat(lr=1e-2), ck, {})
    with pytest.raises(ValueError, match="--model-overrides") as model:
        check_resumable(TrainConfig.from_flat(model_overrides={"num_layers": 4}), ck, {})
    assert "with --init-from" not in str(model.value) and "without --init-from" in str(model.value)
