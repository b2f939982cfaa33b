"""nox sessions for the workspace. Always start nox through uv: `python3 -m uv run --locked nox -s <session>`.

Sessions:
  test(package=...)          CPU tests of one package in the synced .venv (gpu/benchmark markers excluded)
  test_isolated(package=...) import smoke without extras, then the tests with them, in a venv holding only
                             that package's declared closure
  lint                       ruff format --check + ruff check
  dag                        package dependency rules (tools/check_dag.py)
  gpu                        gpu-marked tests (says so and exits 0 without CUDA)
  bench                      benchmark scripts (says so and exits 0 without CUDA)
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
CPU_MARKERS = "not gpu and not benchmark"

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "dag", "test"]


def _cuda_available(session: nox.Session) -> bool:
    out = session.run(
        "python", "-c", "import torch; print(int(torch.cuda.is_available()))", silent=True, external=True
    )
    return out.strip().endswith("1")


def _pytest(session: nox.Session, package: str, *extra: str) -> None:
    reports = ROOT / ".reports"
    reports.mkdir(exist_ok=True)
    session.run(
        "python",
        "-m",
        "pytest",
        f"packages/{package}/tests",
        "-q",
        f"--junitxml={reports / (package + '.xml')}",
        *extra,
        *session.posargs,
        success_codes=[0, 5],  # 5 = no tests collected (e.g. a package with only gpu tests under -m)
        external=True,
    )


@nox.session(venv_backend="none")
@nox.parametrize("package", PACKAGES)
def test(session: nox.Session, package: str) -> None:
    """CPU tests of one package, reusing the .venv that `uv run --locked` synced."""
    _pytest(session, package, "-m", CPU_MARKERS)


@nox.session(python="3.12")
@nox.parametrize("package", PACKAGES)
def test_isolated(session: nox.Session, package: str) -> None:
    """Tests in a venv built only from the package's declared closure: catches undeclared imports.

    Two steps: (1) the package alone, without its extras or test group (an exact sync, so nothing else is left
    in the venv), and ``tools/import_smoke.py``: every module imports, megatron-only ones refuse with an
    ``ImportError`` naming the extra; (2) the package with every extra and its test group, and the full CPU tests.
    """
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    sync = ("uv", "sync", "--frozen", "--package", package, "--no-default-groups")
    session.run_install(*sync, env=env, external=True)
    session.run("python", "tools/import_smoke.py", package)
    extras = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    extra_args = [f"--extra={e}" for e in extras.get("optional-dependencies", {})]
    session.run_install(*sync, *extra_args, "--group", "test", "--inexact", env=env, external=True)
    session.run(
        "python", "-m", "pytest", f"packages/{package}/tests", "-q", "-m", CPU_MARKERS, *session.posargs
    )


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff format check and ruff lint over packages/, tools/, ci/ and the noxfile (config at the root)."""
    targets = ["packages", "tools", "ci", "noxfile.py"]
    session.run("ruff", "format", "--check", *targets, external=True)
    session.run("ruff", "check", *targets, external=True)


@nox.session(venv_backend="none")
def dag(session: nox.Session) -> None:
    """Fail on undeclared, upward or private cross-package imports."""
    session.run("python", "tools/check_dag.py", external=True)


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
