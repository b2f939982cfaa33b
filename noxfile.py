"""nox sessions for the workspace. Always start nox through uv: `python3 -m uv run --locked nox -s <session>`.

Sessions:
  test(package=...)          CPU tests of one package in the synced .venv (gpu/benchmark markers excluded)
  test_all                   every package's CPU tests in one pool of concurrent pytest processes (what CI runs)
  test_isolated(package=...) import smoke without extras, then the tests with them, in a venv holding only
                             that package's declared closure
  lint                       ruff format --check + ruff check
  dag                        package dependency rules and import circles (tools/check_dag.py, its tests); released
                             CHANGELOG sections never change (tools/check_changelogs.py)
  release                    release one package: `nox -s release -- csa-kernels [--minor|--patch|--dry-run]`
  downstream                 examples/downstream upgrades thd-packing alone and trains (README 'Selective upgrade')
  compat                     each package's fast tests on its siblings' released wheels at their range floors and
                             previous releases (tools/compat.py)
  gpu                        gpu-marked tests (says so and exits 0 without CUDA)
  bench                      benchmark scripts (says so and exits 0 without CUDA)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
CPU_MARKERS = "not gpu and not benchmark"
#: extras that install only on a CUDA machine: transformer-engine (hybrid-model `gpu`) and fla (hybrid-model `gdn`,
#: which fails to import without a GPU)
GPU_ONLY_EXTRAS = frozenset({"gpu", "gdn"})

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "dag", "test_all"]


def _cuda_available(session: nox.Session) -> bool:
    out = session.run(
        "python", "-c", "import torch; print(int(torch.cuda.is_available()))", silent=True, external=True
    )
    return out.strip().endswith("1")


# Concurrent pytest processes for `nox -s test_all` and per package for `nox -s test` (CI's 2-core box): many tests
# wait on subprocesses, spawned gloo worlds or single-threaded interpreter loops, so one process leaves a core idle
# much of the time. Files are split greedily by ci/test_weights.json (seconds per test file; a missing file counts
# as DEFAULT_WEIGHT); DSV4_TEST_SHARDS=1 runs one process at a time. Module-scoped fixtures stay within one file.
TEST_SHARDS = int(os.environ.get("DSV4_TEST_SHARDS", "2"))
DEFAULT_WEIGHT = 10.0


# Bytecode: the CI image sets PYTHONDONTWRITEBYTECODE=1, so every Python process of a test run (each pytest, each
# `dsv4 train` subprocess, each spawned gloo worker) compiled the torch / megatron modules it imports from source:
# ~6 s of CPU per process on top of ~3 s of imports. The test sessions cache bytecode under .nox/pycache instead
# (outside the source tree and the venv; the first process of a run writes it, atomically, the others read it).
BYTECODE_ENV = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(ROOT / ".nox" / "pycache")}
# OpenMP: the shards (and the tests' 2-thread `dsv4 train` subprocesses) share the 2 cores, so a thread that waits at
# the end of a parallel region sleeps instead of spinning on a core another process needs (numerics unchanged).
TEST_ENV = {**BYTECODE_ENV, "OMP_WAIT_POLICY": "PASSIVE"}


def _test_files(package: str) -> list[str]:
    tests = ROOT / "packages" / package / "tests"
    files = {*tests.rglob("test_*.py"), *tests.rglob("*_test.py")}
    return sorted(str(f.relative_to(ROOT)) for f in files if ".venv" not in f.parts)


def shard_files(files: list[str], weights: dict[str, float], shards: int) -> list[list[str]]:
    """``files`` in ``shards`` groups of about equal total weight (heaviest first onto the lightest group; each
    group keeps the sorted file order); empty groups are dropped."""
    groups: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(max(1, shards))]
    for f in sorted(files, key=lambda f: (-weights.get(f, DEFAULT_WEIGHT), f)):
        i = min(range(len(groups)), key=lambda k: groups[k][0])
        groups[i] = (groups[i][0] + weights.get(f, DEFAULT_WEIGHT), [*groups[i][1], f])
    return [sorted(g) for _, g in groups if g]


def plan_jobs(
    files: dict[str, list[str]], weights: dict[str, float], slots: int
) -> list[tuple[str, list[str]]]:
    """The pytest jobs ``(package, files)`` of one pool of ``slots`` concurrent processes over ``files`` (``{package:
    its test files}``), in the order to start them: a package heavier than one slot's share of the total weight is
    split (:func:`shard_files`) into ``ceil(weight / share)`` jobs, the others run whole (one process start each);
    heaviest first, so that the last jobs to start, the lightest, fill whichever slot frees first and the slots
    finish together. A job never mixes packages (each package's tests import their own helper modules by name)."""
    weight = {pkg: sum(weights.get(f, DEFAULT_WEIGHT) for f in fs) for pkg, fs in files.items() if fs}
    share = sum(weight.values()) / max(1, slots)
    jobs = []  # (weight, package, files)
    for pkg, w in weight.items():
        pieces = min(len(files[pkg]), math.ceil(w / share)) if share > 0 else 1
        for group in shard_files(files[pkg], weights, max(1, pieces)):
            jobs.append((sum(weights.get(f, DEFAULT_WEIGHT) for f in group), pkg, group))
    jobs.sort(key=lambda j: (-j[0], j[1]))
    return [(pkg, group) for _, pkg, group in jobs]


def _pytest_command(package: str, junit: Path, targets: list[str], extra, posargs) -> list[str]:
    return ["python", "-m", "pytest", *targets, "-q", f"--junitxml={junit}", *extra, *posargs]


def _weights() -> dict[str, float]:
    weights_file = ROOT / "ci" / "test_weights.json"
    return json.loads(weights_file.read_text()) if weights_file.is_file() else {}


def _pytest(session: nox.Session, package: str, *extra: str, shards: int = 1) -> None:
    reports = ROOT / ".reports"
    reports.mkdir(exist_ok=True)
    files = _test_files(package)
    groups = shard_files(files, _weights(), shards) if shards > 1 and not session.posargs else []
    if len(groups) < 2:
        # pytest arguments that name test files or node ids select what runs (not the whole tests folder as well)
        selected = any((ROOT / a.split("::")[0]).exists() for a in session.posargs if not a.startswith("-"))
        targets = [] if selected else [f"packages/{package}/tests"]
        session.run(
            *_pytest_command(package, reports / f"{package}.xml", targets, extra, session.posargs),
            success_codes=[0, 5],  # 5 = no tests collected (e.g. a package with only gpu tests under -m)
            external=True,
            env=TEST_ENV,
        )
        return
    _run_pool(session, [(package, g) for g in groups], extra, [], slots=len(groups))


def _run_pool(session: nox.Session, jobs: list[tuple[str, list[str]]], extra, posargs, slots: int) -> None:
    """Run the pytest ``jobs`` (``(package, files)``, in this order) with at most ``slots`` at a time, each starting
    as soon as a slot frees; the first job streams to the terminal (progress while the longest job runs), the others'
    output is printed when they end; junit reports ``.reports/<package>.<i>.xml`` (``i`` counts the package's jobs).
    Fails the session once every job ended if any exited other than 0 or 5."""
    reports = ROOT / ".reports"
    reports.mkdir(exist_ok=True)
    env = {**os.environ, **TEST_ENV}
    numbered, seen = [], {}
    for package, group in jobs:
        numbered.append((package, seen.setdefault(package, 0), group))
        seen[package] += 1
    failed = []
    with tempfile.TemporaryDirectory(prefix="nox-test-") as tmp:
        todo, running = list(numbered), []
        while todo or running:
            while todo and len(running) < max(1, slots):
                package, i, group = todo.pop(0)
                name = f"{package}.{i}"
                cmd = _pytest_command(
                    package, reports / f"{name}.xml", group, extra, ["--basetemp", f"{tmp}/{name}", *posargs]
                )
                first = len(todo) == len(numbered) - 1  # the job just popped is the pool's first
                log = None if first else open(f"{tmp}/{name}.log", "w")  # noqa: SIM115 (closed when the job ends)
                session.log(f"start {name}: {len(group)} files ({len(todo)} jobs waiting)")
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
                running.append((name, proc, log, time.monotonic()))
            time.sleep(0.2)
            for job in [j for j in running if j[1].poll() is not None]:
                name, proc, log, started = job
                running.remove(job)
                print(
                    f"\n---- {name} (exit {proc.returncode}, {time.monotonic() - started:.0f} s) ----",
                    flush=True,
                )
                if log is not None:
                    log.close()
                    print(Path(log.name).read_text(), flush=True)
                if proc.returncode not in (0, 5):  # 5 = no tests collected
                    failed.append(f"{name} (exit {proc.returncode})")
    if failed:
        session.error(f"pytest jobs failed: {', '.join(failed)}")


@nox.session(venv_backend="none")
@nox.parametrize("package", PACKAGES)
def test(session: nox.Session, package: str) -> None:
    """CPU tests of one package, reusing the .venv that `uv run --locked` synced (TEST_SHARDS concurrent pytest
    processes over its test files; one process when posargs select tests)."""
    _pytest(session, package, "-m", CPU_MARKERS, shards=TEST_SHARDS)


@nox.session(venv_backend="none")
def test_all(session: nox.Session) -> None:
    """CPU tests of every package (what the `test` sessions run one package after the other) in one pool of
    TEST_SHARDS concurrent pytest processes (:func:`plan_jobs`): no slot waits at a package's end for the other
    to finish that package. posargs are pytest options for every job (select tests with `test(package=...)`)."""
    files = {package: _test_files(package) for package in PACKAGES}
    _run_pool(
        session, plan_jobs(files, _weights(), TEST_SHARDS), ["-m", CPU_MARKERS], session.posargs, TEST_SHARDS
    )


@nox.session(python="3.12")
@nox.parametrize("package", PACKAGES)
def test_isolated(session: nox.Session, package: str) -> None:
    """Tests in a venv built only from the package's declared closure: catches undeclared imports.

    Two steps: (1) the package alone, without its extras or test group (an exact sync, so nothing else is left
    in the venv), and ``tools/import_smoke.py``: every module imports, megatron-only ones refuse with an
    ``ImportError`` naming the extra; (2) the package with every extra but the GPU-only ones (``GPU_ONLY_EXTRAS``)
    and its test group, and the full CPU tests.
    """
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    sync = ("uv", "sync", "--frozen", "--package", package, "--no-default-groups")
    session.run_install(*sync, env=env, external=True)
    session.run("python", "tools/import_smoke.py", package)
    extras = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    extra_args = [f"--extra={e}" for e in extras.get("optional-dependencies", {}) if e not in GPU_ONLY_EXTRAS]
    session.run_install(*sync, *extra_args, "--group", "test", "--inexact", env=env, external=True)
    session.run(
        "python",
        "-m",
        "pytest",
        f"packages/{package}/tests",
        "-q",
        "-m",
        CPU_MARKERS,
        *session.posargs,
        env=TEST_ENV,
    )


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff format check and ruff lint over packages/, tools/, ci/, examples/ and the noxfile (config at the root)."""
    targets = ["packages", "tools", "ci", "examples", "noxfile.py"]
    session.run("ruff", "format", "--check", *targets, external=True)
    session.run("ruff", "check", *targets, external=True)


@nox.session(venv_backend="none")
def dag(session: nox.Session) -> None:
    """Fail on undeclared, upward or private cross-package imports and on import circles between the files of one
    package (the rule's own tests in tools/tests run first); lists first-party imports inside functions. Then: released
    CHANGELOG sections never change (tools/check_changelogs.py, from the git history)."""
    session.run("python", "-m", "pytest", "tools/tests", "-q", external=True)
    session.run("python", "tools/check_dag.py", external=True)
    session.run("python", "tools/check_changelogs.py", external=True)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """gpu-marked tests of every package (CUDA only)."""
    if not _cuda_available(session):
        session.log("gpu: no CUDA device on this machine; nothing to run (see README 'GPU').")
        return
    for package in PACKAGES:
        _pytest(session, package, "-m", "gpu")


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Every benchmark script listed in packages/*/benchmarks/ (CUDA only); results land in benchmarks/results/."""
    if not _cuda_available(session):
        session.log("bench: no CUDA device on this machine; nothing to run (see README 'GPU').")
        return
    env = {"PYTHONPATH": os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))}
    for script in sorted((ROOT / "packages").glob("*/benchmarks/bench_*.py")):
        session.run("python", str(script), *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def downstream(session: nox.Session) -> None:
    """examples/downstream: a project on the released wheels (tools/build_index.py) upgrades thd-packing alone,
    trains a few steps, and downgrades it again (README 'Selective upgrade')."""
    junit = ROOT / ".reports" / "downstream.xml"
    session.run(
        "python",
        "-m",
        "pytest",
        "examples/downstream",
        "-q",
        f"--junitxml={junit}",
        *session.posargs,
        external=True,
    )


@nox.session(venv_backend="none")
def compat(session: nox.Session) -> None:
    """Each package's fast tests (public API + fastest files) with its working-tree sources on its siblings' released
    wheels: at the lowest releases its ranges allow and at their previous releases (tools/compat.py)."""
    session.run(
        "python", "tools/compat.py", "--reports", str(ROOT / ".reports"), *session.posargs, external=True
    )


@nox.session(venv_backend="none")
def release(session: nox.Session) -> None:
    """Release one package: `nox -s release -- NAME [--minor | --patch] [--dry-run] [--no-tag]` (tools/release.py)."""
    if not session.posargs:
        session.error("name the package: nox -s release -- NAME [--minor | --patch] [--dry-run] [--no-tag]")
    session.run("python", "tools/release.py", "release", *session.posargs, external=True)
