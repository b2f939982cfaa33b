"""Check the workspace's package dependency rules (run by `nox -s dag`).

Rules (README.md "Packages"): a package may depend only on packages listed above it in ORDER; dsv4-testkit is a
test-only dependency; every cross-package import must be declared in the importer's pyproject; nobody imports
another package's private (``_``-prefixed) module; megatron-core is imported only where it is declared: a package with
megatron-core as a base dependency may import it anywhere, a package with it only in its ``[megatron]`` extra (directly
or through another member's ``[megatron]``) only inside functions or in its ``megatron/`` subpackage (whose
``__init__`` raises an ``ImportError`` naming the extra); no import circle between the files of one package
(``tools/import_graph.py``); a console script is declared by one package only and points into that package or a runtime
dependency above it (two packages declaring ``dsv4`` left whichever installed last as the command). Exit status 1 with one line per violation.

It also lists, without failing, every first-party import made inside a function of a package's sources (imports
belong at module top; one inside a function is kept only for an optional dependency or an import-order constraint,
with a comment saying why).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

from import_graph import function_level_imports, import_circles

ROOT = Path(__file__).resolve().parents[1]
ORDER = [
    "dsv4-primitives",
    "thd-packing",
    "csa-kernels",
    "mhc",
    "hash-moe",
    "dsv4-attention",
    "hybrid-model",
    "dsv4-train",
    "dsv4-testkit",
]
TEST_ONLY = {"dsv4-testkit"}
IMPORT_NAME = {dist: dist.replace("-", "_") for dist in ORDER}
DIST_OF = {imp: dist for dist, imp in IMPORT_NAME.items()}


def _req_name(req: str) -> str:
    for sep in "<>=~!;[ ":
        req = req.split(sep, 1)[0]
    return req.strip()


def declared(dist: str) -> tuple[set[str], set[str]]:
    meta = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())
    runtime = {_req_name(r) for r in meta["project"].get("dependencies", [])}
    test = set(runtime)
    for group in meta.get("dependency-groups", {}).values():
        test |= {_req_name(r) for r in group if isinstance(r, str)}
    return runtime, test


def megatron_declared(dist: str) -> str | None:
    """``"base"`` when megatron-core is a runtime dependency, ``"extra"`` when only the ``[megatron]`` extra brings it
    (megatron-core or a member's ``[megatron]``), else ``None``."""
    meta = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())
    if any(_req_name(r) == "megatron-core" for r in meta["project"].get("dependencies", [])):
        return "base"
    for req in meta["project"].get("optional-dependencies", {}).get("megatron", []):
        if _req_name(req) == "megatron-core" or "[megatron]" in req.replace(" ", ""):
            return "extra"
    return None


def megatron_imports(path: Path) -> list[tuple[int, bool]]:
    """``(line, runs at import)`` of every ``megatron`` import (function bodies and ``if TYPE_CHECKING:`` blocks do
    not run at import)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    deferred = set()  # nodes that do not run at import: function bodies and TYPE_CHECKING blocks
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
            isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            deferred |= {id(n) for n in ast.walk(node) if n is not node}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        if any(n == "megatron" or n.startswith("megatron.") for n in names):
            found.append((node.lineno, id(node) not in deferred))
    return found


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def circle_errors(dist: str, package_dir: Path) -> list[str]:
    """One line per file-level import circle of the package whose import directory is ``package_dir``."""
    return [
        f"{dist}: import circle between files: {' <-> '.join(circle)} (break it: move what they share into a "
        "module of its own, or merge them)"
        for circle in import_circles(package_dir)
    ]


def inner_imports(dists: list[str]) -> list[str]:
    """One line per first-party import inside a function in the sources of ``dists``."""
    first_party = set(IMPORT_NAME.values())
    lines = []
    for dist in dists:
        src = ROOT / "packages" / dist / "src"
        for path in sorted(src.rglob("*.py")) if src.is_dir() else []:
            rel = path.relative_to(ROOT)
            lines += [
                f"{rel}:{n}: imports {mod} inside a function"
                for n, mod in function_level_imports(path, first_party)
            ]
    return lines


def script_errors(scripts: dict[str, dict[str, str]], runtime: dict[str, set[str]]) -> list[str]:
    """Console-script rule: ``scripts`` maps each package to its ``[project.scripts]`` (name -> ``module:function``),
    ``runtime`` to its runtime dependencies. A name declared by two packages is an error (the installer keeps
    whichever wrote the file last), and so is a target module outside the declaring package and its declared runtime
    dependencies above it."""
    errors: list[str] = []
    owners: dict[str, list[str]] = {}
    for dist, table in scripts.items():
        for name, target in table.items():
            owners.setdefault(name, []).append(dist)
            top = target.split(":", 1)[0].split(".", 1)[0]
            owner = DIST_OF.get(top)
            if owner is None or owner == dist:
                continue
            if owner not in runtime.get(dist, set()) or ORDER.index(owner) >= ORDER.index(dist):
                errors.append(
                    f"packages/{dist}/pyproject.toml: script {name!r} points into {owner} ({target}), which {dist} "
                    "may not import (declare the script in its own package)"
                )
    for name, dists in owners.items():
        if len(dists) > 1:
            errors.append(
                f"script {name!r} is declared by {', '.join(dists)}: keep it in one package's pyproject"
            )
    return errors


def check() -> list[str]:
    errors: list[str] = []
    present = [d for d in ORDER if (ROOT / "packages" / d / "pyproject.toml").is_file()]
    unknown = {p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()} - set(ORDER)
    errors += [
        f"packages/{u}: not in the layer table of tools/check_dag.py (add it in dependency order)"
        for u in unknown
    ]
    metas = {d: tomllib.loads((ROOT / "packages" / d / "pyproject.toml").read_text()) for d in present}
    errors += script_errors(
        {d: m["project"].get("scripts", {}) for d, m in metas.items()}, {d: declared(d)[0] for d in present}
    )
    for dist in present:
        rank = ORDER.index(dist)
        runtime, test = declared(dist)
        for dep in runtime & set(ORDER):
            if dep in TEST_ONLY and dist not in TEST_ONLY:
                errors.append(f"{dist}: {dep} is test-only but is a runtime dependency")
            elif ORDER.index(dep) >= rank and dep not in TEST_ONLY:
                errors.append(f"{dist}: depends on {dep}, which is not above it in the layer table")
        for kind, allowed in (("src", runtime), ("tests", test), ("benchmarks", test)):
            base = ROOT / "packages" / dist / kind
            for path in sorted(base.rglob("*.py")) if base.is_dir() else []:
                rel = path.relative_to(ROOT)
                for lineno, mod in imported_modules(path):
                    parts = mod.split(".")
                    target = DIST_OF.get(parts[0])
                    if target is None or target == dist:
                        continue
                    where = f"{rel}:{lineno}"
                    if target not in allowed:
                        errors.append(f"{where}: imports {parts[0]} but {dist} does not declare {target}")
                    elif kind == "src" and ORDER.index(target) >= rank:
                        errors.append(
                            f"{where}: imports {parts[0]}, which is not above {dist} in the layer table"
                        )
                    if any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                        errors.append(f"{where}: imports private module {mod} of {target}")
        megatron = megatron_declared(dist)
        src = ROOT / "packages" / dist / "src"
        if (src / IMPORT_NAME[dist]).is_dir():
            errors += circle_errors(dist, src / IMPORT_NAME[dist])
        for path in sorted(src.rglob("*.py")) if src.is_dir() else []:
            rel = path.relative_to(ROOT)
            in_subpackage = "megatron" in path.relative_to(src).parts[1:-1]
            for lineno, module_level in megatron_imports(path):
                if megatron is None:
                    errors.append(
                        f"{rel}:{lineno}: imports megatron but {dist} declares megatron-core nowhere"
                    )
                elif megatron == "extra" and module_level and not in_subpackage:
                    errors.append(
                        f"{rel}:{lineno}: module-level megatron import outside {dist}'s megatron/ subpackage, but "
                        "megatron-core is only its [megatron] extra (import it inside the function, or move the "
                        "module into the subpackage)"
                    )
    return errors


def main() -> int:
    inner = inner_imports(ORDER)
    for line in inner:
        print(line)
    errors = check()
    for e in errors:
        print(e)
    print(
        f"dag: {len(errors)} violation(s) in {len(ORDER)} packages; {len(inner)} first-party import(s) inside "
        "functions (listed, not failed: keep one only for an optional dependency or an import-order constraint, "
        "with a comment saying why)"
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
