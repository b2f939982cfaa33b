"""The run directory (``--out``) rules of ``dsv4 train``: it must be writable; an existing run in it is continued
only with ``--resume`` (which then needs a checkpoint) and replaced only with ``--overwrite``; ``--resume auto``
continues when there is a checkpoint and starts fresh otherwise (job requeues)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dsv4_train.config import TrainConfig

# what a run writes into --out (``--overwrite`` deletes exactly these)
#: the effective config of the run's last start (``dsv4 train --print-config`` shows it without training)
CONFIG_FILE = "dsv4_train_config.json"  # not config.json: that names an HF checkpoint directory
RUN_OUTPUTS = ("metrics.jsonl", "loss.png", "tb", "checkpoints", CONFIG_FILE)


def check_writable(out: Path, what: str = "--out") -> None:
    """Create ``out`` (and parents) and write a probe file into it; ``ValueError`` naming ``what`` and ``out`` when
    that fails."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is a file, not a directory: choose another --out")
    probe = out / f".dsv4-write-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"{what} {out} is not writable ({e.strerror or e}): choose a writable --out or fix its permissions"
        ) from e


def first_missing(out: Path) -> Path | None:
    """The outermost directory of ``out`` (``out`` itself or a parent) that does not exist yet: what a run that
    fails to start removes again (:func:`remove_created`); ``None`` when ``out`` exists."""
    missing = None
    for p in (out.absolute(), *out.absolute().parents):
        if p.exists():
            break
        missing = p
    return missing


def remove_created(out: Path, top: Path | None) -> None:
    """Remove ``out`` and its parents up to ``top`` (:func:`first_missing` before the run) while they are empty: a
    run that failed before writing anything leaves no empty --out behind."""
    if top is None:
        return
    p = out.absolute()
    top = top.absolute()
    while p.is_dir() and not any(p.iterdir()):
        try:
            p.rmdir()
        except OSError:  # another rank of the run removed it first, or wrote into it
            break
        if p == top:
            break
        p = p.parent


def existing_outputs(out: Path) -> list[str]:
    """The run outputs that ``out`` already holds (names from :data:`RUN_OUTPUTS`)."""
    return [name for name in RUN_OUTPUTS if (out / name).exists()]


def has_checkpoint(out: Path) -> bool:
    return (out / "checkpoints" / "latest").is_file()


def decide_resume(tc: TrainConfig) -> bool:
    """Whether this run continues from ``out/checkpoints/latest`` (``ValueError`` when the request cannot be met;
    nothing is changed on disk). Call :func:`clear_run` afterwards for ``--overwrite`` / a fresh ``--resume auto``."""
    out = Path(tc.checkpoint.out)
    if tc.checkpoint.resume is True:
        if not out.is_dir():
            raise ValueError(
                f"--resume: the run directory {out} does not exist; check --out, or use --resume auto to start a new "
                "run when there is nothing to resume"
            )
        if not has_checkpoint(out):
            raise ValueError(
                f"--resume: {out} holds no checkpoint ({out / 'checkpoints' / 'latest'} is missing); check --out, or "
                "use --resume auto to start a new run when there is nothing to resume"
            )
        return True
    if tc.checkpoint.resume == "auto":
        return has_checkpoint(out)
    found = existing_outputs(out)
    if found and not tc.checkpoint.overwrite:
        raise ValueError(
            f"--out {out} already holds a run ({', '.join(found)}): continue it with --resume, replace it with "
            "--overwrite (deletes those outputs), or choose another --out"
        )
    return False


def clear_run(out: Path) -> list[str]:
    """Delete the previous run's outputs in ``out`` (only the names of :data:`RUN_OUTPUTS`); returns what it removed."""
    removed = []
    for name in RUN_OUTPUTS:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(name)
    return removed
