"""Faults and integrity of ``dsv4 train`` checkpoints (issue 29), in this process on the tiny preset with a one-layer
pattern (``W-``) and 4 steps of 32 tokens, all assertions sharing the runs of one module fixture:

* A save that fails half-way (``ENOSPC`` injected into megatron's shard writer after part of a shard is written,
  then a ``KeyboardInterrupt`` at the same place) publishes nothing: ``checkpoints/latest`` still names the previous
  checkpoint, no partial directory is left, the error names the path and the cause; ``--resume`` then continues
  from the previous checkpoint with losses bitwise equal to the uninterrupted run's (same process, same machine).
* Integrity: a flipped byte, a truncated shard, a deleted shard and a deleted manifest are each refused before
  anything is loaded, with one line naming the file and the checkpoint (``--resume``, ``--init-from``,
  ``dsv4 convert``); a checkpoint saved in the format before manifests existed loads with a note.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil

import pytest
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from dsv4_primitives.megatron import cuda_as_cpu
from dsv4_train.atomic_save import CheckpointSaveError
from dsv4_train.checkpoint import TRAIN_CONFIG_FILE
from dsv4_train.ckpt_integrity import MANIFEST_FILE, file_digest, read_manifest
from dsv4_train.cli import main
from dsv4_train.config import TrainConfig
from dsv4_train.trainer import Trainer

pytestmark = pytest.mark.slow

_BASE = dict(
    model_overrides={"hybrid_layer_pattern": "W-"},
    seq_len=32,
    global_batch_size=1,
    micro_batch_size=1,
    warmup_steps=0,
    steps=4,
    save_interval=2,
    progress=False,
)


def _trainer(**kw) -> Trainer:
    return Trainer(TrainConfig.from_flat(**(_BASE | kw)))


def _failing_writer(error: BaseException):
    """megatron's ``_write_item`` that writes part of its data, then raises ``error``."""
    original = filesystem_async._write_item

    @functools.wraps(original)  # keeps the signature megatron inspects
    def write_item(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "write"))
        stream.write(b"\0" * 4096)
        raise error

    return write_item


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    res: dict = {}
    t = _trainer(out=str(tmp / "ref"))  # uninterrupted: saves at steps 2 and 4
    try:
        res["ref"] = [m["lm_loss"] for m in t.run()]
    finally:
        t.close()

    t = _trainer(out=str(tmp / "fail"))
    mp = pytest.MonkeyPatch()
    try:
        original = filesystem_async._write_item
        saves = {"n": 0}

        @functools.wraps(original)
        def second_save_fails(*args, **kwargs):  # the save of step 4 runs out of disk space
            if saves["n"] >= 1:
                return _failing_writer(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))(*args, **kwargs)
            return original(*args, **kwargs)

        real_save = t.checkpointer.save

        def counted_save(step):
            try:
                return real_save(step)
            finally:
                saves["n"] += 1

        mp.setattr(filesystem_async, "_write_item", second_save_fails)
        mp.setattr(t.checkpointer, "save", counted_save)
        with pytest.raises(CheckpointSaveError) as enospc:
            t.run()
        res["enospc"] = str(enospc.value)
        res["fail_losses"] = [m["lm_loss"] for m in t.metrics]
        res["after_enospc"] = sorted(p.name for p in (tmp / "fail" / "checkpoints").iterdir())
        res["latest_after_enospc"] = (tmp / "fail" / "checkpoints" / "latest").read_text()
        mp.setattr(filesystem_async, "_write_item", _failing_writer(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            t.save_checkpoint()  # an interrupt during the write of step 4 (the trainer is at step 4)
        res["after_interrupt"] = sorted(p.name for p in (tmp / "fail" / "checkpoints").iterdir())
    finally:
        mp.undo()
        t.close()

    killed = tmp / "fail" / "checkpoints" / ".iter_0000003.partial"  # what a save killed outright leaves
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"\0" * 100)
    t = _trainer(out=str(tmp / "fail"), resume=True)  # continues from step 2
    try:
        res["resumed"] = [m["lm_loss"] for m in t.run()]
        res["resumed_steps"] = [m["step"] for m in t.metrics]
        res["after_resume"] = sorted(p.name for p in (tmp / "fail" / "checkpoints").iterdir())
        # the format before manifests: megatron's files, the run config and latest (what the earlier save wrote)
        legacy = tmp / "legacy" / "checkpoints" / "iter_0000004"
        legacy.mkdir(parents=True)
        with cuda_as_cpu():
            dist_checkpointing.save(t.checkpointer.sharded_state(4, loading=False), str(legacy))
        shutil.copy(tmp / "fail" / "checkpoints" / "iter_0000004" / TRAIN_CONFIG_FILE, legacy)
        (legacy.parent / "latest").write_text(legacy.name)
    finally:
        t.close()
    res["tmp"] = tmp
    return res


def test_failed_save_keeps_latest_and_resume_is_exact(runs):
    ckpt = runs["tmp"] / "fail" / "checkpoints"
    assert runs["fail_losses"] == runs["ref"]  # the failed save changed nothing of the training itself
    msg = runs["enospc"]
    assert f"saving the checkpoint of step 4 into {ckpt / 'iter_0000004'} failed" in msg, msg
    assert (
        "([Errno 28] No space left on device)" in msg and f"{ckpt / 'latest'} still names iter_0000002" in msg
    )
    assert "\n" not in msg
    for key in ("after_enospc", "after_interrupt"):  # nothing partial or half-published
        assert runs[key] == ["iter_0000002", "latest"], (key, runs[key])
    assert runs["latest_after_enospc"] == "iter_0000002"
    # the resumed run trains steps 3 and 4 from the step-2 checkpoint: bitwise the uninterrupted run's losses
    assert runs["resumed_steps"] == [3, 4]
    assert runs["resumed"] == runs["ref"][2:]
    assert runs["after_resume"] == [
        "iter_0000002",
        "iter_0000004",
        "latest",
    ]  # the killed save's leftovers: gone
    manifest = read_manifest(ckpt / "iter_0000004")
    assert {"__0_0.distcp", ".metadata", "metadata.json", TRAIN_CONFIG_FILE} <= set(manifest)
    shard = ckpt / "iter_0000004" / "__0_0.distcp"
    assert manifest["__0_0.distcp"] == {"bytes": shard.stat().st_size, "sha256": file_digest(shard)}


def _damaged(runs, name: str, damage) -> str:
    """A copy of the reference run with ``damage(iter_0000004 directory)`` applied; returns the run directory."""
    src, dst = runs["tmp"] / "ref", runs["tmp"] / f"damaged-{name}"
    shutil.copytree(src, dst)
    damage(dst / "checkpoints" / "iter_0000004")
    return str(dst)


def _flip(d):
    shard = d / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _truncate(d):
    shard = d / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1000])


DAMAGES = {
    "flip": (_flip, "its file __0_0.distcp was altered (its sha256 digest differs"),
    "truncate": (_truncate, "its file __0_0.distcp is truncated ("),
    "delete-shard": (lambda d: (d / "__0_0.distcp").unlink(), "its file __0_0.distcp is missing"),
    "delete-manifest": (lambda d: (d / MANIFEST_FILE).unlink(), f"its {MANIFEST_FILE} is missing"),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_damaged_checkpoint_is_refused_naming_the_file(runs, name):
    damage, expected = DAMAGES[name]
    out = _damaged(runs, name, damage)
    with pytest.raises(ValueError) as e:
        _trainer(out=out, resume=True)
    msg = str(e.value)
    assert msg.startswith(f"--resume: checkpoint {out}/checkpoints/iter_0000004: {expected}"), msg
    assert f"write the name of an older iter_XXXXXXX into {out}/checkpoints/latest" in msg and "\n" not in msg


def test_init_from_and_convert_refuse_a_damaged_checkpoint(runs, capsys, tmp_path):
    out = _damaged(runs, "flip-init", _flip)
    t = None
    with pytest.raises(
        ValueError, match=r"^--init-from .*: checkpoint .*iter_0000004: its file __0_0.distcp was"
    ):
        t = _trainer(out=str(tmp_path / "new"), init_from=out, save_interval=0)
        try:
            t.run()
        finally:
            t.close()
    assert main(["convert", out, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "dsv4 convert: error: dsv4 convert " in err and "__0_0.distcp was altered" in err
    assert not (tmp_path / "hf").exists()


def test_checkpoint_without_manifest_loads_with_a_note(runs, capsys):
    out = runs["tmp"] / "legacy"
    t = _trainer(out=str(out), resume=True)  # at step 4 of 4: loads, trains nothing, saves nothing
    try:
        assert t.run() == [] and t.step == 4
    finally:
        t.close()
    printed = capsys.readouterr().out
    assert f"dsv4 train: note: checkpoint {out}/checkpoints/iter_0000004 has no {MANIFEST_FILE}" in printed
    assert not (out / "checkpoints" / "iter_0000004" / MANIFEST_FILE).exists()
    assert json.loads((out / "checkpoints" / "iter_0000004" / TRAIN_CONFIG_FILE).read_text())["data"]


def test_dist_timeout_flag(capsys, tmp_path):
    assert TrainConfig.from_flat().parallel.dist_timeout == 600.0
    assert TrainConfig.from_flat(dist_timeout=30).parallel.dist_timeout == 30
    assert main(["train", "--dist-timeout", "0", "--out", str(tmp_path / "run")]) == 2
    assert "--dist-timeout must be > 0 seconds, got 0" in capsys.readouterr().err


def test_cli_reports_a_failed_save_in_one_line(monkeypatch, capsys, tmp_path):
    """``dsv4 train`` whose (final) save runs out of disk space: exit 1, one error line naming the checkpoint path,
    no partial directory, no ``latest``."""
    monkeypatch.setattr(
        filesystem_async, "_write_item", _failing_writer(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    )
    out = tmp_path / "run"
    argv = [
        "train",
        "--pattern",
        "W-",
        "--seq-len",
        "32",
        "--global-batch-size",
        "1",
        "--micro-batch-size",
        "1",
    ]
    assert main([*argv, "--steps", "1", "--no-progress", "--out", str(out)]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dsv4 train:")]
    assert err == [
        f"dsv4 train: error: saving the checkpoint of step 1 into {out}/checkpoints/iter_0000001 failed ([Errno 28] "
        "No space left on device); nothing was published (there is no earlier checkpoint): fix the cause (e.g. free "
        "disk space) and start again with --resume auto"
    ], err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == []
