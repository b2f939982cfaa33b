"""Import smoke test of one package installed WITHOUT its optional extras (run by `nox -s test_isolated`).

    python tools/import_smoke.py <package>

Checks, in the current environment:

1. megatron-core is absent when the package does not need it at runtime (the environment really lacks the extra);
2. every module of the package imports, except the megatron-only ones (a ``megatron`` subpackage), which must raise
   an ``ImportError`` naming the extra (``pip install '<pkg>[megatron]'``);
3. the megatron-only entry points that are functions (``PackedSeqs.to_packed_seq_params``,
   ``megatron_cpu_context``) raise that ``ImportError`` too.

Exit status 1 with one line per failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _thd_packing_entry() -> None:
    import thd_packing

    thd_packing.PackedSeqs.from_lengths([2, 3]).to_packed_seq_params()


def _testkit_entry() -> None:
    import dsv4_testkit

    with dsv4_testkit.megatron_cpu_context():
        pass


ENTRY_POINTS = {"thd-packing": [_thd_packing_entry], "dsv4-testkit": [_testkit_entry]}


def _extra_error(exc: BaseException, dist: str) -> bool:
    """An ImportError that names an extra of this package or of a package below it."""
    msg = str(exc)
    return isinstance(exc, ImportError) and "[megatron]'" in msg and "pip install" in msg


def smoke(dist: str) -> list[str]:
    meta = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())
    base = meta["project"].get("dependencies", [])
    needs_megatron = any(r.replace(" ", "").startswith("megatron-core") for r in base)
    errors: list[str] = []
    has_megatron = importlib.util.find_spec("megatron") is not None
    if not needs_megatron and has_megatron:
        errors.append(f"{dist}: megatron is importable in an environment built without the [megatron] extra")
    name = dist.replace("-", "_")
    pkg = importlib.import_module(name)
    imported = gated = 0
    root = Path(pkg.__file__).parent
    for file in sorted(root.rglob("*.py")):  # every module file (namespace subpackages included)
        parts = file.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts:
            continue
        mod = ".".join((name, *parts))
        megatron_only = "megatron" in mod.split(".")[1:]
        try:
            importlib.import_module(mod)
        except Exception as exc:
            if megatron_only and not has_megatron and _extra_error(exc, dist):
                gated += 1
                continue
            errors.append(f"{mod}: import failed: {type(exc).__name__}: {exc}")
            continue
        if megatron_only and not has_megatron:
            errors.append(
                f"{mod}: megatron-only module imported without megatron-core (no ImportError naming the extra)"
            )
        imported += 1
    if not has_megatron:
        for entry in ENTRY_POINTS.get(dist, []):
            try:
                entry()
            except Exception as exc:
                if _extra_error(exc, dist):
                    gated += 1
                    continue
                errors.append(f"{entry.__name__}: {type(exc).__name__}: {exc}")
            else:
                errors.append(
                    f"{entry.__name__}: ran without megatron-core (expected an ImportError naming the extra)"
                )
    print(
        f"import smoke {dist}: {imported} modules imported, {gated} megatron-only entry points refused with the "
        f"extra named (megatron-core {'present' if has_megatron else 'absent'})"
    )
    return errors


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    errors = smoke(sys.argv[1])
    for e in errors:
        print(e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
