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
whose pins equal an earlier mode's is not run twice, and the modes run at the same time (each in its own venv).

A package is tested in a mode only when a sibling in its closure (its dependencies, extras and test group, followed
through the siblings' own) is pinned to a release whose code differs from the working tree's (``git diff`` of the
sibling's ``src/`` and ``pyproject.toml`` against the release commit): otherwise it would run on the working-tree
code of every sibling, which is what ``nox -s test`` already does, and the run is skipped with a line saying so.

The tests are a fast subset (CI time): each package's ``tests/test_public_api.py`` and the core tests of
``CORE_TESTS`` (quick files that call into the siblings).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
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
#: bytecode of the compat venvs' torch / megatron, written by the first pytest process and read by the others (as
#: in noxfile.py's test sessions: CI sets PYTHONDONTWRITEBYTECODE=1)
PYCACHE = rh.ROOT / ".nox" / "pycache"


def closure(root: Path, package: str) -> set[str]:
    """The siblings ``package`` needs, directly or through other siblings (dependencies, extras, test group)."""
    names = set(rh.package_names(root))
    seen: set[str] = set()
    todo = [package]
    while todo:
        current = todo.pop()
        text = (root / "packages" / current / "pyproject.toml").read_text()
        for line in rh.sibling_requirements(text):
            dep = canonicalize_name(Requirement(line).name)
            if dep in names and dep != package and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def differing(root: Path, chosen: dict[str, str]) -> set[str]:
    """The pinned siblings whose released code differs from the working tree (src/ or pyproject.toml)."""
    result = set()
    for package, version in chosen.items():
        commit = {r.version: r.commit for r in rh.releases(package, root)}[version]
        paths = [f"packages/{package}/src", f"packages/{package}/pyproject.toml"]
        same = subprocess.run(["git", "diff", "--quiet", commit, "--", *paths], cwd=root).returncode == 0
        if not same:
            result.add(package)
    return result


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


def run_mode(
    root: Path,
    mode: str,
    chosen: dict[str, str],
    packages: list[str],
    index: Path,
    out: io.TextIOBase,
    reports: Path | None = None,
) -> list[str]:
    """Failed packages of one mode (its output goes to ``out``)."""

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    say(f"compat[{mode}]: siblings at {', '.join(f'{p} {v}' for p, v in sorted(chosen.items()))}")
    changed = differing(root, chosen)
    todo = []
    for package in packages:
        check_fits(root, package, chosen)
        if closure(root, package) & changed:
            todo.append(package)
        else:
            say(
                f"compat[{mode}] {package}: skipped, every sibling it needs is pinned to a release with the working "
                "tree's code (the same run as `nox -s test`)"
            )
    if not todo:
        return []
    python = make_env(root, root / ".nox" / f"compat-{mode}", chosen, index)
    install = [*uv_command(), "pip", "install", "--quiet", "--python", str(python), "--no-deps"]
    env = {
        **os.environ,
        "OMP_WAIT_POLICY": "PASSIVE",
        "UV_PYTHON_DOWNLOADS": "never",
        "PYTHONDONTWRITEBYTECODE": "",
        "PYTHONPYCACHEPREFIX": str(PYCACHE),
    }
    failed = []
    for package in todo:
        files = test_files(root, package)
        released = sorted(closure(root, package) & changed)
        say(f"compat[{mode}] {package} (working tree) on released {', '.join(released)}: {' '.join(files)}")
        subprocess.run([*install, "-e", f"packages/{package}"], cwd=root, env=env, check=True)
        try:
            cmd = [str(python), "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-m", CPU_MARKERS]
            if reports is not None:
                cmd.append(f"--junitxml={reports / f'compat-{mode}-{package}.xml'}")
            proc = subprocess.run(
                cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            say(proc.stdout.rstrip())
        finally:
            wheel = [*install, "--find-links", str(index), "--reinstall-package", package]
            subprocess.run([*wheel, f"{package}=={chosen[package]}"], cwd=root, env=env, check=True)
        if proc.returncode not in (0, 5):
            failed.append(f"{mode}: {package} (exit {proc.returncode})")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, action="append", help="default: both")
    parser.add_argument("--package", action="append", help="default: every package with siblings")
    parser.add_argument(
        "--reports", type=Path, help="write junit XML per run here (compat-MODE-PACKAGE.xml; nox: .reports)"
    )
    parser.add_argument("--root", type=Path, default=rh.ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = args.root
    if args.reports is not None:
        args.reports.mkdir(parents=True, exist_ok=True)
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
    runs: list[tuple[str, dict[str, str]]] = []
    done: dict[tuple, str] = {}
    for mode in args.mode or MODES:
        chosen = pins(root, mode)
        key = tuple(sorted(chosen.items()))
        if key in done:
            print(f"compat[{mode}]: the same sibling versions as [{done[key]}]; not run again", flush=True)
            continue
        done[key] = mode
        runs.append((mode, chosen))

    def one(run: tuple[str, dict[str, str]]) -> tuple[list[str], str]:
        out = io.StringIO()
        return run_mode(root, run[0], run[1], packages, index, out, args.reports), out.getvalue()

    failed: list[str] = []
    with ThreadPoolExecutor(max_workers=len(runs) or 1) as pool:  # the modes' venvs are separate: at once
        for fails, text in pool.map(one, runs):
            print(text, end="", flush=True)
            failed += fails
    print("compat: " + ("FAILED: " + "; ".join(failed) if failed else "all passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
