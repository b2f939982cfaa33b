"""The config tree: sections are frozen and validate themselves, the three spellings (tree, nested dict / file,
flat flag names) are the same config, older flat run configs still read, the effective config resolves only the
machine's values, and ``dsv4 train --print-config`` shows it."""

import dataclasses
import json

import pytest

from dsv4_train.cli import main
from dsv4_train.config import (
    DataSection,
    ScheduleSection,
    TrainConfig,
    effective_config,
    flag_name,
    flat_settings,
)
from dsv4_train.loss_trend import loss_trend


def test_sections_are_frozen_and_hold_no_lists():
    tc = TrainConfig.from_flat(data=["a.txt"], recompute_granularity="selective", recompute_modules=["mhc"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        tc.data.seq_len = 5
    assert tc.data.sources == ("a.txt",) and tc.memory.recompute_modules == ("mhc",)


def test_three_spellings_are_one_config(tmp_path):
    tree = TrainConfig(data=DataSection(seq_len=64, packed=True), schedule=ScheduleSection(steps=7))
    flat = TrainConfig.from_flat(seq_len=64, packed=True, steps=7)
    assert tree == flat == TrainConfig.from_dict(tree.to_dict()) == TrainConfig.from_dict(tree.flat())
    (tmp_path / "c.json").write_text(
        json.dumps({"data": {"seq_len": 64, "packed": True}, "schedule": {"steps": 7}})
    )
    assert TrainConfig.from_file(tmp_path / "c.json") == tree
    assert (
        TrainConfig.from_file(tmp_path / "c.json", steps=9).schedule.steps == 9
    )  # a flag wins over the file
    assert tree.replace(steps=3).schedule.steps == 3 and tree.schedule.steps == 7


def test_older_flat_run_configs_read_and_flags_keep_their_names():
    old = {"data": ["corpus.jsonl"], "seq_len": 128, "steps": 4, "eval_data": []}  # a flat dict as 0.x wrote
    tc = TrainConfig.from_dict(old)
    assert tc.data.sources == ("corpus.jsonl",) and tc.data.seq_len == 128
    assert flat_settings(old)["sources"] == ["corpus.jsonl"] and flat_settings(tc.to_dict())["seq_len"] == 128
    assert flag_name("sources") == flag_name("data") == "--data" and flag_name("progress") == "--no-progress"


@pytest.mark.parametrize(
    "data, match",
    [
        ({"data": {"steps": 3}}, "section 'data' has no key 'steps'"),
        ({"trainer": {}}, "unknown key 'trainer'"),
        ({"schedule": {"steps": "3"}}, "key 'schedule.steps' must be an integer"),
    ],
)
def test_bad_nested_files_name_the_key(tmp_path, data, match):
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_file(tmp_path / "c.json")


def test_effective_config_resolves_only_the_machine_values():
    tc = TrainConfig.from_flat(steps=3)
    assert (
        tc.precision.bf16 is None and tc.parallel.dist_backend is None and tc.precision.deterministic is None
    )
    cpu, gpu = effective_config(tc, cuda_available=False), effective_config(tc, cuda_available=True)
    assert (cpu.precision.bf16, cpu.precision.deterministic, cpu.parallel.dist_backend) == (
        False,
        False,
        "gloo",
    )
    assert (gpu.precision.bf16, gpu.precision.deterministic, gpu.parallel.dist_backend) == (
        True,
        True,
        "nccl",
    )
    assert cpu.replace(bf16=None, deterministic=None, dist_backend=None) == tc
    assert gpu.replace(bf16=None, deterministic=None, dist_backend=None) == tc
    with pytest.raises(ValueError, match="--dist-backend nccl needs CUDA"):
        effective_config(TrainConfig.from_flat(dist_backend="nccl"), cuda_available=False)


def test_print_config_shows_the_effective_config_and_trains_nothing(tmp_path, capsys):
    assert (
        main(["train", "--steps", "3", "--seq-len", "64", "--out", str(tmp_path / "run"), "--print-config"])
        == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown["schedule"]["steps"] == 3 and shown["data"]["seq_len"] == 64
    assert shown["precision"]["bf16"] in (True, False) and shown["parallel"]["dist_backend"] in (
        "gloo",
        "nccl",
    )
    assert TrainConfig.from_dict(shown).schedule.steps == 3
    assert not (tmp_path / "run").exists()


def test_loss_trend_needs_four_finite_losses():
    rows = lambda *v: [{"lm_loss": x} for x in v]
    assert loss_trend(rows(6.0, 5.0, 4.0)) == "too few steps to tell"
    assert loss_trend(rows(6.0, 5.0, 4.0, 3.0)) == "falling"
    assert loss_trend(rows(3.0, 4.0, 5.0, 6.0)) == "NOT falling"
    assert loss_trend(rows(6.0, float("nan"), 5.0, 4.0)) == "too few steps to tell"


def test_resume_compares_resolved_paths(tmp_path, monkeypatch):
    """The same file named relative or absolute is the same source (a requeued job may start elsewhere), also
    against an older run config that kept the relative spelling."""
    from dsv4_train.checkpoint import resume_conflicts

    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.chdir(tmp_path)
    relative = effective_config(TrainConfig.from_flat(data=["a.jsonl"]), cuda_available=False)
    absolute = effective_config(TrainConfig.from_flat(data=[str(tmp_path / "a.jsonl")]), cuda_available=False)
    assert relative == absolute and relative.data.sources == (str((tmp_path / "a.jsonl").resolve()),)
    old_flat = {"data": ["a.jsonl"], "seq_len": 256}
    assert resume_conflicts(absolute, old_flat, {}) == []
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    other = effective_config(TrainConfig.from_flat(data=["b.jsonl"]), cuda_available=False)
    assert len(resume_conflicts(other, relative.to_dict(), {})) == 1
