"""A local package index built from the repository's history: a flat ``find-links`` directory of wheels.

    python3 -m uv run --locked python tools/build_index.py [--out dist/index] [--all]

For every package it builds, from the commit that released them (``tools/release_history.py``), the wheels of
  - the current release (the pyproject's version, once released) and the release before it,
  - the lowest release inside every sibling range that the working tree declares on it (what ``nox -s compat``
    installs), and with ``--all`` every release.
Each release's package folder is exported with ``git archive`` into a temporary directory and built there with
``uv build --wheel``, hatchling pinned (``HATCHLING``) so that a wheel rebuilt later, on another machine, has the
same bytes and hash (hatchling's builds are reproducible: fixed timestamps); a downstream ``uv.lock`` that
records those hashes then stays valid. A wheel already in the folder is kept when it was built from the same commit (the folder is a cache).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import release_history as rh
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from release import uv_command

HATCHLING = "hatchling==1.33.0"
JOBS = 2
DEFAULT_OUT = rh.ROOT / "dist" / "index"


def wheel_name(package: str, version: str) -> str:
    return f"{canonicalize_name(package).replace('-', '_')}-{version}-py3-none-any.whl"


def range_floors(root: Path) -> dict[str, set[str]]:
    """package -> the lowest released version inside each sibling range the working tree declares on it."""
    names = set(rh.package_names(root))
    released = {p: [r.version for r in rh.releases(p, root)] for p in names}
    floors: dict[str, set[str]] = {p: set() for p in names}
    for package in names:
        text = (root / "packages" / package / "pyproject.toml").read_text()
        for line in rh.sibling_requirements(text):
            req = Requirement(line)
            dep = canonicalize_name(req.name)
            if dep not in names or not str(req.specifier):
                continue
            inside = [v for v in released[dep] if req.specifier.contains(v)]
            if inside:
                floors[dep].add(min(inside, key=Version))
    return floors


def wanted(root: Path, every: bool) -> list[rh.Release]:
    """The releases the index holds (see the module docstring)."""
    floors = range_floors(root)
    result = []
    for package in rh.package_names(root):
        history = rh.releases(package, root)
        current = rh.current_version(package, root)
        versions = [r.version for r in history]
        keep = set(floors[package])
        if current in versions:
            i = versions.index(current)
            keep.update(versions[max(0, i - 1) : i + 1])
        elif versions:  # the pyproject's version is being released: its latest two releases
            keep.update(versions[-2:])
        result += [r for r in history if every or r.version in keep]
    return result


def build_release(release: rh.Release, out: Path, root: Path) -> Path:
    """The wheel of ``release``, built from its release commit into ``out`` (kept if already there)."""
    target = out / wheel_name(release.package, release.version)
    stamp = out / f".{target.name}.commit"  # the commit the cached wheel was built from
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == release.commit:
        return target
    target.unlink(missing_ok=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", release.commit, f"packages/{release.package}"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="dsv4-index-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        constraint = Path(tmp) / "build-constraints.txt"
        constraint.write_text(HATCHLING + "\n")
        cmd = [
            *uv_command(), "build", "--wheel", "--quiet", "--python", sys.executable,
            "--build-constraint", str(constraint), "--out-dir", str(out), f"{tmp}/packages/{release.package}",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})
    if not target.is_file():
        raise RuntimeError(
            f"building {release.package} {release.version} at {release.commit[:10]} made no {target}"
        )
    with zipfile.ZipFile(target) as whl:
        meta = whl.read(f"{target.name.split('-py3')[0]}.dist-info/METADATA").decode()
    if f"\nVersion: {release.version}\n" not in meta:
        raise RuntimeError(f"{target}: metadata does not say version {release.version}")
    stamp.write_text(release.commit + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the find-links folder (default dist/index)"
    )
    parser.add_argument(
        "--all", action="store_true", help="every release, not only current / previous / floors"
    )
    parser.add_argument("--root", type=Path, default=rh.ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        rh.require_history(args.root)
    except rh.HistoryMissing as err:
        print(f"build_index: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    todo = wanted(args.root, args.all)
    with ThreadPoolExecutor(max_workers=JOBS) as pool:  # builds wait on processes and files: two at a time
        paths = list(pool.map(lambda r: build_release(r, args.out, args.root), todo))
    for release, path in zip(todo, paths, strict=True):
        print(f"{release.package} {release.version} ({release.commit[:10]}): {path.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
