"""Each package's tests against its siblings' released wheels at the low end of its ranges (`nox -s compat`).

    python3 -m uv run --locked python tools/compat.py [--mode lowest|previous ...] [--package NAME ...]

Modes (the sibling versions come from the find-links folder of ``tools/build_index.py``):
  lowest    every sibling at the lowest release inside every range the working tree declares on it (what
            ``--resolution lowest-direct`` picks for the siblings, without lowering torch, numpy & co.)
  previous  every sibling at its newest release older than its current one that is still inside those ranges
            (the lowest, where no older release fits)
A package on which no sibling declares a range (dsv4-testkit: the test groups name it bare) is at its current
release in both modes.
Third-party packages are pinned to the workspace's ``uv.lock`` (``uv export``), so only the siblings differ from
the ordinary test run. One venv per mode holds every package's released wheel at its pin; for each package in turn
its working tree replaces its wheel (an editable install, without dependencies), its tests run, and its pinned wheel
goes back: the package under test is the new code, everything it imports from a sibling is a released wheel. A mode
whose pins equal an earlier mode's is not run twice.

The tests are a fast subset (CI time): each package's ``tests/test_public_api.py`` and the core tests of
``CORE_TESTS`` (quick files that call into the siblings).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import build_index
import release_history as rh
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from release import uv_command

MODES = ("lowest", "previous")
#: per package, besides tests/test_public_api.py: quick test files that exercise the siblings it imports
CORE_TESTS = {
    "thd-packing": ["tests/test_packed_seqs.py"],  # PackedSeqs on dsv4_primitives.varlen
    "csa-kernels": ["tests/ref/test_visibility.py"],  # index maps from SeqBoundaries (dsv4-primitives)
    "mhc": ["tests/test_oracles.py"],
    "hash-moe": ["tests/test_hash.py"],  # document ids through dsv4_primitives.varlen
    "dsv4-attention": ["tests/test_layout_host_bounds.py"],  # layouts -> csa-kernels ops on SeqBoundaries
    "hybrid-model": ["tests/test_symbols.py"],  # the pattern symbols over every sibling's layer
    "dsv4-train": ["tests/test_vpp_config.py"],  # the trainer config over hybrid-model's pattern segments
    "dsv4-testkit": ["tests/test_poison.py", "tests/test_triton_env.py"],  # it has no test_public_api.py
    "dsv4-primitives": ["tests/test_varlen.py"],  # with the released testkit
}
CPU_MARKERS = "not gpu and not benchmark and not distributed"


def sibling_ranges(root: Path) -> dict[str, SpecifierSet]:
    """sibling -> the intersection of every range the working tree declares on it."""
    names = set(rh.package_names(root))
    ranges = {p: SpecifierSet() for p in names}
    for package in names:
        for line in rh.sibling_requirements((root / "packages" / package / "pyproject.toml").read_text()):
            req = Requirement(line)
            if canonicalize_name(req.name) in names:
                ranges[canonicalize_name(req.name)] &= req.specifier
    return ranges


def pins(root: Path, mode: str) -> dict[str, str]:
    """package -> the released version installed in ``mode``."""
    result = {}
    for package, spec in sibling_ranges(root).items():
        released = [r.version for r in rh.releases(package, root)]
        inside = sorted((v for v in released if spec.contains(v)), key=Version)
        if not inside:
            raise ValueError(
                f"no release of {package} fits the ranges {spec} (released: {', '.join(released)})"
            )
        current = Version(rh.current_version(package, root))
        if not str(
            spec
        ):  # no sibling declares a range on it (the testkit's test groups): its current release
            result[package] = max((v for v in inside if Version(v) <= current), key=Version)
            continue
        older = [v for v in inside if Version(v) < current]
        result[package] = inside[0] if mode == "lowest" or not older else older[-1]
    return result


def test_files(root: Path, package: str) -> list[str]:
    base = root / "packages" / package
    public = ["tests/test_public_api.py"] if (base / "tests" / "test_public_api.py").is_file() else []
    files = [*public, *CORE_TESTS.get(package, [])]
    missing = [f for f in files if not (base / f).is_file()]
    if missing:
        raise ValueError(
            f"tools/compat.py CORE_TESTS: {package} has no {', '.join(missing)}; update the list"
        )
    return [f"packages/{package}/{f}" for f in files]


def requirements(root: Path, chosen: dict[str, str]) -> list[str]:
    """The released packages at their pins (with their extras) and every test group's third-party packages."""
    names = set(rh.package_names(root))
    reqs = []
    for package, version in sorted(chosen.items()):
        data = tomllib.loads((root / "packages" / package / "pyproject.toml").read_text())
        extras = [e for e in data["project"].get("optional-dependencies", {}) if e == "megatron"]
        reqs.append(f"{package}{'[' + ','.join(extras) + ']' if extras else ''}=={version}")
        for line in data.get("dependency-groups", {}).get("test", []):
            if canonicalize_name(Requirement(line).name) not in names and line not in reqs:
                reqs.append(line)
    return reqs


def make_env(root: Path, venv: Path, chosen: dict[str, str], index: Path) -> Path:
    uv = uv_command()
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    subprocess.run(
        [*uv, "venv", "--quiet", "--clear", "--python", sys.executable, str(venv)], check=True, env=env
    )
    with tempfile.TemporaryDirectory(prefix="dsv4-compat-") as tmp:
        constraints = Path(tmp) / "constraints.txt"
        export = [
            *uv,
            "export",
            "--frozen",
            "--no-emit-workspace",
            "--no-hashes",
            "--all-packages",
            "--quiet",
        ]
        subprocess.run([*export, "--all-groups", "-o", str(constraints)], cwd=root, check=True, env=env)
        python = venv / "bin" / "python"
        install = [*uv, "pip", "install", "--quiet", "--python", str(python), "--find-links", str(index)]
        cmd = [*install, "-c", str(constraints), *requirements(root, chosen)]
        subprocess.run(cmd, cwd=root, check=True, env=env)
    return venv / "bin" / "python"


def check_fits(root: Path, package: str, chosen: dict[str, str]) -> None:
    """The working tree's ranges of ``package`` admit the pinned siblings (else the run would test nothing real)."""
    names = set(rh.package_names(root))
    for line in rh.sibling_requirements((root / "packages" / package / "pyproject.toml").read_text()):
        req = Requirement(line)
        dep = canonicalize_name(req.name)
        if dep in names and not req.specifier.contains(chosen[dep]):
            raise ValueError(f"{package} requires {line}, but the pinned {dep} is {chosen[dep]}")


def run_mode(root: Path, mode: str, chosen: dict[str, str], packages: list[str], index: Path) -> list[str]:
    """Failed packages of one mode."""
    print(
        f"compat[{mode}]: siblings at {', '.join(f'{p} {v}' for p, v in sorted(chosen.items()))}", flush=True
    )
    python = make_env(root, root / ".nox" / f"compat-{mode}", chosen, index)
    install = [*uv_command(), "pip", "install", "--quiet", "--python", str(python), "--no-deps"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "UV_PYTHON_DOWNLOADS": "never"}
    failed = []
    for package in packages:
        check_fits(root, package, chosen)
        files = test_files(root, package)
        print(f"compat[{mode}] {package} (working tree) on released siblings: {' '.join(files)}", flush=True)
        subprocess.run([*install, "-e", f"packages/{package}"], cwd=root, env=env, check=True)
        try:
            cmd = [str(python), "-m", "pytest", *files, "-q", "-m", CPU_MARKERS]
            code = subprocess.run(cmd, cwd=root, env=env).returncode
        finally:
            wheel = [*install, "--find-links", str(index), "--reinstall-package", package]
            subprocess.run([*wheel, f"{package}=={chosen[package]}"], cwd=root, env=env, check=True)
        if code not in (0, 5):
            failed.append(f"{mode}: {package} (exit {code})")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, action="append", help="default: both")
    parser.add_argument("--package", action="append", help="default: every package with siblings")
    parser.add_argument("--root", type=Path, default=rh.ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = args.root
    try:
        rh.require_history(root)
    except rh.HistoryMissing as err:
        print(f"compat: {err}", file=sys.stderr)
        return 2
    index = build_index.DEFAULT_OUT
    build_index.main(["--out", str(index)])
    with_siblings = [
        p
        for p in rh.package_names(root)
        if any(
            canonicalize_name(Requirement(r).name) in rh.package_names(root)
            for r in rh.sibling_requirements((root / "packages" / p / "pyproject.toml").read_text())
        )
    ]
    packages = args.package or with_siblings
    failed: list[str] = []
    done: dict[tuple, str] = {}
    for mode in args.mode or MODES:
        chosen = pins(root, mode)
        key = tuple(sorted(chosen.items()))
        if key in done:
            print(f"compat[{mode}]: the same sibling versions as [{done[key]}]; not run again", flush=True)
            continue
        done[key] = mode
        failed += run_mode(root, mode, chosen, packages, index)
    print("compat: " + ("FAILED: " + "; ".join(failed) if failed else "all passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
