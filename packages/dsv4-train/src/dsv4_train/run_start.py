"""The first lines of a ``dsv4 train`` run (logging rank): the effective config written to the run directory and
its settings that differ from the defaults, and whether the run resumed (from where) or started fresh (and what it
replaced)."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4_train.ckpt_integrity import unverified_note
from dsv4_train.config import TrainConfig
from dsv4_train.rundir import CONFIG_FILE


def announce_start(
    tc: TrainConfig,
    out: Path,
    *,
    resumed: bool,
    step: int,
    verified: bool,
    data_notes: list[str],
    cleared: list[str],
) -> None:
    """One line saying whether this run resumed (from where) or started fresh (and what it replaced); the
    effective config written to the run directory, and its settings that differ from the defaults."""
    (out / CONFIG_FILE).write_text(json.dumps(tc.to_dict(), indent=1) + "\n")
    default = TrainConfig.from_flat().flat()
    changed = [f"{k}={v}" for k, v in tc.flat().items() if v != default[k]]
    print(f"dsv4 train: config {out / CONFIG_FILE}: {', '.join(changed) or 'the defaults'}", flush=True)
    if resumed and not verified:
        print(f"dsv4 train: note: {unverified_note(out / 'checkpoints' / f'iter_{step:07d}')}")
    for note in data_notes:
        print(note, flush=True)
    if resumed:
        ignored = (
            f"; --init-from {tc.checkpoint.init_from} is not used (the checkpoint has the weights)"
            if tc.checkpoint.init_from
            else ""
        )
        print(
            f"dsv4 train: resuming {out / 'checkpoints' / f'iter_{step:07d}'} at step {step}{ignored}",
            flush=True,
        )
    elif tc.checkpoint.resume == "auto":
        replaced = f" (replacing {', '.join(cleared)})" if cleared else ""
        print(
            f"dsv4 train: --resume auto: no checkpoint in {out}, starting a new run{replaced}",
            flush=True,
        )
    elif cleared:
        print(f"dsv4 train: --overwrite: removed {', '.join(cleared)} of the previous run in {out}")


__all__ = ["announce_start"]
