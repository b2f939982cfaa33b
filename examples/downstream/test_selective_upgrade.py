"""A downstream project upgrades one slice alone (run by `nox -s downstream`; root README "Selective upgrade").

On a copy of this project (its committed ``uv.lock`` pins csa-kernels at its previous release, every other
package at its current one), with the released wheels of ``tools/build_index.py`` as the find-links folder:
  1. ``uv lock --locked``: the committed lock is current;
  2. ``uv lock --upgrade-package csa-kernels``: csa-kernels moves to its current release and nothing else in the
     lock changes (every other package's entry is identical);
  3. ``uv sync --locked`` and ``dsv4 train`` runs a few steps of the tiny model with finite losses, on the upgraded
     csa-kernels;
  4. ``uv lock --upgrade-package csa-kernels==<previous>`` gives back the committed lock, byte for byte, and
     ``uv sync --locked`` installs the previous csa-kernels again.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SLICE = "thd-packing"
STEPS = 2


def _uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    assert found, "uv not found: run through `python3 -m uv run --locked nox -s downstream`"
    return found


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert out.returncode == 0, (
        f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out.stdout + out.stderr


def _packages(lock_text: str) -> dict[str, dict]:
    return {p["name"]: p for p in tomllib.loads(lock_text)["package"]}


def _current_version(package: str) -> str:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]["version"]


def _workspace_packages() -> list[str]:
    return sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def _installed(project: Path, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return _run([str(project / ".venv" / "bin" / "python"), "-c", code], project).strip()


def test_upgrade_one_slice_then_downgrade(tmp_path: Path) -> None:
    _run([sys.executable, str(ROOT / "tools" / "build_index.py")], ROOT)
    # the project's find-links folder is ../../dist/index: the copy keeps that layout
    project = tmp_path / "examples" / "downstream"
    shutil.copytree(HERE, project, ignore=shutil.ignore_patterns(".venv", "__pycache__", "runs"))
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "index").symlink_to(ROOT / "dist" / "index")
    env = {"UV_PROJECT_ENVIRONMENT": str(project / ".venv"), "UV_PYTHON_DOWNLOADS": "never"}
    uv = _uv()

    committed = (project / "uv.lock").read_text()
    _run([uv, "lock", "--locked"], project, env)
    before = _packages(committed)
    previous, current = before[SLICE]["version"], _current_version(SLICE)
    assert previous != current, (
        f"the committed lock should pin {SLICE} below its current release {current}: after a release, re-lock the "
        f"example (README 'Selective upgrade')"
    )

    _run([uv, "lock", "--upgrade-package", SLICE], project, env)
    after = _packages((project / "uv.lock").read_text())
    assert after[SLICE]["version"] == current, (
        f"{SLICE} moved to {after[SLICE]['version']}, not {current}; if a breaking release moved the ranges, move "
        f"the example's ranges and re-lock it (README 'Selective upgrade')"
    )
    ours = set(before) & set(_workspace_packages())
    assert ours and all(after[p]["source"] == {"registry": "../../dist/index"} for p in ours), (
        "every DSv4 package must come from the local index"
    )
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    assert changed == [SLICE], f"upgrading {SLICE} alone also changed {changed}"

    _run([uv, "sync", "--locked"], project, env)
    assert _installed(project, SLICE) == current
    train = [
        str(project / ".venv" / "bin" / "dsv4"), "train", "--steps", str(STEPS), "--seq-len", "64",
        "--global-batch-size", "2", "--micro-batch-size", "2", "--data", "corpus.txt",
        "--out", "runs/upgraded", "--no-save-final", "--eval-interval", "0",
    ]  # fmt: skip
    _run(train, project, {"OMP_NUM_THREADS": "2"})
    rows = [
        json.loads(line)
        for line in (project / "runs" / "upgraded" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["lm_loss"]) and not r["skipped"] for r in rows), rows

    _run([uv, "lock", "--upgrade-package", f"{SLICE}=={previous}"], project, env)
    assert (project / "uv.lock").read_text() == committed, (
        "the downgrade did not give back the committed lock"
    )
    _run([uv, "sync", "--locked"], project, env)
    assert _installed(project, SLICE) == previous
